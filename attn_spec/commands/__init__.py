"""Subcommands of ``attn-spec``: each module here provides ``add_parser`` and ``run``."""

COMMANDS = ("check", "config", "grade", "list", "explain")
