"""How a command ends, below the commands and the CLI that both use it (and the deadline, which ends a hung
process): the exit codes and the one-line usage error.

Exit codes: 0 success / conforms, 1 a property fails, 2 usage error or unloadable target, 3 a call into a
target could not be interrupted past its deadline (attn_spec.targets.deadline ends the process).
"""
from __future__ import annotations

import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_HUNG = 0, 1, 2, 3


def usage_message(prog: str, message: str) -> str:
    """The error first, then where the usage is: ``attn-spec check: error: ...`` and a pointer to --help."""
    return f"{prog}: error: {message}\nrun '{prog} --help' for usage\n"


def usage_error(args, message: str) -> int:
    """``message`` as the command's own parser's ``error`` prints it, but returned as exit 2."""
    sys.stderr.write(usage_message(args.commands[args.command].prog, message))
    return EXIT_USAGE
