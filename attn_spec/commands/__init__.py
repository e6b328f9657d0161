"""Subcommands of ``attn-spec``: each module here provides ``add_parser`` and ``run``."""

COMMANDS = ("check", "grade", "list", "explain")
