"""Hostile layers, one case each: refused with a typed error naming the
layer and the entry, and nothing installed (no image, no name, no temp)."""

from __future__ import annotations

import os
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest

from supervisor.images.errors import UnsafeEntry
from supervisor.images.store import ImageStore
from tests.images.build import Entry, d, f, hard, oci, sym, write_layout

pytestmark = pytest.mark.timeout(60)

_DEV = [Entry("dev/null", tarfile.CHRTYPE), Entry("dev/sda", tarfile.BLKTYPE),
        Entry("run/fifo", tarfile.FIFOTYPE)]

# (id, layers, the refused entry (in the last layer), a phrase of the reason)
CASES = [
    ("dotdot", [[f("../evil", b"x")]], "../evil", "path traversal"),
    ("dotdot-inside", [[d("a"), f("a/../../evil")]], "a/../../evil", "path traversal"),
    ("absolute", [[f("/etc/evil", b"x")]], "/etc/evil", "absolute path"),
    ("symlink-out", [[d("a"), sym("a/up", "../../etc")]], "a/up", "leads out"),
    ("symlink-dotdot-top", [[sym("up", "..")]], "up", "leads out"),
    ("through-symlinked-dir", [[sym("etc", "@OUT")], [f("etc/evil", b"x")]], "etc/evil",
     "symlink or not a directory"),
    ("through-symlink-same-layer", [[d("a"), sym("a/b", "."), f("a/b/c/x")]], "a/b/c/x",
     "symlink or not a directory"),
    ("through-relative-symlink", [[d("in"), sym("l", "in")], [d("l/sub")]], "l/sub",
     "symlink or not a directory"),
    ("hardlink-dotdot", [[hard("h", "../etc/passwd")]], "h", "path traversal"),
    ("hardlink-absolute", [[hard("h", "/etc/passwd")]], "h", "absolute path"),
    ("hardlink-through-symlink", [[sym("s", "@OUT"), hard("h", "s/secret")]], "h",
     "symlink or not a directory"),
    ("hardlink-missing", [[hard("h", "nothing")]], "h", "not in the image"),
    ("hardlink-dir", [[d("a"), hard("h", "a")]], "h", "to a directory"),
    ("chr", [[_DEV[0]]], "dev/null", "device nodes"),
    ("blk", [[_DEV[1]]], "dev/sda", "device nodes"),
    ("fifo", [[_DEV[2]]], "run/fifo", "fifos"),
    ("setuid", [[f("bin/su", b"\x7fELF", 0o4755)]], "bin/su", "setuid"),
    ("setgid-dir", [[d("var/mail", 0o2775)]], "var/mail", "setgid"),
    ("whiteout-dotdot", [[d("a")], [f("a/.wh...")]], "a/.wh...", "names no entry"),
]


@pytest.mark.parametrize(("layers", "entry", "reason"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_hostile_entry_is_refused_and_nothing_installed(tmp_path: Path, layers: list,
                                                        entry: str, reason: str) -> None:
    outside = tmp_path / "outside"  # what links point at: never the host's /etc
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    layers = [[replace(e, link=e.link.replace("@OUT", str(outside))) for e in layer]
              for layer in layers]
    b = oci([[f("ok", b"fine")], *layers])
    store = ImageStore(tmp_path / "home")
    with pytest.raises(UnsafeEntry) as caught:
        store.import_image(write_layout(b, tmp_path / "l"), "evil")
    exc = caught.value
    layer_digests = [ld["digest"] for ld in __import__("json").loads(
        b.blobs[b.manifest_digest])["layers"]]
    assert exc.layer == layer_digests[-1]
    assert exc.entry == entry
    assert reason in str(exc)
    assert entry in str(exc)
    assert exc.layer in str(exc)
    assert store.list() == []
    assert os.listdir(store.root / "sha256") == []
    assert os.listdir(store.root / "tmp") == []
    assert not (store.root / "refs.json").exists()
    assert not Path("/etc/evil").exists()
    assert not (tmp_path / "evil").exists()


def test_setuid_is_kept_with_the_explicit_option(tmp_path: Path) -> None:
    b = oci([[f("bin/su", b"x", 0o4755), d("var/mail", 0o2775)]])
    store = ImageStore(tmp_path / "home")
    root = store.rootfs(store.import_image(write_layout(b, tmp_path / "l"),
                                           allow_setuid=True).digest)
    assert os.stat(root / "bin/su").st_mode & 0o7777 == 0o4755
    assert os.stat(root / "var/mail").st_mode & 0o7777 == 0o2775


def test_absolute_symlinks_stay_inside_and_are_never_followed(tmp_path: Path) -> None:
    """An absolute target names the image's own root; writing over the link
    replaces the link, it never writes to the host path."""
    victim = tmp_path / "victim"
    victim.write_text("host file")
    b = oci([[sym("x", str(victim)), d("usr"), sym("usr/python", "/usr/bin/python3")],
             [f("x", b"image file")]])
    store = ImageStore(tmp_path / "home")
    root = store.rootfs(store.import_image(write_layout(b, tmp_path / "l")).digest)
    assert victim.read_text() == "host file"
    assert (root / "x").read_text() == "image file"
    assert not (root / "x").is_symlink()
    assert os.readlink(root / "usr/python") == "/usr/bin/python3"
