"""The crash matrix runs whole farms in the test process (``start_farm``)."""

from tests.farm.conftest import start_farm, write_home

__all__ = ["start_farm", "write_home"]
