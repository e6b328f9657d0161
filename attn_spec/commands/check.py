"""``attn-spec check TARGET [TARGET ...]``: run the catalog and print a conformance report."""
from __future__ import annotations

import gc
import os
import sys
import time

from attn_spec.exit_codes import EXIT_FAIL, EXIT_OK, EXIT_USAGE, usage_error

CHECK_EPILOG = """\
Examples:
  attn-spec check my_attention.py:attention                   # your own file: path:name
  attn-spec check attn_spec.reference:reference_attention --profile quick   # the kit's own: it conforms
  attn-spec check                  # targets and settings from [tool.attn-spec] in pyproject.toml
  attn-spec check mypkg.attn:MultiHeadAttention --profile thorough
  attn-spec check my.py:attention --only scale-sqrt-dk causal-mask --seed 42
  attn-spec check my.py:attention --format json --output report.json
  attn-spec check my.py:attention --format junit --output conformance.xml --expect known-failures.txt
  attn-spec check torch.nn.functional:scaled_dot_product_attention --dtypes float32 --device cpu
  attn-spec check my.py:attention --require fully-masked=zeros mask-polarity=true-attends
  attn-spec check my.py:attention --require mask autograd bfloat16
  attn-spec check my_kernel.py:attention --inference-only     # no backward: gradients is a skip
  attn-spec check chatty.py:attention -v                      # all that the target printed and warned
  attn-spec check my.py:attention --masks bool,additive       # it takes additive float masks too
  attn-spec check transformers.integrations.sdpa_attention:sdpa_attention_forward
  attn-spec check my_kernels.py:flash_like --layout bshd
  attn-spec check mymods.py:sliding_window_mask --expect-mask sliding-window:4
  attn-spec check mymods.py:tanh_softcap --expect-score softcap:50
  attn-spec check slow.py:attention --call-timeout 60         # each call may take 60 s on a small case
  attn-spec check my.py:attention --shapes 1,8,4096,128 1,32,8,1,32768,128   # B,H,N,D or B,H,HKV,NQ,NKV,D
  attn-spec check my.py:decode --shapes 4,32,8,1,32768,128,page=256   # B,H,[HKV,]S_NEW,S_CACHE,D[,page=P]
  attn-spec check torch.nn.functional:scaled_dot_product_attention --profile scale

Every setting can also come from an environment variable (ATTN_SPEC_PROFILE=quick, ...) or the
[tool.attn-spec] table of pyproject.toml (profile = "quick"); the command line wins, then the
environment, then the file. `attn-spec config` shows the effective settings and their sources.

Exit status: 0 every target conforms, 1 a property fails or a target had nothing checked, 2 usage
error or a target that cannot be loaded (the others are still checked and reported), 3 a call into a
target could not be interrupted past its deadline (--call-timeout; stuck in native code): stderr says which.
A call past its deadline that can be interrupted fails its property ("did not return within 10 s") and the
check goes on. On a terminal, a check that runs longer than 2 s shows its progress on stderr.
"""


def add_parser(commands) -> None:
    import argparse

    from attn_spec.settings import add_arguments

    check = commands.add_parser("check", help="check attention functions or modules against the catalog",
                                epilog=CHECK_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(check)
    check.add_argument("-v", "--verbose", action="store_true",
                       help="show all the output the targets printed, warned and logged (captured per property; "
                            "by default the report shows its count and first occurrence)")
    check.add_argument("-x", "--exitfirst", action="store_true",
                       help="stop at the first unexpected failure (the fastest verdict; the rest are reported as not run)")
    check.add_argument("--format", choices=("text", "markdown", "json", "junit", "html"), default="text",
                       help="report format (html: self-contained, with heatmaps of the counterexamples)")
    check.add_argument("--output", metavar="FILE", help="write the report to FILE instead of stdout")


class _Progress:
    """One status line on stderr (which target, property, case), rewritten in place at most ``every`` seconds:
    only on a terminal and only once a run takes ``after`` seconds; cleared at the end. ``stream``: stderr as it
    was when the run began (the targets' output is captured meanwhile)."""

    def __init__(self, stream, enabled: bool, after: float = 2.0, every: float = 0.2):
        self.stream, self.enabled, self.after, self.every = stream, enabled, after, every
        self.start, self.last, self.shown = time.monotonic(), 0.0, False

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if self.enabled and now - self.start > self.after and now - self.last >= self.every:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()
            self.last, self.shown = now, True

    def done(self) -> None:
        if self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _output_problem(path: str) -> str | None:
    """Why the report cannot be written to ``path``, checked before the run (not after it); None if it can."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        return f"--output {path} is a folder; name a file in it"
    if not os.path.isdir(folder):
        return f"--output {path}: there is no folder {folder} to write it in (create it first)"
    if not os.access(path if os.path.exists(path) else folder, os.W_OK):
        return f"--output {path}: {'the file' if os.path.exists(path) else f'the folder {folder}'} is not writable"
    return None


def run(args) -> int:
    from attn_spec import settings as config

    if args.output and _output_problem(args.output):
        return usage_error(args, _output_problem(args.output))
    try:
        settings = config.load(config.command_line(args))
    except config.SettingError as exc:
        return usage_error(args, str(exc))
    if not settings["targets"]:
        return usage_error(args, f"no TARGET given, and no targets in {config.TABLE} of a pyproject.toml here or "
                                 f"above (nor in {config.SETTINGS['targets'].env})")
    from attn_spec import api
    from attn_spec.report import render
    from attn_spec.report.ci import github_annotations

    try:
        plan = api.plan(settings)
    except config.SettingError as exc:
        return usage_error(args, str(exc))
    not_loaded = []  # a target that cannot be loaded (or fits no convention) does not stop the others
    targets = api.load_targets(settings, not_loaded=not_loaded, verbose=args.verbose)
    for missing in not_loaded:
        print(f"attn-spec: {missing['message']}", file=sys.stderr)
    if not targets:
        return EXIT_USAGE
    # torch's, the kit's and the targets' modules outlive the run: out of the collector's sight, neither Hypothesis's
    # gc.collect() at its first example nor the automatic full collections walk them again. Unfrozen after it, for a
    # caller of main() in a long-lived process (its objects from before are collectable again).
    gc.freeze()
    progress = _Progress(sys.stderr, sys.stderr.isatty() and args.format not in ("json", "junit"))  # quiet in CI logs
    try:
        report = api.run(targets, plan, progress=progress, exitfirst=args.exitfirst, verbose=args.verbose,
                         not_loaded=not_loaded)
    finally:
        gc.unfreeze()
        progress.done()
    colour = not args.output and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    written = render(report, args.format, colour=colour and args.format == "text")
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as fh:
                fh.write(written)
        except OSError as exc:
            print(f"attn-spec: cannot write the report to {args.output}: {exc.strerror}", file=sys.stderr)
            return EXIT_USAGE
        verdict = "conforms" if report.conforms else "does not conform"
        print(f"attn-spec: wrote the {args.format} report of {len(report.targets)} target(s) ({verdict}) to "
              f"{args.output}", file=sys.stderr)  # stdout stays empty: it may be piped
    else:
        sys.stdout.write(written)
    if os.environ.get("GITHUB_ACTIONS") == "true":  # annotations on the pull request
        print("\n".join(github_annotations(report)), flush=True)
    return EXIT_USAGE if not_loaded else EXIT_OK if report.conforms else EXIT_FAIL
