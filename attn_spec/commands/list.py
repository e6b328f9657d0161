"""``attn-spec list``: the catalog as a table (id, family, statement, conventions); ``--mistakes``: the
mistake models the diagnosis names (id, family, what the wrong code does, where it is shown);
``--conventions``: the registered calling conventions and the traits each declares."""
from __future__ import annotations

import textwrap

from attn_spec.exit_codes import EXIT_OK


def add_parser(commands) -> None:
    parser = commands.add_parser("list", help="list the catalog's properties",
                                 description="The catalog: one row per property, in the order `check` runs them.")
    parser.add_argument("--format", choices=("text", "markdown"), default="text", help="table format")
    parser.add_argument("--mistakes", action="store_true",
                        help="list the mistake models a failure report can name, instead of the properties")
    parser.add_argument("--conventions", action="store_true",
                        help="list the calling conventions (--convention NAME) and their traits, instead of the properties")


def run(args) -> int:
    from tabulate import tabulate

    from attn_spec.properties import catalog

    markdown = args.format == "markdown"
    if args.mistakes:
        return _mistakes(markdown, tabulate)
    if args.conventions:
        return _conventions(markdown, tabulate)
    rows = [[p.id, p.family, p.statement if markdown else textwrap.fill(p.statement, 60),
             ", ".join(p.conventions) if markdown else textwrap.fill(", ".join(p.conventions), 28)]
            for p in catalog().values()]
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
    serving = sum(m.serving for m in MISTAKES.values())
    print(f"\n{len(MISTAKES)} mistake models ({len(MISTAKES) - serving} of attention, {serving} of serving kernels) · "
          f"attn-spec explain ID for one of them")
    return EXIT_OK


def _conventions(markdown: bool, tabulate) -> int:
    from attn_spec.targets.conventions import conventions
    from attn_spec.vocabulary import traits

    def wrap(text, width):
        return text if markdown else textwrap.fill(text, width)

    rows = []
    for name in conventions():
        t = traits(name)
        declared = ", ".join(filter(None, ["trained" if t.trained else "backward optional", "multi-head" if t.multihead else "",
                                           ("masks " + "+".join(t.masks) + (" (declarable)" if t.declarable_masks else ""))
                                           if t.masks else "no mask argument",  # a serving kernel: causal= at most
                                           *(["options " + "+".join(t.options)] if t.options else []),
                                           *([f"dtypes {'+'.join(t.dtypes)}"] if t.dtypes else []),
                                           f"layout {t.layout}"]))
        rows.append([name, t.kind, wrap(t.signature, 48), wrap(declared, 36)])
    print(tabulate(rows, headers=["convention", "kind", "how it is called", "traits"],
                   tablefmt="github" if markdown else "simple_grid"))
    print(f"\n{len(rows)} conventions · detected from the target's type and signature, or forced with --convention NAME")
    return EXIT_OK
