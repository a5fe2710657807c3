"""The image root's writable layer: the root link of an image call's chain.

bwrap 0.8 (Debian 12) has no ``--overlay-src``/``--tmp-overlay``; this link
is the equivalent. It runs as root, before the uid drop (like the cgroup
join), never in the worker's process::

    unshare --mount --propagation private -- /bin/bash -c OVERLAY_SCRIPT bash \\
        LOWER FD SIZE DIRS HOME OWNER ARGV...

1. ``unshare`` gives the call a mount namespace of its own with every mount
   private: nothing mounted here is seen by the host, and all of it goes
   away with the call's last process;
2. ``LOWER`` (the image's unpacked root) is opened in that namespace and must
   be the very directory the worker verified, which it passes as fd ``FD``
   (``test -ef``: same device and inode); ``FD`` is closed right after, so
   no descriptor of a host directory reaches the sandbox;
3. a tmpfs of ``SIZE`` bytes is mounted at ``MOUNT_DIR``, and over it an
   overlay (``nosuid,nodev``): the opened root as the read-only lower layer,
   a directory of the tmpfs as the upper (the call's writable layer, gone
   with the call);
4. the mount points ``DIRS`` the image lacks (relative to its root,
   space-separated; most images have them all) are made in the merged
   root, and ``HOME`` given to ``OWNER`` (UID:GID);
   the worker checked beforehand that none of these paths goes through a
   symlink in the image (``images.plain_path``), so ``mkdir -p`` cannot be
   led out of the merged root;
5. exec ``ARGV`` (``setpriv ... bwrap --bind MOUNT_DIR/m / ...``).

A shell script rather than Python: this link runs for every call, and
Python's start-up cost several times the rest (0.6-0.8 s against 0.07 s for
the script under this machine's load, measured by hand). bash, not dash:
dash takes only single-digit fds in redirections, and the root's fd is
opened at a free number (``{low}``) so it cannot replace an fd passed on
to bwrap. Exit code 125 and one line on stderr when the root is not the
verified one.
"""

from __future__ import annotations

from typing import Final

MOUNT_DIR: Final = "/run/corral/overlay"

OVERLAY_SCRIPT: Final = f"""set -eu
r={MOUNT_DIR}
exec {{low}}<"$1"
[ /proc/self/fd/$low -ef "/proc/self/fd/$2" ] || {{
  echo "overlay: $1 is no longer the verified image root" >&2; exit 125; }}
eval "exec $2<&-"
mount -t tmpfs -o "size=$3,mode=0755,nosuid,nodev" corral-layer "$r"
mkdir "$r/u" "$r/w" "$r/m"
mount -t overlay -o "lowerdir=/proc/self/fd/$low,upperdir=$r/u,workdir=$r/w,nosuid,nodev" \\
  corral-image "$r/m"
exec {{low}}<&-
cd "$r/m"
[ -z "$4" ] || mkdir -p -- $4
[ -z "$5" ] || {{ mkdir -p -- ".$5"; chown -- "$6" ".$5"; }}
cd /
shift 6
exec "$@"
"""


def overlay_argv(lower: str, fd: int, size: int | str, dirs: list[str], home: str,
                 owner: str) -> list[str]:
    """The root link's argv (before the uid drop); ``fd`` must be passed to it."""
    rel = " ".join(d.strip("/") for d in dirs)
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/bash", "-c",
            OVERLAY_SCRIPT, "bash", lower, str(fd), str(size), rel, home, owner]
