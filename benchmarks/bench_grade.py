"""Time `attn-spec grade` with diagnosis on (issue 26, item 6): a class of 30 correct submissions and a
class of 30 single-bug ones, at ``--jobs 2``, under the default rubric.

    python benchmarks/bench_grade.py [--n 30] [--jobs 2]

The correct class cycles through tests/submissions/correct_*.py; the single-bug class through the
four buggy_*.py (wrong softmax axis, no scale, Q scaled in place, heads split without a transpose).
Prints one line per class (wall time, the target, met or not) and, for the single-bug class, whether
every student got exactly one named root. Diagnosis runs only where something failed, so the correct
class measures what it costs a passing class (nothing beyond the check of `failing`), the buggy one
what the child's search and the grader's re-check cost. Wall-clock figures on a machine shared with
other work are upper bounds: the load average is printed with them, and the CPU seconds the whole
run used (grader, judges, zygote and submissions), which other work does not inflate as much; divided
by --jobs they bound the wall time on idle cores from below.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBMISSIONS = Path(__file__).resolve().parent.parent / "tests" / "submissions"
CORRECT = ["correct_seed.py", "correct_einsum_mha.py", "correct_float64.py"]
BUGGY = {"buggy_softmax_dim.py": "softmax-over-queries", "buggy_no_scale.py": "scale-missing",
         "buggy_in_place.py": "queries-scaled-in-place", "buggy_heads_view.py": "heads-split-without-transpose"}
TARGETS = {"correct": 60.0, "single-bug": 120.0}  # seconds for the class, at --jobs 2


def make_class(folder: Path, files: list[str], n: int) -> dict[str, str]:
    """``n`` students cycling through ``files``; student name -> the file it copies."""
    folder.mkdir(parents=True)
    chosen = {f"student{i:02d}": files[i % len(files)] for i in range(n)}
    for name, source in chosen.items():
        shutil.copy(SUBMISSIONS / source, folder / f"{name}.py")
    os.chmod(folder, 0o700)
    return chosen


def _cpu() -> float:
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def grade(folder: Path, out: Path, jobs: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run: the CPU time of the grader, its judges, the zygote and every
    submission's process (each reaped by its parent, so it adds up here)."""
    start, cpu = time.monotonic(), _cpu()
    done = subprocess.run([sys.executable, "-m", "attn_spec", "grade", str(folder), "--out", str(out),
                           "--jobs", str(jobs)], capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"attn-spec grade failed:\n{done.stderr[-3000:]}")
    return wall, _cpu() - cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=30, help="submissions per class (default 30)")
    parser.add_argument("--jobs", type=int, default=2, help="--jobs for the grader (default 2)")
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="bench-grade-") as tmp:
        tmp = Path(tmp)
        os.chmod(tmp, 0o711)
        for kind, files in (("correct", CORRECT), ("single-bug", list(BUGGY))):
            chosen = make_class(tmp / kind, files, args.n)
            load = os.getloadavg()[0]
            wall, cpu = grade(tmp / kind, tmp / f"{kind}-out", args.jobs)
            graded = {s["name"]: s for s in json.loads((tmp / f"{kind}-out" / "grades.json").read_text())["submissions"]}
            met = wall < TARGETS[kind]
            ok &= met
            line = (f"grade {args.n} {kind} submissions, --jobs {args.jobs}: {wall:.1f} s "
                    f"(target < {TARGETS[kind]:g} s: {'met' if met else 'NOT met'}; load average {load:.1f} at start, "
                    f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores); {cpu:.1f} CPU seconds in all, "
                    f"so {cpu / args.jobs:.1f} s on {args.jobs} idle cores at best")
            if kind == "correct":
                full = sum(s["score"] - s["bonus"] >= s["max_score"] > 0 for s in graded.values())
                line += f"; full marks {full} of {args.n}"
            else:
                named = sum([d["mistake"] for d in graded[name]["roots"]] == [BUGGY[source]]
                            for name, source in chosen.items())
                line += f"; one root naming the bug: {named} of {args.n}"
                ok &= named == args.n
            print(line, flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
