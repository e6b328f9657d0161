"""How fast is `attn-spec grade`? Seconds per correct submission, and a class of 30.

    python benchmarks/bench_grade.py [--n 30] [--jobs 1 2] [--rubric FILE]

Prints the time of `python -c "import torch"` (what a cold process per submission would pay at
least), then, with the rubric (default: the kit's, profile "default"):
- one correct submission, end to end (start-up included);
- a class of N correct submissions and a class of N mixed ones (correct, buggy and hostile from
  tests/submissions/, one infinite loop among them), with each --jobs value;
- the marginal seconds per correct submission: (class of N - class of 1) / (N - 1).
The issue's target: a class of 30 correct submissions in under 90 s on a 2-core machine.
"""
from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBMISSIONS = Path(__file__).resolve().parents[1] / "tests" / "submissions"
CORRECT = ["correct_seed.py", "correct_float64.py", "correct_einsum_mha.py"]
MIXED = CORRECT + ["buggy_no_scale.py", "buggy_softmax_dim.py", "buggy_heads_view.py", "returns_nan.py",
                   "syntax_error.py", "missing_import.py", "exits.py", "segfault.py", "returns_list.py",
                   "lying_subclass.py", "memory_hog.py", "forbidden_sdpa.py", "patches_kit.py"]
HANGS = "loop_in_function.py"


def make_class(folder: Path, files: list[str], n: int, with_hang: bool = False) -> Path:
    folder.mkdir(parents=True)
    chosen = [files[i % len(files)] for i in range(n - with_hang)] + ([HANGS] if with_hang else [])
    for i, name in enumerate(chosen):
        shutil.copy(SUBMISSIONS / name, folder / f"student{i:02d}.py")
    return folder


def timed(*cmd) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and every process under it)."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    run = subprocess.run(cmd, capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{run.stderr[-2000:]}")
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def grade(folder: Path, jobs: int, rubric: str | None) -> tuple[float, float]:
    out = folder.parent / f"{folder.name}-out-{jobs}"
    extra = ["--rubric", rubric] if rubric else []
    return timed(sys.executable, "-m", "attn_spec", "grade", str(folder), "--out", str(out), "--jobs", str(jobs), *extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=30, help="submissions per class (default 30)")
    parser.add_argument("--jobs", type=int, nargs="+", default=[1, 2], help="--jobs values to time (default 1 2)")
    parser.add_argument("--rubric", help="rubric TOML (default: the kit's default rubric)")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times grow with it; CPU times less)")
    wall, cpu = min(timed(sys.executable, "-c", "import torch") for _ in range(3))
    print(f'python -c "import torch": {wall:.2f} s wall, {cpu:.2f} s CPU (best of 3)')
    with tempfile.TemporaryDirectory(prefix="bench-grade-") as tmp:
        tmp = Path(tmp)
        one, one_cpu = grade(make_class(tmp / "one", CORRECT[:1], 1), 1, args.rubric)
        print(f"1 correct submission, end to end: {one:.1f} s wall, {one_cpu:.1f} s CPU")
        correct = make_class(tmp / "correct", CORRECT, args.n)
        mixed = make_class(tmp / "mixed", MIXED, args.n, with_hang=True)
        for jobs in args.jobs:
            t_correct, c_correct = grade(correct, jobs, args.rubric)
            t_mixed, c_mixed = grade(mixed, jobs, args.rubric)
            print(f"--jobs {jobs}: {args.n} correct {t_correct:.1f} s wall, {c_correct:.1f} s CPU "
                  f"({(t_correct - one) / (args.n - 1):.2f} s wall, {(c_correct - one_cpu) / (args.n - 1):.2f} s CPU "
                  f"per extra submission); {args.n} mixed {t_mixed:.1f} s wall, {c_mixed:.1f} s CPU")
        print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
