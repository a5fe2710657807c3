"""POSIX ACLs as the kernel stores them, and the one-entry grant and revoke of a workspace group.

ACLs are read and written as the ``system.posix_acl_access`` and
``system.posix_acl_default`` xattrs (version 2, 8-byte entries: tag, perm,
id), always through ``/proc/self/fd/<fd>`` of an ``O_PATH | O_NOFOLLOW`` fd
the caller opened beneath a pinned directory: a path is never resolved again
and a symlink is never followed.

**Grant** (``grant_entry``, per call, before the tools run): a directory or a
regular file with one link gets ``group:<ws gid>`` with the owner's own bits
in its access ACL. An entry without an ACL gets a mask that is the union of
the group-class entries; an ACL that already has a mask keeps it (raising it
would widen the user's own named entries). Default ACLs are never written:
what a call creates is owned by its uid and the workspace's group already
(the call's gid), so a concurrent call of the workspace can use it as its
mode lets the group, and fully once it is the owner's; and a default ACL we
created could not be told from a user's base-only one afterwards without a
mark (a ``trusted.*`` mark, then a sentinel entry, were tried: a third xattr,
or 8 more bytes, on a directory no longer fit in an ext4 inode, and every
change then went to an external block, 4-6 ms each here).

**Revoke** (``revoke_entry``, after the call): every entry of a Corral gid
(the workspace-group range and the old shared sandbox group, ``is_ours``) is
removed from both ACLs; a mask is dropped when no named entry is left (the
kernel then stores the plain mode again) and the owning group keeps what the
mask let it do (``group_obj & mask``: a ``chmod 600`` made during the call
lowered the mask, and must not be undone). A default ACL holding a Corral
entry can only come from an older version's grant (or be inherited from
one): left with base entries only, it is removed.

**Confine** (``confine_entry``): what a tool created is bounded by its
parent's default ACL (see ``ownership.py``).

Invariants:
- Neither widens anything: the owner's and owning group's permissions,
  other entries and a mask the user set are kept; after a revoke the entry's
  ACLs are exactly what they were before the grant, unless someone changed
  them meanwhile (their change is kept -- a ``chmod`` narrowing the group
  included -- and ours removed).
- Neither function follows a symlink; a hard-linked regular file is never
  granted (a link may lead outside the workspace) but is revoked (removing
  an entry of ours never widens anything).
"""

from __future__ import annotations

import errno
import functools
import os
import stat
import struct
from collections.abc import Callable
from typing import Final

ACL_VERSION: Final = 2
ACL_USER_OBJ: Final = 0x01
ACL_USER: Final = 0x02
ACL_GROUP_OBJ: Final = 0x04
ACL_GROUP: Final = 0x08
ACL_MASK: Final = 0x10
ACL_OTHER: Final = 0x20
UNDEFINED_ID: Final = 0xFFFFFFFF
XATTR_ACCESS: Final = "system.posix_acl_access"
XATTR_DEFAULT: Final = "system.posix_acl_default"
NAMED: Final = (ACL_USER, ACL_GROUP)
MASK_KEY: Final = (ACL_MASK, UNDEFINED_ID)

Entries = dict[tuple[int, int], int]  # (tag, id) -> perm bits (rwx = 7)


def decode_acl(raw: bytes) -> Entries:
    if len(raw) < 4 or struct.unpack_from("<I", raw)[0] != ACL_VERSION or (len(raw) - 4) % 8:
        raise ValueError("not a POSIX ACL xattr")
    out: Entries = {}
    for off in range(4, len(raw), 8):
        tag, perm, ident = struct.unpack_from("<HHI", raw, off)
        out[(tag, ident)] = perm
    return out


def encode_acl(entries: Entries) -> bytes:
    body = b"".join(struct.pack("<HHI", tag, entries[(tag, ident)], ident)
                    for tag, ident in sorted(entries))
    return struct.pack("<I", ACL_VERSION) + body


def from_mode(mode: int) -> Entries:
    """The minimal ACL a mode stands for."""
    return {(ACL_USER_OBJ, UNDEFINED_ID): (mode >> 6) & 7,
            (ACL_GROUP_OBJ, UNDEFINED_ID): (mode >> 3) & 7,
            (ACL_OTHER, UNDEFINED_ID): mode & 7}


def read_acl(path: str, name: str, mode: int) -> Entries | None:
    """The ACL ``name`` of ``path`` (a ``/proc/self/fd/N`` path); with no
    xattr, the mode's minimal ACL for the access ACL and None for the default."""
    try:
        return decode_acl(os.getxattr(path, name))
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return from_mode(mode) if name == XATTR_ACCESS else None
        raise


def has_named(entries: Entries) -> bool:
    return any(tag in NAMED for tag, _ in entries)


def recompute_mask(out: Entries) -> Entries:
    """The mask bounds every group-class entry; recompute it as their union,
    as setfacl does, so the named entries are effective (no mask without any)."""
    out = dict(out)
    out.pop(MASK_KEY, None)
    if not has_named(out):
        return out
    mask = 0
    for (tag, _), perm in out.items():
        if tag in (ACL_USER, ACL_GROUP, ACL_GROUP_OBJ):
            mask |= perm
    out[MASK_KEY] = mask
    return out


def _with_entries(entries: Entries, named: Entries) -> Entries:
    out = dict(entries)
    for key, perm in named.items():
        out[key] = out.get(key, 0) | perm
    return recompute_mask(out)


def _keep_mask(before: Entries, after: Entries) -> Entries:
    """An ACL that already had a mask keeps it: raising it would widen every
    named entry and the owning group's effective rights (a user's ``user:bob``
    under mask ``r--``, or a file a tool made 0600). Our entry is then bounded
    by that mask, like anyone's."""
    mask = before.get(MASK_KEY)
    if mask is None:
        return after
    return {**after, MASK_KEY: mask}


