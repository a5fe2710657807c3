"""Corral supervisor: owns every session, their turns and their durable state."""
