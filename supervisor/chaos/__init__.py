"""The chaos harness (``corral chaos``): faults under load, then invariants."""

from supervisor.chaos.harness import ChaosOptions, Harness, main

__all__ = ["ChaosOptions", "Harness", "main"]