def strip(entries: Entries, is_ours: Callable[[int], bool]) -> Entries:
    """``entries`` without the named group entries of Corral gids; the mask
    goes too when no named entry is left."""
    out = {k: v for k, v in entries.items() if not (k[0] == ACL_GROUP and is_ours(k[1]))}
    if not has_named(out) and MASK_KEY in out:
        # What the owning group could do was group_obj & mask: keep that, so a
        # ``chmod 600`` made meanwhile (which lowers the mask) is not undone.
        mask = out.pop(MASK_KEY)
        key = (ACL_GROUP_OBJ, UNDEFINED_ID)
        out[key] = out.get(key, 0) & mask
    return out


def _raw_access(path: str) -> bytes | None:
    """The raw access ACL xattr, or None when there is none."""
    try:
        return os.getxattr(path, XATTR_ACCESS)
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.EOPNOTSUPP):
            return None
        raise


# Trees hold a handful of distinct ACLs: the pure part of a grant or revoke is
# computed once per (ACL, mode bits, gid, Corral gids) -- a third of a walk's time.
@functools.lru_cache(maxsize=4096)
def _granted(raw: bytes | None, perms: int, gid: int, is_ours: Callable[[int], bool],
             ) -> bytes | None:
    """The access ACL ``raw`` (None: the plain mode ``perms``) with the grant,
    or None when it already has it."""
    access = decode_acl(raw) if raw is not None else from_mode(perms)
    base = strip(access, lambda g: g != gid and is_ours(g))
    new = _keep_mask(base, _with_entries(base, {(ACL_GROUP, gid): (perms >> 6) & 7}))
    return None if new == access else encode_acl(new)


@functools.lru_cache(maxsize=4096)
def _revoked(raw: bytes, is_ours: Callable[[int], bool]) -> bytes | None:
    """The access ACL ``raw`` without Corral entries, or None when it has none."""
    access = decode_acl(raw)
    new = strip(access, is_ours)
    return None if new == access else encode_acl(new)


def grant_entry(fd: int, st: os.stat_result, gid: int, is_ours: Callable[[int], bool]) -> bool:
    """Give ``group:<gid>`` the owner's bits on one O_PATH fd; drop entries of
    other Corral gids. True if changed."""
    if not (stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1)):
        return False
    path = f"/proc/self/fd/{fd}"
    # The group gets the owner's bits (from the mode; with an ACL its
    # user_obj is the same), the base entries come from the ACL if there is one.
    raw = _raw_access(path)
    new = _granted(raw, st.st_mode & 0o777, gid, is_ours)
    if new is None:
        return False
    os.setxattr(path, XATTR_ACCESS, new)
    return True


def confine_entry(fd: int, st: os.stat_result, parent_default: Entries | None) -> bool:
    """Bound what a tool created (an entry a tool uid owned) by what its parent's
    default ACL gave it: a named entry the parent's default lacks -- one the
    tool set itself, ``setfacl -m u:4243:rwx`` on its own file -- is removed,
    the others keep at most the default's rights, and a directory's default ACL
    becomes its parent's again. So nothing a tool wrote into an ACL outlives
    its ownership of the file. True if changed."""
    if stat.S_ISLNK(st.st_mode):
        return False
    path = f"/proc/self/fd/{fd}"
    allowed = parent_default or {}
    changed = False
    access = read_acl(path, XATTR_ACCESS, st.st_mode) or from_mode(st.st_mode)
    new = {k: v for k, v in access.items() if k[0] not in NAMED and k != MASK_KEY}
    for key, perm in access.items():
        if key[0] in NAMED and key in allowed:
            new[key] = perm & allowed[key]
    mask = access.get(MASK_KEY, 7) & allowed.get(MASK_KEY, 7)
    if has_named(new):
        new[MASK_KEY] = mask
    elif MASK_KEY in access:
        new[(ACL_GROUP_OBJ, UNDEFINED_ID)] &= mask
    if new != access:
        os.setxattr(path, XATTR_ACCESS, encode_acl(new))
        changed = True
    if stat.S_ISDIR(st.st_mode):
        default = read_acl(path, XATTR_DEFAULT, st.st_mode)
        if default != parent_default:
            if parent_default is None:
                os.removexattr(path, XATTR_DEFAULT)
            else:
                os.setxattr(path, XATTR_DEFAULT, encode_acl(parent_default))
            changed = True
    return changed


def revoke_entry(fd: int, st: os.stat_result,
                 is_ours: Callable[[int], bool]) -> tuple[bool, Entries | None]:
    """Remove every entry of a Corral gid from one O_PATH fd (see the module
    docstring). Returns (changed, its default ACL afterwards)."""
    if stat.S_ISLNK(st.st_mode):
        return False, None
    path = f"/proc/self/fd/{fd}"
    changed = False
    raw = _raw_access(path)
    new_raw = _revoked(raw, is_ours) if raw is not None else None
    if new_raw is not None:
        # A minimal ACL is stored by the kernel as the plain mode.
        os.setxattr(path, XATTR_ACCESS, new_raw)
        changed = True
    if not stat.S_ISDIR(st.st_mode):
        return changed, None
    default = read_acl(path, XATTR_DEFAULT, st.st_mode)
    if default is None:
        return changed, None
    new = strip(default, is_ours)
    if new == default:
        return changed, default
    if not has_named(new):  # an older version's, or inherited from one
        os.removexattr(path, XATTR_DEFAULT)
        return True, None
    os.setxattr(path, XATTR_DEFAULT, encode_acl(new))
    return True, new
