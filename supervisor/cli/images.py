"""``corral image import|ls|rm``: the farm's image store (``HOME/images/``).

The store works on files under HOME with its own locks; no farm needs to run.
``supervisor.images`` is imported by the handlers, not with the parser. Every
name and message that comes from an image reaches the terminal through
``render.clean`` (``say_error`` does that for errors).
"""

from __future__ import annotations

import sys
from argparse import ArgumentParser, ArgumentTypeError, Namespace
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.cli.common import EXIT_FAILED, EXIT_OK, Subparsers, add_home, add_json
from supervisor.cli.output import print_json, say_error
from supervisor.cli.render import clean

if TYPE_CHECKING:
    from supervisor.images.store import ImageStore


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise ArgumentTypeError("must be at least 1")
    return n


def add_parsers(sub: Subparsers) -> None:
    top = sub.add_parser("image", help="import, list and remove OCI images in the farm's store",
                         description="The farm's image store under HOME/images/: images are "
                         "verified, unpacked safely and named by their manifest digest.")
    group = top.add_subparsers(dest="image_command", metavar="SUBCOMMAND", required=True)

    p = group.add_parser("import", help="verify and unpack an image into the store",
                         description="Import an OCI image layout directory, an OCI archive "
                         "or a 'docker save' tarball. Every blob's sha256 is checked and "
                         "hostile entries (traversal, links out of the root, devices, "
                         "setuid) refuse the whole image; nothing is installed unless all "
                         "of it verifies. Layers: tar or tar+gzip (not zstd).")
    add_home(p)
    p.add_argument("path", type=Path, help="the layout directory or tarball to import")
    p.add_argument("--name", default=None,
                   help="a name for the image, NAME[:TAG] (tag 'latest' by default)")
    p.add_argument("--allow-setuid", action="store_true",
                   help="keep setuid/setgid bits instead of refusing the image")
    p.add_argument("--max-layers", type=_count, default=None,
                   help="refuse images with more layers (default: 128)")
    p.add_argument("--max-layer-entries", type=_count, default=None,
                   help="refuse a layer with more tar entries (default: 500000)")
    p.add_argument("--max-layer-bytes", type=_count, default=None,
                   help="refuse a layer whose blob or unpacked files exceed this many bytes "
                   "(default: 8 GiB)")
    p.add_argument("--max-total-bytes", type=_count, default=None,
                   help="refuse an image whose unpacked files exceed this many bytes "
                   "(default: 32 GiB)")
    add_json(p)
    p.set_defaults(handler=cmd_image_import)

    p = group.add_parser("ls", help="list the images in the store",
                         description="List the stored images: digest, names, size, layers.")
    add_home(p)
    add_json(p)
    p.set_defaults(handler=cmd_image_ls)

    p = group.add_parser("rm", help="remove a name, or an image by digest",
                         description="Remove NAME[:TAG] (the image goes with its last name) "
                         "or, given sha256:DIGEST, the image and all its names.")
    add_home(p)
    p.add_argument("image", help="NAME[:TAG] or sha256:DIGEST (see 'corral image ls')")
    add_json(p)
    p.set_defaults(handler=cmd_image_rm)
    _help_for(top)


def _help_for(top: ArgumentParser) -> None:
    top.epilog = "'corral image SUBCOMMAND --help' explains each one."


def _store(ns: Namespace, **limits: int | None) -> ImageStore:
    from dataclasses import replace

    from supervisor.images.store import ImageStore
    from supervisor.images.unpack import Limits

    given = {k: v for k, v in limits.items() if v is not None}
    return ImageStore(ns.home, replace(Limits(), **given))


def cmd_image_import(ns: Namespace) -> int:
    from supervisor.images.errors import ImageError
    from supervisor.images.store import info_json

    store = _store(ns, max_layers=ns.max_layers, max_layer_entries=ns.max_layer_entries,
                   max_layer_bytes=ns.max_layer_bytes, max_total_bytes=ns.max_total_bytes)
    try:
        info = store.import_image(ns.path, ns.name, allow_setuid=ns.allow_setuid)
    except ImageError as exc:
        return say_error(ns, exc.kind, str(exc), EXIT_FAILED)
    if ns.json:
        print_json({"ok": True, "image": info_json(info)})
    else:
        names = ", ".join(info.names) or "no name"
        print(f"imported {info.digest} ({clean(names)}; {info.layers} layers, "
              f"{info.size_bytes} bytes)")
    return EXIT_OK


def cmd_image_ls(ns: Namespace) -> int:
    from supervisor.images.errors import ImageError
    from supervisor.images.store import info_json

    try:
        images = _store(ns).list()
    except ImageError as exc:
        return say_error(ns, exc.kind, str(exc), EXIT_FAILED)
    if ns.json:
        print_json({"ok": True, "images": [info_json(i) for i in images]})
        return EXIT_OK
    if not images:
        print(f"no images in {ns.home / 'images'}; add one with 'corral image import PATH'",
              file=sys.stderr)
        return EXIT_OK
    print(f"{'DIGEST':<19}  {'LAYERS':>6}  {'BYTES':>12}  NAMES")
    for i in images:
        print(f"{i.digest[:19]:<19}  {i.layers:>6}  {i.size_bytes:>12}  "
              f"{clean(', '.join(i.names)) or '-'}")
    return EXIT_OK


def cmd_image_rm(ns: Namespace) -> int:
    from supervisor.images.errors import ImageError

    try:
        result = _store(ns).remove(ns.image)
    except ImageError as exc:
        return say_error(ns, exc.kind, str(exc), EXIT_FAILED)
    if ns.json:
        print_json({"ok": True, **result})
    elif result["removed"]:
        print(f"removed {result['digest']}")
    else:
        print(f"untagged {clean(', '.join(result['untagged']))} ({result['digest']} keeps "
              "other names)")
    return EXIT_OK
