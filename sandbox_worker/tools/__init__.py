"""The five tools (shell, read_file, write_file, edit_file, list_dir) and the
``tool`` service handler. See ``docs/sandbox.md``."""
