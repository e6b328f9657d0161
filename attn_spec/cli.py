"""The ``attn-spec`` command line: one module per subcommand in ``attn_spec.commands``.

Each command module provides ``add_parser(subparsers)`` and ``run(args) -> exit code``.
Exit codes: 0 success / conforms, 1 a property fails, 2 usage error or unloadable target.
"""
from __future__ import annotations

import argparse
import importlib
import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2

EPILOG = """\
Examples:
  attn-spec check examples/seed_attention.py:attention
  attn-spec check torch.nn.functional:scaled_dot_product_attention --profile thorough
  attn-spec COMMAND --help

Exit status: 0 success (every target conforms), 1 a property fails, 2 usage error.
"""


def build_parser() -> argparse.ArgumentParser:
    from attn_spec.version import __version__
    from attn_spec.commands import COMMANDS

    parser = argparse.ArgumentParser(prog="attn-spec", description="Property-based conformance checks for attention.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"attn-spec {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"attn_spec.commands.{name}").add_parser(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return importlib.import_module(f"attn_spec.commands.{args.command}").run(args)
    except KeyboardInterrupt:
        print("attn-spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
