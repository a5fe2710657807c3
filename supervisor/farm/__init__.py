"""The farm: the root process that supervises broker, supervisor and workers."""
