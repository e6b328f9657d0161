"""Side by side: which checks catch the reward-hack kernels of tests/gallery/attacks.py, and which fail an honest one.

For each kernel (23 attacks, 7 honest optimised kernels), the verdict of:

  kb-rand     a KernelBench-style check: 5 trials at one shape, torch.rand inputs, allclose(1e-2, 1e-2) against
              torch's SDPA, the candidate imported into the harness's process (benchmarks/harnesses/kernelbench_style.py)
  kb-randn    the same with torch.randn inputs
  fib         a FlashInfer-Bench-style check: 3 trials at 5 traced shapes, the solution in a worker process, shape,
              dtype, non-finite and per-element atol/rtol checks (benchmarks/harnesses/flashinfer_bench_style.py)
  default     attn-spec check at the default profile
  isolate     attn-spec check --isolate (default profile)
  thorough    attn-spec check --profile thorough, run where the default check passed (a kernel the default
              profile fails is counted as failing at thorough too: shown as "CAUGHT (default)")
  grade       attn-spec grade on the kernel as a submission (the default rubric, its forbidden calls emptied:
              a kernel gate forbids nothing)

"caught" for an attack means its verdict is not a pass; for an honest kernel, a "caught" is a false alarm. Every
check runs in a fresh process per kernel, so what a kernel patches at import reaches only its own checks.

    python benchmarks/bench_attacks.py [--columns kb-rand,default,...] [--only NAME ...] [--jobs 2]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tabulate import tabulate

os.environ.setdefault("OMP_NUM_THREADS", "1")  # every process it starts: one intra-op thread (tests/conftest.py)
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from gallery.attacks import ATTACKS, HONEST, KERNELS  # noqa: E402

HARNESSES = ROOT / "benchmarks" / "harnesses"
PYTHON = sys.executable
CLI = [PYTHON, "-m", "attn_spec"]
SEED = 20261203
COLUMNS = ("kb-rand", "kb-randn", "fib", "default", "isolate", "grade", "thorough")
TIMEOUT = 1800


def _run(argv, timeout=TIMEOUT) -> tuple[subprocess.CompletedProcess | None, float]:
    start = time.perf_counter()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        done = None
    return done, time.perf_counter() - start


def _harness(kernel, argv) -> tuple[bool, str]:
    done, _ = _run(argv)
    if done is None:
        return False, "the harness timed out"
    try:
        verdict = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):  # the harness itself died (a kernel that kills its process, say)
        return False, f"the harness failed: {done.stderr.strip().splitlines()[-1:]}"
    return verdict["correct"], verdict["why"]


def _check(kernel, *flags) -> tuple[bool, str]:
    done, _ = _run([*CLI, "check", kernel.spec, "--seed", str(SEED), "--format", "json", *flags])
    if done is None:
        return False, "the check timed out"
    try:
        report = json.loads(done.stdout)
    except ValueError:
        return False, f"no report (exit {done.returncode}): {done.stderr.strip()[-200:]}"
    props = report["targets"][0]["properties"] if report["targets"] else []
    failed = [p["id"] for p in props if p["status"] not in ("pass", "skip")]
    return report["conforms"], ", ".join(failed[:3]) + (f" (+{len(failed) - 3})" if len(failed) > 3 else "")


def _submission(kernel, folder: Path) -> None:
    """The kernel as a grading submission: its file, with its function bound to the name the rubric grades."""
    source = kernel.file.read_text()
    if kernel.function != "attention":
        source += f"\n\nattention = {kernel.function}\n"
    (folder / f"{kernel.name}.py").write_text(source)


def grade_all(kernels) -> dict[str, tuple[bool, str, float]]:
    """One `attn-spec grade` run over all the kernels (its own zygote and judges): name -> (conforms, why, seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        subs, out = Path(tmp, "subs"), Path(tmp, "out")
        subs.mkdir()
        for k in kernels:
            _submission(k, subs)
        rubric = subprocess.run([*CLI, "grade", "--print-rubric"], capture_output=True, text=True, check=True).stdout
        rubric = re.sub(r"calls = \[.*?\]", "calls = []", rubric, flags=re.S)
        Path(tmp, "rubric.toml").write_text(rubric)
        done, _ = _run([*CLI, "grade", str(subs), "--out", str(out), "--rubric", str(Path(tmp, "rubric.toml")),
                        "--jobs", "2"])
        grades = json.loads(Path(out, "grades.json").read_text()) if done is not None else []
    rows = grades if isinstance(grades, list) else grades.get("grades", grades.get("submissions", []))
    result = {}
    for g in rows:
        failed = [p["id"] for p in g["properties"] if p["status"] not in ("pass", "skip", "n/a")
                  and p.get("convention") == "function"]
        full = g["outcome"] == "graded" and not failed
        why = g["outcome"] if g["outcome"] != "graded" else ", ".join(failed[:3])
        result[g["name"]] = (full, why, g.get("seconds", 0.0))
    return result


def judge(kernel, column: str) -> tuple[bool, str, float]:
    start = time.perf_counter()
    if column in ("kb-rand", "kb-randn"):
        ok, why = _harness(kernel, [PYTHON, str(HARNESSES / "kernelbench_style.py"), kernel.spec, column[3:]])
    elif column == "fib":
        ok, why = _harness(kernel, [PYTHON, str(HARNESSES / "flashinfer_bench_style.py"), kernel.spec])
    elif column == "default":
        ok, why = _check(kernel)
    elif column == "isolate":
        ok, why = _check(kernel, "--isolate")
    elif column == "thorough":
        ok, why = _check(kernel, "--profile", "thorough")
    else:
        raise ValueError(column)
    return ok, why, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--only", nargs="*", help="kernel names")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", metavar="FILE", help="also write the verdicts as JSON (after each column)")
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of earlier runs' JSON files "
                        "(columns split between runs) instead of running anything")
    args = parser.parse_args()
    kernels = [k for k in KERNELS if not args.only or k.name in args.only]
    verdicts: dict[tuple[str, str], tuple[bool, str, float]] = {}
    wall: dict[str, float] = {}
    if args.table:
        for path in args.table:
            saved = json.loads(Path(path).read_text())
            wall.update(saved.pop("_wall", {}))
            verdicts.update({tuple(key.split("|")): tuple(value) for key, value in saved.items()})
        columns = [c for c in COLUMNS if c in wall]
        for k in kernels:  # a thorough run of only the kernels the default check passed
            if "thorough" in wall and (k.name, "thorough") not in verdicts and not verdicts[(k.name, "default")][0]:
                verdicts[(k.name, "thorough")] = (False, "(default)", 0.0)
        show(kernels, columns, verdicts, wall)
        return
    columns = [c for c in args.columns.split(",") if c]
    for column in columns:
        start = time.perf_counter()
        todo = kernels
        if column == "thorough" and "default" in columns:
            todo = [k for k in kernels if verdicts[(k.name, "default")][0]]
            for k in kernels:
                if k not in todo:
                    verdicts[(k.name, column)] = (False, "(default)", 0.0)
        if column == "grade":
            graded = grade_all(kernels)
            for k in kernels:
                verdicts[(k.name, column)] = graded.get(k.name, (False, "not graded", 0.0))
        else:
            with ThreadPoolExecutor(args.jobs) as pool:
                for k, v in zip(todo, pool.map(lambda k: judge(k, column), todo)):
                    verdicts[(k.name, column)] = v
        wall[column] = time.perf_counter() - start
        print(f"[{column}: {wall[column]:.0f} s]", file=sys.stderr, flush=True)
        if args.json:  # after each column: a long run's figures survive it being stopped
            saved = {f"{n}|{c}": list(v) for (n, c), v in verdicts.items()}
            Path(args.json).write_text(json.dumps(dict(saved, _wall=wall), indent=1))
    show(kernels, columns, verdicts, wall)


