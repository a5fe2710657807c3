"""The rich neutral request whose provider bodies are pinned in golden/*.json."""

from __future__ import annotations

from typing import Any

INSTRUCTIONS = "You are Corral's test agent. Use tools when needed."

TOOLS: list[dict[str, Any]] = [
    {"name": "shell", "description": "Run a shell command in the workspace.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                    "required": ["command"]}, "idempotent": False, "read_only": False},
    {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                    "required": ["path"]}, "idempotent": True, "read_only": True},
]

ITEMS: list[dict[str, Any]] = [
    {"type": "compaction", "summary": "Earlier we set up the repository."},
    {"type": "message", "role": "user", "corral": {"kind": "prompt"},
     "content": [{"type": "input_text", "text": "What is in this picture and in main.py?"},
                 {"type": "input_image", "image_url": "https://example.com/cat.png"}]},
    {"type": "reasoning", "text": "I should look at the file.", "signature": "sig-abc",
     "encrypted_content": "enc-abc", "id": "rs_1"},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "Let me check both."}]},
    {"type": "function_call", "call_id": "call_1", "name": "read_file",
     "arguments": "{\"path\":\"main.py\"}"},
    {"type": "function_call", "call_id": "call_2", "name": "shell",
     "arguments": "{\"command\":\"file cat.png\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "print('hi')"},
    {"type": "function_call_output", "call_id": "call_2", "output": "no such file",
     "is_error": True, "corral": {"cache_breakpoint": True}},
    {"type": "message", "role": "developer", "corral": {"kind": "pre_tool_hook"},
     "content": "Remember: never delete files."},
    {"type": "message", "role": "assistant", "content": "main.py prints hi."},
    {"type": "message", "role": "user", "content": "Thanks. Now list the directory.",
     "corral": {"cache_breakpoint": True}},
]


def golden_request(provider: str, base_url: str = "http://127.0.0.1:9") -> dict[str, Any]:
    return {"op": "respond",
            "route": {"name": "main", "provider": provider, "model": "golden-model",
                      "base_url": base_url, "max_output_tokens": 1024},
            "instructions": INSTRUCTIONS, "items": ITEMS, "tools": TOOLS, "stream": True,
            "session_id": "sess-golden", "prompt_cache_key": "corral:sess-golden"}
