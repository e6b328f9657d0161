"""``attn-spec explain ID``: one property as a lesson (math, why, bugs, worked example, check, derivation)."""
from __future__ import annotations

import sys

from attn_spec.cli import EXIT_OK, usage_error


def add_parser(commands) -> None:
    parser = commands.add_parser("explain", help="explain one property: math, why, typical bugs, a worked example",
                                 description="Explain one property of the catalog (ids: attn-spec list).")
    parser.add_argument("id", metavar="ID", help="a property id, e.g. scale-sqrt-dk")
    parser.add_argument("--format", choices=("text", "markdown"), default="text",
                        help="text (unicode math) or markdown (LaTeX math)")


def run(args) -> int:
    import attn_spec.properties  # noqa: F401 - registers the catalog
    from attn_spec.checking.catalog import REGISTRY
    from attn_spec.lessons import render

    if args.id not in REGISTRY:
        return usage_error(args, f"unknown property id {args.id!r}; known ids:\n  " + "\n  ".join(REGISTRY))
    sys.stdout.write(render(args.id, args.format))
    return EXIT_OK
