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


def _sparse_blocks(map_bytes: int) -> tuple[bytes, bytes, int]:
    """A GNU (old format) sparse header saying extension blocks follow, one
    extension block (21 map entries, more to follow), and how many of them
    make ``map_bytes``."""
    ti = tarfile.TarInfo("s")
    ti.type, ti.size = tarfile.GNUTYPE_SPARSE, 0
    hdr = bytearray(ti.tobuf(format=tarfile.GNU_FORMAT))
    hdr[482] = 1  # isextended
    hdr[148:156] = b" " * 8
    hdr[148:156] = b"%06o\0 " % sum(hdr)
    ext = bytearray(512)
    for i in range(21):
        ext[i * 24:i * 24 + 24] = b"00000000001\0" * 2
    ext[504] = 1
    return bytes(hdr), bytes(ext), map_bytes // 512


def _bomb_layout(path: Path, name_bytes: int, *, sparse: bool = False) -> Path:
    """An OCI layout whose one gzip layer is a few hundred KB and holds a GNU
    long-name header of ``name_bytes`` bytes (zeros), then a small file; with
    ``sparse``, a sparse file's map of ``name_bytes`` instead."""
    import gzip
    import hashlib
    import json
    import zlib

    def header(name: str, kind: bytes, size: int) -> bytes:
        ti = tarfile.TarInfo(name)
        ti.type, ti.size, ti.mode = kind, size, 0o644
        return ti.tobuf(format=tarfile.GNU_FORMAT)

    path.mkdir(parents=True)
    blob_path = path / "layer.tar.gz"
    plain_sha, blob_sha = hashlib.sha256(), hashlib.sha256()
    comp = zlib.compressobj(6, zlib.DEFLATED, 31)  # gzip framing
    with open(blob_path, "wb") as out:
        def put(data: bytes) -> None:
            plain_sha.update(data)
            packed = comp.compress(data)
            blob_sha.update(packed)
            out.write(packed)
        if sparse:
            first, ext, count = _sparse_blocks(name_bytes)
            put(first)
            for _ in range(count // 2048):
                put(ext * 2048)
            put(ext[:504] + b"\0" * 8)  # the last block: no more to follow
        else:
            hdr = tarfile.TarInfo("././@LongLink")
            hdr.type, hdr.size = tarfile.GNUTYPE_LONGNAME, name_bytes
            put(hdr.tobuf(format=tarfile.USTAR_FORMAT))  # the raw 'L' header
            chunk = bytes(1 << 20)
            left = -(-name_bytes // 512) * 512
            while left:
                n = min(left, len(chunk))
                put(chunk[:n])
                left -= n
        put(header("x", tarfile.REGTYPE, 0) + bytes(1024))
        tail = comp.flush()
        blob_sha.update(tail)
        out.write(tail)
    blob = "sha256:" + blob_sha.hexdigest()
    config = json.dumps({"os": "linux", "architecture": __import__(
        "tests.images.build", fromlist=["host_arch"]).host_arch(), "config": {},
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + plain_sha.hexdigest()]}}).encode()
    csha = "sha256:" + hashlib.sha256(config).hexdigest()
    manifest = json.dumps({"schemaVersion": 2,
                           "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                      "digest": csha, "size": len(config)},
                           "layers": [{"mediaType":
                                       "application/vnd.oci.image.layer.v1.tar+gzip",
                                       "digest": blob, "size": blob_path.stat().st_size}]
                           }).encode()
    msha = "sha256:" + hashlib.sha256(manifest).hexdigest()
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    blob_path.rename(blobs / blob.removeprefix("sha256:"))
    (blobs / csha.removeprefix("sha256:")).write_bytes(config)
    (blobs / msha.removeprefix("sha256:")).write_bytes(manifest)
    (path / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (path / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": msha,
         "size": len(manifest)}]}))
    assert gzip  # the layer is gzip (wbits 31)
    return path


def _import_peak_rss(layout: Path, home: Path) -> tuple[int, str, int]:
    """``corral image import`` in its own process: (exit code, stderr, peak RSS bytes)."""
    import resource
    import subprocess
    import sys

    # A wrapper process whose only child is the import: its RUSAGE_CHILDREN
    # peak is the import's own (this process's children's may be larger).
    wrapper = ("import resource, subprocess, sys\n"
               "r = subprocess.run(sys.argv[1:])\n"
               "print('PEAK', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
               "file=sys.stderr)\n"
               "sys.exit(r.returncode)\n")
    done = subprocess.run([sys.executable, "-c", wrapper, sys.executable, "-m",
                           "supervisor.cli", "image", "import", str(layout), "--home",
                           str(home)], capture_output=True, text=True, timeout=120, check=False)
    peak = int(done.stderr.rsplit("PEAK ", 1)[1].split()[0])
    assert resource  # (the wrapper measures)
    return done.returncode, done.stderr, peak * 1024


@pytest.mark.timeout(180)
def test_a_huge_extended_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A gzip layer of ~0.6 MB holding a 600 MB GNU long name: tarfile read the
    name whole into memory (the importer's peak RSS was 1.35 GiB, measured);
    now the header is refused at its size, nothing installed."""
    size = 600 << 20
    layout = _bomb_layout(tmp_path / "bomb", size)
    assert sum(p.stat().st_size for p in layout.rglob("*") if p.is_file()) < 4 << 20
    code, err, peak = _import_peak_rss(layout, tmp_path / "home")
    assert code != 0
    assert "extended header" in err, err
    assert peak < size // 2, f"peak RSS {peak} bytes"
    store = ImageStore(tmp_path / "home")
    assert store.list() == []


@pytest.mark.timeout(180)
def test_a_sparse_file_is_refused_before_its_map_is_read(tmp_path: Path) -> None:
    """A gzip layer holding a sparse file with a 100 MB map (GNU old format,
    extension blocks): tarfile kept the whole map as Python tuples (the
    importer's peak RSS was 0.8 GiB, measured); now sparse files are refused."""
    size = 100 << 20
    layout = _bomb_layout(tmp_path / "bomb", size, sparse=True)
    code, err, peak = _import_peak_rss(layout, tmp_path / "home")
    assert code != 0
    assert "sparse file" in err, err
    assert peak < 2 * size, f"peak RSS {peak} bytes"
    assert ImageStore(tmp_path / "home").list() == []


@pytest.mark.timeout(60)
def test_a_fifo_in_the_layout_is_refused_not_waited_on(tmp_path: Path) -> None:
    """A layout directory whose layer blob is a fifo with no writer (a hostile
    directory, or a tarball extracted by hand): the import fails at once (the
    blob reads as empty) instead of waiting at open() for a writer that never
    comes. (A fifo with a writer is read as it is fed: test_cli.py's killed
    import paces itself so.)"""
    import subprocess
    import sys

    b = oci([[f("ok", b"fine")]])
    layout = write_layout(b, tmp_path / "l")
    layer = __import__("json").loads(b.blobs[b.manifest_digest])["layers"][0]["digest"]
    blob = layout / "blobs" / "sha256" / layer.removeprefix("sha256:")
    blob.unlink()
    os.mkfifo(blob)
    done = subprocess.run([sys.executable, "-m", "supervisor.cli", "image", "import",
                           str(layout), "--home", str(tmp_path / "home")],
                          capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode != 0
    assert "truncated or corrupt" in done.stderr, done.stderr
    assert ImageStore(tmp_path / "home").list() == []
