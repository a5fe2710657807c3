"""Real OCI images for the tests, built offline with Debian's tools.

``umoci`` makes an OCI image layout from a directory tree (``init``, ``new``,
``unpack``, ``repack``, ``config``); ``skopeo copy`` converts a layout to a
``docker save`` archive. The trees are ``busybox-static`` plus a marker file
and an ``/etc/passwd`` with a user ``app`` (uid 1000, home ``/home/app``), and
one with Debian's ``python3.11-minimal`` files (the interpreter, its
``libpython3.11-minimal`` standard library and the shared libraries ``ldd``
names). Nothing needs the network. Every path written is under the caller's
tmp directory, or under the test session's image cache (``CACHE``, set by
conftest.py): each image (each set of options) is built by umoci once per test
process (~0.5 CPU-s for busybox, ~1.7 for python) and copied to the caller's
path afterwards, the same bytes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

MARKER = "corral image marker\n"
BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "ls", "cat", "id", "echo", "touch", "mkdir", "env", "pwd", "true", "rm",
           "stat", "readlink", "wc", "sleep", "test")
PASSWD = "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n"
# Where built layouts are kept for the test process (conftest.py sets it to a
# session tmp directory; None builds every time).
CACHE: Path | None = None


def need_tools() -> None:
    missing = [t for t in ("umoci", "skopeo") if shutil.which(t) is None]
    if missing or not os.path.exists(BUSYBOX):
        pytest.skip(f"needs umoci, skopeo and busybox-static (scripts/_bootstrap.sh installs "
                    f"them as root); missing: {missing or [BUSYBOX]}")


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=120)


def build(layout: Path, tag: str, fill: dict[str, str | Path], links: dict[str, str],
          config: list[str]) -> Path:
    """Make ``layout:tag`` whose one layer holds ``fill`` (path in the image ->
    text, or a host file to copy) and ``links`` (path -> symlink target);
    ``config`` are ``umoci config`` options. Returns the layout directory."""
    if not layout.exists():
        _run("umoci", "init", "--layout", str(layout))
    _run("umoci", "new", "--image", f"{layout}:{tag}")
    bundle = layout.parent / f"bundle-{tag}"
    _run("umoci", "unpack", "--image", f"{layout}:{tag}", str(bundle))
    root = bundle / "rootfs"
    for rel, what in fill.items():
        dest = root / rel.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(what, Path):
            shutil.copy2(what, dest)
        else:
            dest.write_text(what)
    for rel, target in links.items():
        dest = root / rel.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, dest)
    _usual_modes(root)
    _run("umoci", "repack", "--image", f"{layout}:{tag}", str(bundle))
    if config:
        _run("umoci", "config", "--image", f"{layout}:{tag}", *config)
    shutil.rmtree(bundle)
    return layout


def _usual_modes(root: Path) -> None:
    """Directories 0755, files 0644 (0755 when executable): what an image has,
    whatever the umask of the process building it (a farm in the same process
    sets 077)."""
    for dirpath, _dirs, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if os.stat(path).st_mode & 0o100 else 0o644)


def _cached(layout: Path, key: str, make: Callable[[Path], Path]) -> Path:
    """``make(layout)``, or a copy of the layout it made for ``key`` before."""
    if CACHE is None or layout.exists():
        return make(layout)
    kept = CACHE / key
    if not kept.exists():
        make(CACHE / f".{key}.tmp")
        os.rename(CACHE / f".{key}.tmp", kept)
    shutil.copytree(kept, layout, symlinks=True)
    return layout


def busybox_image(layout: Path, tag: str = "bb", *, workdir: str = "/app",
                  user: str = "app") -> Path:
    return _cached(layout, f"busybox-{tag}-{workdir.replace('/', '_')}-{user}",
                   lambda to: _busybox_image(to, tag, workdir=workdir, user=user))


def _busybox_image(layout: Path, tag: str, *, workdir: str, user: str) -> Path:
    fill: dict[str, str | Path] = {"/bin/busybox": Path(BUSYBOX), "/etc/corral-marker": MARKER,
                                   "/etc/passwd": PASSWD, "/home/app/.profile": "# app\n"}
    links = {f"/bin/{a}": "busybox" for a in APPLETS}
    config = ["--config.env", "PATH=/bin", "--config.env", "CORRAL_IMAGE_VAR=from-image"]
    if workdir:
        config += ["--config.workingdir", workdir]
    if user:
        config += ["--config.user", user]
    return build(layout, tag, fill, links, config)


def python_files() -> dict[str, str | Path]:
    """Debian's python3.11-minimal files and the libraries the interpreter loads."""
    out = subprocess.run(["dpkg", "-L", "python3.11-minimal", "libpython3.11-minimal"],
                         check=True, capture_output=True, text=True, timeout=30).stdout
    files: dict[str, str | Path] = {}
    for line in out.splitlines():
        p = Path(line)
        if p.is_file() and not p.is_symlink() and line.startswith("/usr/"):
            files[line] = p
    ldd = subprocess.run(["ldd", "/usr/bin/python3.11"], check=True, capture_output=True,
                         text=True, timeout=30).stdout
    for line in ldd.splitlines():
        path = line.split("=>")[-1].split("(")[0].strip()
        if path.startswith("/"):
            real = os.path.realpath(path)
            files[real] = Path(real)
            files["/usr/lib64/ld-linux-x86-64.so.2" if "ld-linux" in path else
                  f"/usr/lib/x86_64-linux-gnu/{os.path.basename(path)}"] = Path(real)
    return files


def python_image(layout: Path, tag: str = "py") -> Path:
    return _cached(layout, f"python-{tag}", lambda to: _python_image(to, tag))


def _python_image(layout: Path, tag: str) -> Path:
    need = python_files()
    fill: dict[str, str | Path] = {**need, "/bin/busybox": Path(BUSYBOX),
                                   "/etc/corral-marker": MARKER, "/etc/passwd": PASSWD}
    links = {f"/bin/{a}": "busybox" for a in APPLETS}
    links["/usr/bin/python3"] = "python3.11"
    links["/lib64"] = "usr/lib64"
    links["/lib"] = "usr/lib"
    return build(layout, tag, fill, links,
                 ["--config.env", "PATH=/usr/bin:/bin", "--config.workingdir", "/src"])


def docker_archive(layout: Path, tag: str, out: Path) -> Path:
    """``skopeo copy`` of ``layout:tag`` to a ``docker save`` tarball."""
    _run("skopeo", "copy", f"oci:{layout}:{tag}", f"docker-archive:{out}:corral/{tag}:latest")
    return out