def show(kernels, columns, verdicts, wall) -> None:
    """The table, then one line of counts per column."""
    def cell(k, c):
        ok, why, _ = verdicts[(k.name, c)]
        inherited = " (default)" if why == "(default)" else ""
        return "pass" if ok else ("CAUGHT" if k in ATTACKS else "FALSE ALARM") + inherited

    rows = [[k.name, "honest" if k in HONEST else k.seen] + [cell(k, c) for c in columns] for k in kernels]
    attacks = [k for k in kernels if k in ATTACKS]
    honest = [k for k in kernels if k in HONEST]
    rows.append(["caught", f"of {len(attacks)}"] + [sum(not verdicts[(k.name, c)][0] for k in attacks) for c in columns])
    rows.append(["false alarms", f"of {len(honest)}"] + [sum(not verdicts[(k.name, c)][0] for k in honest)
                                                       for c in columns])
    rows.append(["seconds", "wall"] + [round(wall[c]) for c in columns])
    print(tabulate(rows, headers=["kernel", "expected"] + columns, tablefmt="github"))
    for c in columns:
        caught = sum(not verdicts[(k.name, c)][0] for k in attacks)
        alarms = sum(not verdicts[(k.name, c)][0] for k in honest)
        print(f"{c}: caught {caught} of {len(attacks)}, {alarms} of {len(honest)} honest failed, {wall[c]:.0f} s")


if __name__ == "__main__":
    main()
