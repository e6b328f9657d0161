"""``attn-spec grade SUBMISSIONS --out DIR``: grade a class's attention submissions in sandboxed processes."""
from __future__ import annotations

import os
import stat
import sys
import tempfile
import time

from attn_spec.exit_codes import EXIT_FAIL, EXIT_OK, EXIT_USAGE, usage_error

GRADE_EPILOG = """\
Examples:
  attn-spec grade submissions/ --out grades/
  attn-spec grade submissions/ --out grades/ --rubric rubric.toml --jobs 2
  attn-spec grade --print-rubric > rubric.toml
  attn-spec grade /autograder/submission --gradescope --out /autograder/results

SUBMISSIONS holds one .py file or one folder per student; each defines attention(Q, K, V, mask=None)
and may define a MultiHeadAttention class. Each submission runs in its own process, confined and
time- and memory-limited (see docs/grading.md). DIR receives grades.csv, grades.json, summary.md
(with summary.json and summary.html: the class's mistakes) and
feedback/<name>.md (and results.json with --gradescope, where SUBMISSIONS is one submission).

Exit status: 0 graded (whatever the grades), 1 the grader failed on a submission, 2 usage error.
"""


def add_parser(commands) -> None:
    import argparse

    grade = commands.add_parser("grade", help="grade a folder of student submissions, each in a sandboxed process",
                                epilog=GRADE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    grade.add_argument("submissions", nargs="?", metavar="SUBMISSIONS", help="folder of submissions (or one, with --gradescope)")
    grade.add_argument("--out", metavar="DIR", help="folder for the grades and feedback (created if missing)")
    grade.add_argument("--rubric", metavar="FILE", help="rubric TOML (default: the kit's; see --print-rubric)")
    grade.add_argument("--jobs", type=int, default=1, metavar="N", help="submissions graded in parallel (default 1)")
    grade.add_argument("--timeout", type=float, metavar="SECONDS",
                       help="limit for the import and for each call, overriding the rubric's")
    grade.add_argument("--gradescope", action="store_true", help="SUBMISSIONS is one submission; also write results.json")
    grade.add_argument("--print-rubric", action="store_true", help="print the default rubric and exit")


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_folders(args) -> str | None:
    """A reason the submissions or the output folder cannot be used, or None. Checked before the
    grading worker starts, so the usual mistakes (a wrong path, an empty folder) cost nothing."""
    from attn_spec.errors import KitUsageError
    from attn_spec.grading.submissions import found_in  # light: no torch

    try:
        found_in(args.submissions, single=args.gradescope)
    except KitUsageError as exc:
        return str(exc)
    folder = args.submissions if os.path.isdir(args.submissions) else None
    if folder and _inside(args.out, folder):
        return f"--out {args.out} is inside the submissions folder; choose a folder outside it"
    if (folder and _inside(tempfile.gettempdir(), folder)) or _inside(tempfile.gettempdir(), args.out):
        return f"the temporary folder {tempfile.gettempdir()} is inside the submissions or output folder; set TMPDIR"
    if os.path.lexists(args.out):
        if not os.path.isdir(args.out):
            return f"--out {args.out} exists and is not a folder"
        info = os.stat(args.out)
        if info.st_uid != os.geteuid():  # made by someone else (a sandbox user of an earlier run, say)
            return (f"--out {args.out} belongs to uid {info.st_uid}, not to the user grading; choose a folder of "
                    "your own (the grader never writes into someone else's)")
        if info.st_mode & stat.S_IWOTH:
            return f"--out {args.out} is writable by every user; a submission could plant files there"
        feedback = os.path.join(args.out, "feedback")
        if os.path.lexists(feedback) and (os.path.islink(feedback) or not os.path.isdir(feedback)
                                          or os.lstat(feedback).st_uid != os.geteuid()):
            return f"{feedback} is not a folder of yours (a link, a file, or someone else's); remove it"
    return None


def _make_private(out: str) -> None:
    """Create --out, or take an existing one back to 0700 (with feedback/), before any submission runs:
    the previous run's grades, feedback and printed output are then out of every child's reach."""
    os.makedirs(out, mode=0o700, exist_ok=True)
    os.chmod(out, 0o700)
    feedback = os.path.join(out, "feedback")
    if os.path.isdir(feedback) and not os.path.islink(feedback):
        os.chmod(feedback, 0o700)


class _Progress:
    """One line on stdout, only on a terminal: submissions done, full marks so far, time left."""

    def __init__(self, enabled: bool):
        self.enabled, self.start = enabled, time.monotonic()

    def __call__(self, grades, total) -> None:
        if not self.enabled:
            return
        done, elapsed = len(grades), time.monotonic() - self.start
        full = sum(g.full_marks for g in grades)
        left = elapsed / done * (total - done)
        sys.stdout.write(f"\r\033[K[{done}/{total}] {full} with full marks · {elapsed:.0f}s elapsed · about {left:.0f}s left")
        sys.stdout.flush()
        if done == total:
            sys.stdout.write("\r\033[K")


def run(args) -> int:
    if args.print_rubric:
        from attn_spec.grading.default_rubric import DEFAULT_RUBRIC

        sys.stdout.write(DEFAULT_RUBRIC)
        return EXIT_OK
    problem = ("give SUBMISSIONS and --out DIR (or --print-rubric)" if not args.submissions or not args.out
               else f"--jobs must be at least 1, got {args.jobs}" if args.jobs < 1 else _check_folders(args))
    if problem:
        return usage_error(args, problem)
    from attn_spec.errors import IsolationError, KitUsageError
    from attn_spec.grading.isolation.zygote import launch

    try:
        launched = launch()  # the warm worker imports torch while this process loads the catalog
    except IsolationError as exc:  # the machine's set-up (a TMPDIR the sandbox users cannot enter)
        print(f"attn-spec: {exc}", file=sys.stderr)
        return EXIT_USAGE

    try:
        from attn_spec.grading.grader import GRADER_ERROR
        from attn_spec.grading.pool import grade_all
        from attn_spec.grading.outputs import write_outputs
        from attn_spec.grading.rubric import load
        from attn_spec.grading.submissions import discover

        rubric = load(args.rubric).with_timeout(args.timeout)
        subs = discover(args.submissions, rubric, single=args.gradescope)
    except KitUsageError as exc:
        launched.close()
        print(f"attn-spec: {exc}", file=sys.stderr)
        return EXIT_USAGE
    _make_private(args.out)
    if (not args.gradescope and os.geteuid() == 0  # with --gradescope there is one submission: no others to read
            and os.stat(args.submissions).st_mode & (stat.S_IROTH | stat.S_IXOTH)):
        print(f"attn-spec: note: {args.submissions} is readable by every user, so a submission can read the "
              f"others while it runs; `chmod o-rwx {args.submissions}` prevents it", file=sys.stderr)
    start = time.monotonic()
    grades = grade_all(subs, rubric, jobs=args.jobs, progress=_Progress(sys.stdout.isatty()), launched=launched)
    written = write_outputs(args.out, grades, rubric, gradescope=args.gradescope)
    counts: dict[str, int] = {}
    for g in grades:
        counts[g.outcome] = counts.get(g.outcome, 0) + 1
    full = sum(g.full_marks for g in grades)
    print(f"graded {len(grades)} submission(s) in {time.monotonic() - start:.1f}s: {full} with full marks; "
          + ", ".join(f"{n} {outcome}" for outcome, n in sorted(counts.items(), key=lambda kv: -kv[1])))
    files = [name for name in (os.path.relpath(path, args.out) for path in written) if os.sep not in name]
    print(f"wrote {', '.join(files)} and feedback/ in {args.out}")
    if counts.get(GRADER_ERROR):
        print(f"attn-spec: the grader failed on {counts[GRADER_ERROR]} submission(s); see their feedback", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_OK
