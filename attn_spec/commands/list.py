"""``attn-spec list``: the catalog as a table (id, family, statement, conventions); ``--mistakes``: the
mistake models the diagnosis names (id, family, what the wrong code does, where it is shown)."""
from __future__ import annotations

import textwrap

from attn_spec.cli import EXIT_OK


def add_parser(commands) -> None:
    parser = commands.add_parser("list", help="list the catalog's properties",
                                 description="The catalog: one row per property, in the order `check` runs them.")
    parser.add_argument("--format", choices=("text", "markdown"), default="text", help="table format")
    parser.add_argument("--mistakes", action="store_true",
                        help="list the mistake models a failure report can name, instead of the properties")


def run(args) -> int:
    from tabulate import tabulate

    import attn_spec.properties  # noqa: F401 - registers the catalog
    from attn_spec.checking.catalog import REGISTRY

    markdown = args.format == "markdown"
    if args.mistakes:
        return _mistakes(markdown, tabulate)
    rows = [[p.id, p.family, p.statement if markdown else textwrap.fill(p.statement, 60),
             ", ".join(p.conventions) if markdown else textwrap.fill(", ".join(p.conventions), 28)]
            for p in REGISTRY.values()]
    print(tabulate(rows, headers=["id", "family", "statement", "conventions"],
                   tablefmt="github" if markdown else "simple_grid"))
    print(f"\n{len(rows)} properties · attn-spec explain ID for one of them")
    return EXIT_OK


def _mistakes(markdown: bool, tabulate) -> int:
    from attn_spec.diagnosis import MISTAKES

    rows = [[m.id, m.family, m.describe() if markdown else textwrap.fill(m.describe(), 64),
             ", ".join(m.caught_by) if markdown else textwrap.fill(", ".join(m.caught_by), 24)]
            for m in MISTAKES.values()]
    print(tabulate(rows, headers=["id", "family", "what the wrong code does", "shown at"],
                   tablefmt="github" if markdown else "simple_grid"))
    print(f"\n{len(rows)} mistake models · attn-spec explain ID for one of them")
    return EXIT_OK
