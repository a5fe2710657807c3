"""The image store's exception tree. Every error names what was refused and
says what to do next; the CLI prints ``str(exc)``.

    ImageError                      base; ``kind`` is a stable short name
    ├── ImageFormatError            not an image we accept: unreadable, truncated,
    │                               no layers, another platform, unsupported media
    ├── DigestMismatch              a blob's sha256 (or size) is not what its
    │                               descriptor or the config says
    ├── UnsafeEntry                 a layer entry refused (traversal, a link out of
    │                               the root, a device, setuid, ...): names layer+entry
    ├── LimitExceeded               a layer or the image over a configured bound
    └── ImageNotFound               no image with that name or digest in the store
"""

from __future__ import annotations


class ImageError(Exception):
    kind = "image_error"


class ImageFormatError(ImageError):
    kind = "image_format"


class DigestMismatch(ImageError):
    kind = "digest_mismatch"


class UnsafeEntry(ImageError):
    kind = "unsafe_entry"

    def __init__(self, layer: str, entry: str, reason: str) -> None:
        self.layer = layer
        self.entry = entry
        self.reason = reason
        super().__init__(f"layer {layer}: entry {entry!r}: {reason}; the image is refused "
                         "(nothing was installed)")


class LimitExceeded(ImageError):
    kind = "limit_exceeded"


class ImageNotFound(ImageError):
    kind = "image_not_found"
