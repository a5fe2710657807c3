"""The image store in-process: the three input formats, layer semantics
(whiteouts, opaque directories, replacements), verification, bounds, bad
input and concurrent imports. Hostile entries are in test_hostile.py."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
import threading
from pathlib import Path

import pytest

from supervisor.images.errors import (
    DigestMismatch,
    ImageError,
    ImageFormatError,
    ImageNotFound,
    LimitExceeded,
)
from supervisor.images.source import host_arch
from supervisor.images.store import ImageStore
from supervisor.images.unpack import Limits
from tests.images.build import (
    d,
    f,
    hard,
    oci,
    sha,
    sym,
    write_archive,
    write_docker_save,
    write_layout,
)

pytestmark = pytest.mark.timeout(60)

_HOST_FILES = [p for p in ("/usr/bin/env", "/etc/os-release") if Path(p).is_file()]


def _rootfs_layers() -> list[list]:
    """A small real root: host binaries and files, a merged-/usr symlink."""
    entries = [d("usr"), d("usr/bin"), d("etc"), sym("bin", "usr/bin"), d("tmp", 0o1777)]
    for p in _HOST_FILES:
        data = Path(p).read_bytes()
        entries.append(f(p.lstrip("/"), data, stat.S_IMODE(os.stat(p).st_mode)))
    entries.append(hard("usr/bin/env2", "usr/bin/env"))
    return [entries, [f("marker", b"image marker\n")]]


def _empty(store: ImageStore) -> None:
    assert store.list() == []
    assert not any((store.root / "sha256").iterdir())
    assert not any((store.root / "tmp").iterdir())
    refs = store.root / "refs.json"
    assert not refs.exists() or json.loads(refs.read_text()) == {}


@pytest.mark.parametrize("form", ["layout", "archive", "docker"])
def test_imports_a_real_rootfs_from_each_format(tmp_path: Path, form: str) -> None:
    b = oci(_rootfs_layers(), gzip_layers=form != "docker")
    src = {"layout": lambda: write_layout(b, tmp_path / "layout"),
           "archive": lambda: write_archive(b, tmp_path / "img.tar"),
           "docker": lambda: write_docker_save(b, tmp_path / "docker.tar")}[form]()
    store = ImageStore(tmp_path / "home")
    info = store.import_image(src, "tools/base:1")
    if form != "docker":
        assert info.digest == b.manifest_digest
    assert info.names == ["tools/base:1"]
    assert info.layers == 2
    root = store.rootfs(info.digest)
    for p in _HOST_FILES:
        assert (root / p.lstrip("/")).read_bytes() == Path(p).read_bytes()
    assert os.readlink(root / "bin") == "usr/bin"
    assert os.stat(root / "usr/bin/env").st_mode & 0o111
    assert os.stat(root / "usr/bin/env").st_ino == os.stat(root / "usr/bin/env2").st_ino
    assert stat.S_IMODE(os.stat(root / "tmp").st_mode) == 0o1777
    assert (root / "marker").read_text() == "image marker\n"
    stored = store.root / "sha256" / info.digest.removeprefix("sha256:")
    assert sha((stored / "manifest.json").read_bytes()) == info.digest
    # importing again (same digest) changes nothing but names
    again = store.import_image(src, "other")
    assert again.digest == info.digest
    assert again.names == ["other:latest", "tools/base:1"]
    assert store.resolve("other").digest == store.resolve(info.digest).digest == info.digest


def test_whiteouts_and_opaque_dirs_apply_to_lower_layers_only(tmp_path: Path) -> None:
    lower = [d("a"), f("a/x", b"x"), f("a/y", b"y"), d("b"), f("b/z"), d("c"), f("c/old"),
             d("c/sub"), f("c/sub/deep"), f("s", b"file"), d("t"), f("t/in")]
    upper = [f("a/.wh.x"), f(".wh.b"),
             d("c/sub"), f("c/sub/kept", b"k"), f("c/new", b"n"), f("c/.wh..wh..opq"),
             f("d/n", b"same layer"), f("d/.wh.n"),  # a whiteout never hides its own layer
             d("s"), f("s/now-a-dir"), f("t", b"now a file"), f(".wh.missing")]
    store = ImageStore(tmp_path / "home")
    info = store.import_image(write_layout(oci([lower, upper]), tmp_path / "l"))
    root = store.rootfs(info.digest)
    assert sorted(os.listdir(root / "a")) == ["y"]
    assert not (root / "b").exists()
    assert sorted(os.listdir(root / "c")) == ["new", "sub"]
    assert sorted(os.listdir(root / "c/sub")) == ["kept"]
    assert (root / "d/n").read_text() == "same layer"
    assert (root / "s/now-a-dir").is_file()
    assert (root / "t").read_text() == "now a file"
    assert not any(n.startswith(".wh.") for _, dirs, files in os.walk(root)
                   for n in dirs + files)


def test_a_file_replacing_a_hard_link_does_not_write_through_it(tmp_path: Path) -> None:
    layers = [[f("orig", b"original"), hard("link", "orig")], [f("link", b"replaced")]]
    store = ImageStore(tmp_path / "home")
    root = store.rootfs(store.import_image(write_layout(oci(layers), tmp_path / "l")).digest)
    assert (root / "orig").read_text() == "original"
    assert (root / "link").read_text() == "replaced"


def _tamper_layer(b, tmp_path: Path) -> Path:  # type: ignore[no-untyped-def]
    path = write_layout(b, tmp_path / "l")
    layer_digest = json.loads(b.blobs[b.manifest_digest])["layers"][0]["digest"]
    blob = path / "blobs/sha256" / layer_digest.removeprefix("sha256:")
    data = bytearray(blob.read_bytes())
    data[data.index(b"hello")] = ord("j")  # still a valid tar, other content
    blob.write_bytes(bytes(data))
    return path


def test_a_layer_blob_that_does_not_match_its_digest_is_refused(tmp_path: Path) -> None:
    b = oci([[f("greeting", b"hello world")]], gzip_layers=False)
    store = ImageStore(tmp_path / "home")
    with pytest.raises(DigestMismatch, match=r"layer sha256:.*blob.s sha256"):
        store.import_image(_tamper_layer(b, tmp_path), "x")
    _empty(store)


def test_docker_save_layers_are_checked_against_the_configs_diff_ids(tmp_path: Path) -> None:
    b = oci([[f("greeting", b"hello world")]], gzip_layers=False)
    b.layer_tars[0] = b.layer_tars[0].replace(b"hello", b"jello")
    store = ImageStore(tmp_path / "home")
    with pytest.raises(DigestMismatch, match="unpacked tar has sha256"):
        store.import_image(write_docker_save(b, tmp_path / "d.tar"), "x")
    _empty(store)


@pytest.mark.parametrize("blob", ["manifest", "config"])
def test_a_tampered_manifest_or_config_is_refused(tmp_path: Path, blob: str) -> None:
    b = oci([[f("a")]])
    m = json.loads(b.blobs[b.manifest_digest])
    digest = b.manifest_digest if blob == "manifest" else m["config"]["digest"]
    b.blobs[digest] = b.blobs[digest].replace(b"schemaVersion", b"schemaversion") \
        if blob == "manifest" else b.blobs[digest].replace(b"/work", b"/evil")
    with pytest.raises(DigestMismatch, match=digest):
        ImageStore(tmp_path / "home").import_image(write_layout(b, tmp_path / "l"))


@pytest.mark.parametrize(("limits", "layers", "match"), [
    (Limits(max_layer_entries=3), [[f("1"), f("2"), f("3"), f("4")]], "more than 3 entries"),
    (Limits(max_layer_bytes=100), [[f("big", b"x" * 101)]], "over 100"),
    (Limits(max_total_bytes=150), [[f("a", b"x" * 100)], [f("b", b"x" * 100)]],
     "takes the image over 150"),
    (Limits(max_layers=1), [[f("a")], [f("b")]], "2 layers, over 1"),
    (Limits(max_path_depth=3), [[f("a/b/c/d")]], "deeper than 3"),
])
def test_bounds_refuse_the_image(tmp_path: Path, limits: Limits, layers: list, match: str
                                 ) -> None:
    store = ImageStore(tmp_path / "home", limits)
    with pytest.raises(ImageError, match=match):
        store.import_image(write_layout(oci(layers), tmp_path / "l"), "x")
    _empty(store)


def test_a_gzip_bomb_is_bounded_by_the_unpacked_size(tmp_path: Path) -> None:
    b = oci([[f("zeros", b"\0" * (4 << 20))]])
    store = ImageStore(tmp_path / "home", Limits(max_layer_bytes=1 << 20))
    with pytest.raises(LimitExceeded):
        store.import_image(write_layout(b, tmp_path / "l"))
    _empty(store)


def test_bad_input_gets_a_typed_error_naming_what_to_do(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "home")
    b = oci([[f("a", os.urandom(50_000))]], gzip_layers=False)
    whole = write_archive(b, tmp_path / "whole.tar").read_bytes()
    (tmp_path / "cut.tar").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(ImageFormatError, match=r"or truncated \(unexpected end of data\)"):
        store.import_image(tmp_path / "cut.tar")
    other = "arm64" if oci([[]]).config.find(b'"amd64"') >= 0 else "amd64"
    with pytest.raises(ImageFormatError, match=f"for linux/{other}"):
        store.import_image(write_layout(oci([[f("a")]], arch=other), tmp_path / "arch"))
    with pytest.raises(ImageFormatError, match="no layers"):
        store.import_image(write_layout(oci([]), tmp_path / "none"))
    with pytest.raises(ImageFormatError, match=r"neither index\.json"):
        store.import_image(tmp_path)
    with pytest.raises(ImageFormatError, match="not an image name"):
        store.import_image(write_layout(oci([[f("a")]]), tmp_path / "n"), "Bad Name")
    with pytest.raises(ImageNotFound, match="corral image import"):
        store.resolve("nope:1")
    zstd = oci([[f("a")]])
    m = json.loads(zstd.blobs[zstd.manifest_digest])
    m["layers"][0]["mediaType"] += "+zstd"
    raw = json.dumps(m).encode()
    zstd.blobs = {k: v for k, v in zstd.blobs.items() if k != zstd.manifest_digest}
    zstd.blobs[sha(raw)] = raw
    zstd.index = zstd.index.replace(zstd.manifest_digest.encode(), sha(raw).encode())
    with pytest.raises(ImageFormatError, match="zstd"):
        store.import_image(write_layout(zstd, tmp_path / "z"))
    _empty(store)


def test_concurrent_imports_of_one_image_give_one_whole_image(tmp_path: Path) -> None:
    layers = [[f(f"f{i}", os.urandom(2000)) for i in range(300)]]
    src = write_layout(oci(layers), tmp_path / "l")
    store = ImageStore(tmp_path / "home")
    results: list[str] = []
    errors: list[BaseException] = []

    def one(name: str) -> None:
        try:
            results.append(ImageStore(tmp_path / "home").import_image(src, name).digest)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(f"n{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(set(results)) == 1
    [info] = store.list()
    assert info.names == ["n0:latest", "n1:latest", "n2:latest"]
    root = store.rootfs(info.digest)
    assert len(os.listdir(root)) == 300
    assert not any((store.root / "tmp").iterdir())


def test_remove_by_name_keeps_other_names_and_by_digest_removes_all(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "home")
    src = write_layout(oci([[d("ro", 0o555), f("ro/f", b"x", 0o444)]]), tmp_path / "l")
    digest = store.import_image(src, "a").digest
    store.import_image(src, "b:2")
    assert store.remove("a") == {"digest": digest, "untagged": ["a:latest"], "removed": False}
    assert store.resolve("b:2").digest == digest
    assert store.remove(digest)["removed"]
    with pytest.raises(ImageNotFound):
        store.resolve(digest)
    _empty(store)


def test_gzip_and_plain_layers_give_the_same_root(tmp_path: Path) -> None:
    layers = [[f("a", b"1"), sym("l", "a")]]
    store = ImageStore(tmp_path / "home")
    r1 = store.rootfs(store.import_image(write_layout(oci(layers), tmp_path / "g")).digest)
    r2 = store.rootfs(store.import_image(
        write_layout(oci(layers, gzip_layers=False), tmp_path / "p")).digest)
    assert r1 != r2
    assert sorted(os.listdir(r1)) == sorted(os.listdir(r2))


def test_a_truncated_layer_blob_is_refused(tmp_path: Path) -> None:
    b = oci([[f("a", os.urandom(50_000))]])
    path = write_layout(b, tmp_path / "l")
    layer = json.loads(b.blobs[b.manifest_digest])["layers"][0]["digest"]
    blob = path / "blobs/sha256" / layer.removeprefix("sha256:")
    blob.write_bytes(blob.read_bytes()[:20_000])
    store = ImageStore(tmp_path / "home")
    with pytest.raises(ImageFormatError, match=r"truncated or corrupt"):
        store.import_image(path, "x")
    _empty(store)


def test_a_multi_platform_index_gives_this_hosts_image(tmp_path: Path) -> None:
    ours = oci([[f("which", b"ours")]])
    theirs = oci([[f("which", b"theirs")]], arch="s390x" if host_arch() != "s390x" else "arm64")
    ours.blobs |= theirs.blobs
    entries = [{**json.loads(b.index)["manifests"][0],
                "platform": {"os": "linux", "architecture": json.loads(b.config)["architecture"]}}
               for b in (theirs, ours)]
    ours.index = json.dumps({"schemaVersion": 2, "manifests": entries}).encode()
    store = ImageStore(tmp_path / "home")
    info = store.import_image(write_layout(ours, tmp_path / "l"))
    assert info.digest == ours.manifest_digest
    assert (store.rootfs(info.digest) / "which").read_text() == "ours"
    ours.index = json.dumps({"schemaVersion": 2, "manifests": entries[:1]}).encode()
    with pytest.raises(ImageFormatError, match=f"no manifest for linux/{host_arch()}"):
        store.import_image(write_layout(ours, tmp_path / "l2"))


def test_docker_save_repeated_layers_linked_inside_the_archive(tmp_path: Path) -> None:
    """docker save writes a repeated layer once and links the other path to it."""
    b = oci([[f("a", b"1")], [f("b", b"2")]], gzip_layers=False)
    path = write_docker_save(b, tmp_path / "d.tar")
    with tarfile.open(path) as tar:
        doc = json.loads(tar.extractfile("manifest.json").read())  # type: ignore[union-attr]
    with tarfile.open(path, "a") as tar:
        ti = tarfile.TarInfo("02/layer.tar")
        ti.type = tarfile.SYMTYPE
        ti.linkname = "../00/layer.tar"
        tar.addfile(ti)
    doc[0]["Layers"].append("02/layer.tar")
    config = json.loads(b.config)
    config["rootfs"]["diff_ids"].append(sha(b.layer_tars[0]))
    b.config = json.dumps(config).encode()
    chex = sha(b.config).removeprefix("sha256:")
    doc[0]["Config"] = f"{chex}.json"
    with tarfile.open(path, "a") as tar:
        for name, data in ((f"{chex}.json", b.config), ("manifest.json", json.dumps(doc).encode())):
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            tar.addfile(ti, io.BytesIO(data))
    store = ImageStore(tmp_path / "home")
    info = store.import_image(path)
    assert info.layers == 3
    assert sorted(os.listdir(store.rootfs(info.digest))) == ["a", "b"]
