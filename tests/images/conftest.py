"""The image tests' session cache of built image layouts (real.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.images import real


@pytest.fixture(scope="session", autouse=True)
def _image_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    real.CACHE = tmp_path_factory.mktemp("image-cache")
    try:
        yield
    finally:
        real.CACHE = None
