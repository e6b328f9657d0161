"""``attn-spec check TARGET [TARGET ...]``: run the catalog and print a conformance report."""
from __future__ import annotations

import os
import sys
import time

from attn_spec.report.ci import Expectations, github_annotations, to_junit
from attn_spec.cli import EXIT_FAIL, EXIT_OK, EXIT_USAGE
from attn_spec.report.text import render as render_report

CHECK_EPILOG = """\
Examples:
  attn-spec check examples/seed_attention.py:attention
  attn-spec check mypkg.attn:MultiHeadAttention --profile thorough
  attn-spec check my.py:attention --only scale-sqrt-dk causal-mask --seed 42
  attn-spec check my.py:attention --format json --output report.json
  attn-spec check my.py:attention --format junit --output conformance.xml --expect known-failures.txt
  attn-spec check torch.nn.functional:scaled_dot_product_attention --dtypes float32 --device cpu
  attn-spec check my.py:attention --require fully-masked=zeros mask-polarity=true-attends
  attn-spec check my.py:attention --require mask autograd bfloat16

Exit status: 0 every target conforms, 1 a property fails, 2 usage error or a target
that cannot be loaded.
"""


def _ids(text: str) -> list[str]:
    return [i for i in text.replace(",", " ").split() if i]


def add_parser(commands) -> None:
    import argparse

    from attn_spec.targets.conventions import CONVENTIONS
    from attn_spec.targets.capabilities import CAPABILITIES
    from attn_spec.targets.behaviours import VALUES
    from attn_spec.checking.strategies import PROFILES

    check = commands.add_parser("check", help="check attention functions or modules against the catalog",
                                epilog=CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("targets", nargs="+", metavar="TARGET", help="path/to/file.py:name or package.module:name")
    check.add_argument("--convention", choices=CONVENTIONS, help="force the target convention (default: detected)")
    check.add_argument("--profile", choices=list(PROFILES), default="default", help="how hard to look (default: default)")
    check.add_argument("--seed", type=int, help="seed for a reproducible run (default: random, printed in the report)")
    check.add_argument("--only", nargs="+", type=_ids, default=[], metavar="ID", help="run only these property ids")
    check.add_argument("--skip", nargs="+", type=_ids, default=[], metavar="ID", help="skip these property ids")
    check.add_argument("--require", nargs="+", type=_ids, default=[], metavar="CAPABILITY|KEY=VALUE",
                       help=f"fail unless the target has this capability ({', '.join(CAPABILITIES)}) or "
                            f"convention, e.g. fully-masked=zeros (keys: {', '.join(VALUES)})")
    check.add_argument("--dtypes", nargs="+", type=_ids, default=[], metavar="DTYPE",
                       help="check only these dtypes (float64 float32 float16 bfloat16; default all)")
    check.add_argument("--device", choices=("cpu", "cuda", "mps", "all"), default="all",
                       help="check on this device, or on every available one (default); with several, "
                            "outputs must also agree across devices")
    check.add_argument("--expect", metavar="FILE", help="properties known to fail or skip, one id per line with a "
                       "# comment: they do not fail the run; stale lines are reported")
    check.add_argument("-x", "--exitfirst", action="store_true",
                       help="stop at the first failing property (the fastest verdict; the rest are reported as not run)")
    check.add_argument("--format", choices=("text", "markdown", "json", "junit", "html"), default="text",
                       help="report format (html: self-contained, with heatmaps of the counterexamples)")
    check.add_argument("--output", metavar="FILE", help="write the report to FILE instead of stdout")


class _Progress:
    """One status line on stderr, only on a terminal and only once a run takes a few seconds."""

    def __init__(self, enabled: bool, after: float = 2.0):
        self.enabled, self.start, self.after, self.shown = enabled, time.monotonic(), after, False

    def __call__(self, text: str) -> None:
        if self.enabled and time.monotonic() - self.start > self.after:
            sys.stderr.write(f"\r\033[K{text}")
            sys.stderr.flush()
            self.shown = True

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def _flatten(lists) -> list[str]:
    return [i for group in lists for i in group]


def run(args) -> int:
    import attn_spec
    from attn_spec.targets.conventions import make_target
    from attn_spec.errors import TargetLoadError
    from attn_spec.targets.loading import load_target
    from attn_spec.errors import KitUsageError

    targets = []
    for spec in args.targets:
        try:
            targets.append(make_target(load_target(spec), spec, args.convention))
        except (TargetLoadError, KitUsageError) as exc:  # unloadable, or no convention fits
            print(f"attn-spec: {exc}", file=sys.stderr)
            return EXIT_USAGE
    try:
        expectations = Expectations.read(args.expect) if args.expect else None
        devices = _devices(args.device)
    except (OSError, KitUsageError) as exc:
        print(f"attn-spec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    progress = _Progress(sys.stderr.isatty())
    try:
        report = attn_spec.check(*targets, profile=args.profile, seed=args.seed, only=_flatten(args.only),
                                 skip=_flatten(args.skip), progress=progress, require=_flatten(args.require), exitfirst=args.exitfirst,
                                 dtypes=_flatten(args.dtypes) or None, devices=devices)
    except KitUsageError as exc:
        print(f"attn-spec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    finally:
        progress.done()
    if expectations:
        expectations.apply(report)
    colour = not args.output and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    render = {"text": lambda r: render_report(r, markdown=False, colour=colour), "markdown": lambda r: r.to_markdown(), "json": lambda r: r.to_json() + "\n",
              "junit": to_junit, "html": lambda r: r._repr_html_()}[args.format]
    if args.output:
        with open(args.output, "w", encoding="utf-8") as fh:
            fh.write(render(report))
    else:
        sys.stdout.write(render(report))
    if os.environ.get("GITHUB_ACTIONS") == "true":  # annotations on the pull request
        print("\n".join(github_annotations(report)), flush=True)
    return EXIT_OK if report.conforms else EXIT_FAIL


def _devices(choice: str):
    from attn_spec.checking.cases import available_devices
    from attn_spec.errors import KitUsageError

    available = available_devices()
    if choice == "all":
        return available
    if choice not in available:
        raise KitUsageError(f"--device {choice}: this machine has only {', '.join(available)}")
    return [choice]
