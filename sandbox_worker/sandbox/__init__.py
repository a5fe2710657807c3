"""OS sandbox layers for tool calls: tiers, the argv chain, seccomp, limits,
process-tree control and isolation records. See ``docs/sandbox.md``."""
