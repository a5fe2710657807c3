"""Corral sandbox worker: model calls and sandboxed tool execution."""
