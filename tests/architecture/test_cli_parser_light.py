"""``corral --help`` (building the parser) loads no ZeroMQ, psutil or msgpack and
no client, key or supervision-tree module: the handlers import those.

Importing them with the parser cost every CLI call ~0.15 CPU-s (``corral --help``
0.44 -> 0.28 CPU-s, medians of 9 on a loaded 2-core machine), and commands that
only read files (``sessions``, ``show``, ``verify``, ``completion``) never use them.
"""

from __future__ import annotations

from tests.architecture.loaded import BUILD_PARSER, loaded_by

HANDLER_ONLY = ("zmq", "psutil", "msgpack", "supervisor.client", "supervisor.keys",
                "supervisor.farm", "broker.security", "broker.transport", "sandbox_worker")


def test_building_the_parser_loads_no_handler_only_module() -> None:
    found = sorted(m for m in loaded_by(BUILD_PARSER) if m.startswith(HANDLER_ONLY))
    assert found == [], f"corral --help loads {found}"


def test_the_farm_root_module_loads_no_config() -> None:
    """``corral status`` and ``corral down`` import ``supervisor.farm.root`` for
    ``running_farm`` and ``stop_detached``; the config (and the engine's config,
    jsonschema, the hooks) loads only when a ``Farm`` is made (0.52 -> 0.28 CPU-s
    for the import)."""
    found = sorted(m for m in loaded_by("import supervisor.farm.root")
                   if m.startswith(("supervisor.config", "supervisor.engine", "jsonschema")))
    assert found == [], f"supervisor.farm.root loads {found}"
