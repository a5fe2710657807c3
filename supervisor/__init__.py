"""Corral supervisor: owns every session, their turns and their durable state."""

__version__ = "0.1.0"  # corral --version and farm.json's "version"
