"""Tools from outside the built-in five: command tools (``[tools.NAME]``) and
MCP servers (``[mcp.NAME]``), their specs, argument validation and routing
(docs/tools.md)."""
