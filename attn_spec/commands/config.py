"""``attn-spec config``: the effective settings of ``attn-spec check`` here, and where each comes from."""
from __future__ import annotations

import json
import os
import sys

from attn_spec.exit_codes import EXIT_OK, usage_error

CONFIG_EPILOG = """\
Examples:
  attn-spec config                              # what `attn-spec check` would use here
  ATTN_SPEC_PROFILE=quick attn-spec config      # an environment variable over pyproject.toml
  attn-spec config --profile thorough           # the command line over both
  attn-spec config --format json

Each setting is a flag of `attn-spec check`, an environment variable ATTN_SPEC_<NAME> and a key of
the [tool.attn-spec] table of the nearest pyproject.toml (from the current folder up); the pytest
plugin reads the same as --attn-<name> and the ini key attn_<name>.
"""


def add_parser(commands) -> None:
    import argparse

    from attn_spec.settings import add_arguments

    parser = commands.add_parser("config", help="show the effective settings and where each comes from",
                                 description="The settings `attn-spec check` would use here, layered "
                                             "command line > environment > pyproject.toml > defaults.",
                                 epilog=CONFIG_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--format", choices=("text", "json"), default="text", help="output format")


def _shown(setting, value) -> str:
    if value is None or value == []:
        return f"({setting.unset})"
    if isinstance(value, list):
        return " ".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def run(args) -> int:
    from tabulate import tabulate

    from attn_spec import settings as config

    try:
        settings = config.load(config.command_line(args))
    except config.SettingError as exc:
        return usage_error(args, str(exc))
    where = (f"{os.path.relpath(settings.pyproject)} {config.TABLE}" if settings.pyproject else
             f"none (no pyproject.toml with a {config.TABLE} table here or above)")
    stray = config.stray_variables()
    if args.format == "json":
        rows = {s.name: {"value": settings[s.name], "source": settings.sources[s.name], "flag": s.cli_flags[0]
                         if not s.positional else None, "env": s.env, "pytest": s.pytest_flag, "ini": s.ini}
                for s in config.offered()}
        json.dump({"pyproject": str(settings.pyproject) if settings.pyproject else None, "settings": rows,
                   "unknown_variables": stray}, sys.stdout, indent=2)
        print()
        return EXIT_OK
    print(f"attn-spec settings ({config.PRECEDENCE})\npyproject.toml: {where}\n")
    rows = [[s.name, _shown(s, settings[s.name]), settings.sources[s.name]] for s in config.offered()]
    print(tabulate(rows, headers=["setting", "value", "source"], tablefmt="simple"))
    if stray:
        print()
    for name in stray:
        print(f"note: {name} is set but names no setting; it is ignored")
    return EXIT_OK
