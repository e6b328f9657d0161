"""``attn-spec explain ID``: one property as a lesson (math, why, bugs, worked example, check, derivation),
or one mistake model (what the wrong code does, the fix, its code, how it is recognised, an example)."""
from __future__ import annotations

import sys

from attn_spec.exit_codes import EXIT_OK, usage_error


def add_parser(commands) -> None:
    parser = commands.add_parser("explain", help="explain one property or mistake: math, why, bugs, a worked example",
                                 description="Explain one property of the catalog (ids: attn-spec list) or one "
                                             "mistake model (ids: attn-spec list --mistakes).")
    parser.add_argument("id", metavar="ID", help="a property id, e.g. scale-sqrt-dk, a mistake id, e.g. "
                                                 "scale-one-over-dk, or 'behaviours' (the header's behaviours line)")
    parser.add_argument("--format", choices=("text", "markdown"), default="text",
                        help="text (unicode math) or markdown (LaTeX math)")


def run(args) -> int:
    from attn_spec.properties import catalog
    from attn_spec.diagnosis import MISTAKES
    from attn_spec.lessons import render
    from attn_spec.mistake_lessons import render_mistake
    from attn_spec.settings import did_you_mean

    if args.id == "behaviours":
        from attn_spec.targets.behaviours import explain

        sys.stdout.write(explain())
        return EXIT_OK
    if args.id in MISTAKES:
        sys.stdout.write(render_mistake(args.id, args.format))
        return EXIT_OK
    known = catalog()
    if args.id not in known:
        hint = did_you_mean(args.id, [*known, *MISTAKES])
        return usage_error(args, f"unknown property id {args.id!r}{hint} (nor a mistake id: attn-spec list --mistakes "
                                 f"lists those); known property ids:\n  " + "\n  ".join(known))
    sys.stdout.write(render(args.id, args.format))
    return EXIT_OK
