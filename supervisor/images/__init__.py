"""The farm's image store: OCI images imported, verified and unpacked under
``HOME/images/``, named by their manifest digest.

``store.py`` holds the store (import, list, remove, names); ``source.py``
reads the three accepted inputs (OCI layout directory, OCI archive, ``docker
save`` tarball) into one manifest with digest-verified blob streams;
``unpack.py`` applies layers to a root without ever following a symlink;
``errors.py`` is the exception tree. Running tools over an image root is the
next stage (docs/images.md).
"""
