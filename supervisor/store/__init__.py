"""Durable session store (SQLite via aiosqlite). See docs/storage.md."""
