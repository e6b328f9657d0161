"""The ``attn-spec`` command line: one module per subcommand in ``attn_spec.commands``.

Each command module provides ``add_parser(subparsers)`` and ``run(args) -> exit code``. An error in a
command's arguments prints one line that says what is wrong, then where the usage is
(``run 'attn-spec check --help' for usage``): that command's, never the top-level one, and never the
whole usage block before the line that matters.
Exit codes (attn_spec.exit_codes): 0 success / conforms, 1 a property fails, 2 usage error or unloadable target, 3 a call into a
target could not be interrupted past its deadline (attn_spec.targets.deadline ends the process).
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from attn_spec.exit_codes import EXIT_FAIL, EXIT_HUNG, EXIT_OK, EXIT_USAGE, usage_message

__all__ = ["EXIT_FAIL", "EXIT_HUNG", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

EPILOG = """\
Examples:
  attn-spec check my_attention.py:attention
  attn-spec check attn_spec.reference:reference_attention --profile quick     # the kit's own, to try it
  attn-spec check torch.nn.functional:scaled_dot_product_attention --profile thorough
  attn-spec check                  # the targets and settings of [tool.attn-spec] in pyproject.toml
  attn-spec config                 # the effective settings and where each comes from
  attn-spec COMMAND --help

Exit status: 0 success (every target conforms), 1 a property fails, 2 usage error, 3 a target hung beyond
interruption (stuck in native code past its deadline).
"""


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose ``error`` prints ``usage_message`` (exit 2) instead of the usage block
    followed by the error. Subcommand parsers are of the same class (``add_subparsers`` makes them so)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, usage_message(self.prog, message))


def build_parser() -> argparse.ArgumentParser:
    from attn_spec.version import __version__
    from attn_spec.commands import COMMANDS

    parser = Parser(prog="attn-spec", description="Property-based conformance checks for attention.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"attn-spec {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"attn_spec.commands.{name}").add_parser(subparsers)
    parser.set_defaults(commands=subparsers.choices)
    return parser


def main(argv=None) -> int:
    # Before torch is imported (no command imports it before this line): torch's idle OpenMP threads sleep instead
    # of spinning after each parallel op. A check calls small ops thousands of times (softmax goes parallel at any
    # size): on a loaded 2-core machine the spinning thread made a default check of the seed attention cost 14.7 to
    # 18.6 s of CPU, 3.4 to 4.0 s without it (benchmarks/bench_startup.py). The threads, and so what a target
    # computes, are the same. A user's own OMP_WAIT_POLICY is kept.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args, extra = build_parser().parse_known_args(argv)
    if extra:  # argparse would blame the top-level parser for a subcommand's extra arguments
        args.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return importlib.import_module(f"attn_spec.commands.{args.command}").run(args)
    except KeyboardInterrupt:
        print("attn-spec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
