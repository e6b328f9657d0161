"""How fast is attn-spec, and how quickly does it find bugs? One command, one table.

    python benchmarks/bench.py [--repeat 3] [--only check overhead bugs diagnosis grade] [--markdown]
    python benchmarks/bench.py --markdown > benchmarks/results.md && python benchmarks/update_docs.py  # README, docs/

Sections (each figure is measured in this run, on this machine):
- check: wall time and peak memory of a fresh ``attn-spec check`` process on the seed attention,
  per profile, as a multiple of ``python -c "import torch"`` (median of --repeat runs);
- overhead: in one warm process, the share of a default-profile check spent outside the
  target's own calls, and where it goes (Hypothesis, the kit's judging, the target);
- bugs: over the gallery (tests/gallery), at the quick profile with --exitfirst: target calls until
  the first failure and seconds to a shrunk counterexample, per buggy entry; false alarms on the
  correct ones;
- diagnosis: over the gallery's bugs, the whole catalog at the quick profile, one intra-op thread:
  roots per bug by the catalog's fixed order (before) and by the diagnosis (after), how many roots
  name the entry's own mistake, and the time the diagnosis adds to a failing check and to a passing one;
- grade: ``attn-spec grade`` on classes of 30 correct and 30 mixed submissions (tests/submissions)
  with --jobs 1 and 2, and the steady-state cost of a correct submission against its evaluation
  time (the same properties checked in-process);
- spread: the default-profile check of the seed attention over 20 seeds (p50, p90, worst);
- selftest: README's test command (``python -m pytest``), wall and CPU time;
- ladder: a check of SDPA at each rung of the scale ladder (``bench_scale.py``: time, peak memory,
  the kit's share of both, the largest length that fits); ``--ladder-lengths`` picks rungs.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import runpy
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from bench_scale import SDPA, ladder_rows, measure_rows
from bench_startup import SEED_TARGET, TARGET_P90, check_runs, p90, run

ROOT = Path(__file__).resolve().parents[1]
SUBMISSIONS = ROOT / "tests" / "submissions"
CORRECT_SUBS = ["correct_seed.py", "correct_float64.py", "correct_einsum_mha.py"]
MIXED_SUBS = CORRECT_SUBS + ["buggy_no_scale.py", "buggy_softmax_dim.py", "buggy_heads_view.py", "returns_nan.py",
                             "syntax_error.py", "missing_import.py", "exits.py", "segfault.py", "returns_list.py",
                             "lying_subclass.py", "memory_hog.py", "forbidden_sdpa.py", "patches_kit.py"]
HANGS = "loop_in_function.py"  # one per mixed class: it costs the rubric's call_seconds


def median_run(cmd, repeat: int) -> tuple[float, float, int]:
    runs = [run(cmd) for _ in range(repeat)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs), max(r[2] for r in runs)


# ------------------------------------------------------------------------------ check


def bench_check(rows, repeat: int, torch_s: float) -> None:
    for profile, limit in (("quick", 2), ("default", 5), ("thorough", None)):
        wall, _, mb = median_run([sys.executable, "-m", "attn_spec", "check", SEED_TARGET, "--profile", profile,
                                  "--seed", "1"], repeat if profile != "thorough" else 1)
        rows.append([f"check seed attention, {profile}", f"{wall:.2f} s, {mb} MB peak",
                     f"{wall / torch_s:.2f}x import torch", f"<= {limit}x" if limit else "",
                     _met(wall / torch_s <= limit) if limit else ""])


def bench_spread(rows, torch_s: float, seeds: int) -> None:
    """The default profile's time over many seeds: each seed draws other cases, some larger (bench_startup.py
    measures it in CPU time too)."""
    walls = sorted(wall for wall, _, _ in check_runs(seeds))
    p50, worst = statistics.median(walls), walls[-1]
    rows.append([f"check seed attention, default, {seeds} seeds", f"p90 {p90(walls):.2f} s ({p90(walls) / torch_s:.2f}x)",
                 f"p50 {p50:.2f} s ({p50 / torch_s:.2f}x), worst {worst:.2f} s ({worst / torch_s:.2f}x) "
                 f"import torch", f"p90 <= {TARGET_P90:g}x", _met(p90(walls) / torch_s <= TARGET_P90)])


def bench_selftest(rows) -> None:
    """README's test command, as CI runs it."""
    wall, cpu, mb = run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly"])
    rows.append(["self-test (python -m pytest)", f"{wall:.0f} s", f"{cpu:.0f} s of CPU on {os.cpu_count()} cores, "
                 f"{mb} MB peak (largest process)", "< 180 s", _met(wall < 180)])


# ------------------------------------------------------------------------------ overhead


def bench_overhead(rows) -> None:
    """In-process: the check's time, the target's own time, and the check with no-op properties."""
    import attn_spec
    from attn_spec.properties import catalog

    sys.path.insert(0, str(ROOT / "examples"))
    from seed_attention import attention

    inside = [0.0]

    @functools.wraps(attention)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return attention(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - start

    attn_spec.check(timed, profile="quick", seed=2)  # warm: first calls of every kernel and strategy
    inside[0] = 0.0
    start = time.perf_counter()
    report = attn_spec.check(timed, profile="default", seed=1)
    total = time.perf_counter() - start
    calls = report.targets[0].calls
    real = {pid: p.fn for pid, p in catalog().items()}
    for p in catalog().values():
        object.__setattr__(p, "fn", lambda target, case: None)  # Hypothesis alone: draw, run nothing
    try:
        start = time.perf_counter()
        attn_spec.check(timed, profile="default", seed=1)
        engine = time.perf_counter() - start
    finally:
        for pid, p in catalog().items():
            object.__setattr__(p, "fn", real[pid])
    share = 1 - inside[0] / total
    rows.append(["kit overhead, default profile (in-process)", f"{share:.0%} of {total:.2f} s",
                 f"target {inside[0]:.2f} s in {calls} calls ({inside[0] / calls * 1e3:.2f} ms each); "
                 f"Hypothesis {engine:.2f} s; judging {total - engine - inside[0]:.2f} s", "< 50%", _met(share < 0.5)])


# ------------------------------------------------------------------------------ bugs


def bench_bugs(rows) -> None:
    import attn_spec

    sys.path.insert(0, str(ROOT / "tests"))
    from gallery import BUGGY, CORRECT

    calls, seconds, missed = [], [], []
    for entry in BUGGY:
        start = time.perf_counter()
        report = attn_spec.check(entry.obj, name=entry.name, convention=entry.convention, profile="quick", seed=1,
                                 exitfirst=True, masks=entry.masks, **entry.options)
        elapsed = time.perf_counter() - start
        found = [p.found_after_calls for p in report.targets[0].properties if p.found_after_calls is not None]
        if report.conforms or not found:
            missed.append(entry.name)
            continue
        calls.append(min(found))
        seconds.append(elapsed)
    false_alarms = [e.name for e in CORRECT if not attn_spec.check(e.obj, name=e.name, convention=e.convention,
                                                                   profile="quick", seed=1, **e.options).conforms]
    rows.append(["gallery bugs found (quick profile)", f"{len(calls)} of {len(BUGGY)}",
                 f"missed: {', '.join(missed) or 'none'}; false alarms on {len(CORRECT)} correct: "
                 f"{len(false_alarms)}", "all", _met(not missed and not false_alarms)])
    worst = BUGGY[[i for i, e in enumerate(BUGGY) if e.name not in missed][calls.index(max(calls))]].name
    rows.append(["target calls to the first failure", f"median {statistics.median(calls):g}, worst {max(calls)}",
                 f"worst: {worst}; up to the call that failed (the calls a cause makes to explain it are not counted)",
                 "median <= 3", _met(statistics.median(calls) <= 3)])
    rows.append(["seconds to a shrunk counterexample (-x)",
                 f"median {statistics.median(seconds):.2f}, worst {max(seconds):.2f}", "in-process, warm", "", ""])


# ------------------------------------------------------------------------------ diagnosis


def bench_diagnosis(rows) -> None:
    """Roots per bug before (catalog order) and after (diagnosis), accuracy, and the time it adds."""
    import torch

    import attn_spec
    from attn_spec.properties import catalog

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "examples"))
    from gallery import BUGGY
    from seed_attention import attention

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the check's own softmax on tiny tensors costs milliseconds in a busy thread pool
    try:
        before, after, named, checking, diagnosing = [], [], [], 0.0, 0.0
        for entry in BUGGY:
            start = time.perf_counter()
            target = attn_spec.check(entry.obj, name=entry.name, convention=entry.convention, profile="quick",
                                     seed=1, masks=entry.masks, **entry.options).targets[0]
            total = time.perf_counter() - start
            failed = {p.id for p in target.properties if p.status == "fail"}
            if entry.diagnosis:  # a FlexAttention mod: nothing to replay; each failure's cause must name the bug
                causes = {p.id: p.cause for p in target.properties}
                named.append(all(entry.diagnosis in causes[pid] for pid in entry.catches))
            else:
                before.append(sum(not set(catalog()[pid].after) & failed for pid in failed))
                after.append(len(target.diagnoses))
                named.append(len(target.diagnoses) == 1 and target.diagnoses[0].mistake == entry.mistake
                             and not target.diagnoses[0].guess)
            checking += total - target.diagnosis_seconds
            diagnosing += target.diagnosis_seconds
        start = time.perf_counter()
        passing = attn_spec.check(attention, profile="quick", seed=1).targets[0]
        passing_total = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    rows.append(["roots per gallery bug (whole catalog, quick)",
                 f"before: median {statistics.median(before):g}, max {max(before)}, exactly one for "
                 f"{before.count(1)} of {len(before)}; after: median {statistics.median(after):g}, max {max(after)}, "
                 f"exactly one for {after.count(1)}", "before = failures not blocked by the catalog's fixed order; "
                 f"the {len(BUGGY) - len(after)} FlexAttention mods have no calls to replay (their causes are judged)",
                 "one each", _met(after.count(1) == len(after))])
    rows.append(["diagnosis accuracy", f"{sum(named)} of {len(named)}",
                 "one root, naming the entry's declared mistake (not a guess); a mod: every failure's cause names "
                 "its bug; tests/test_gallery.py's UNDIAGNOSED lists the known misses", "all", _met(all(named))])
    share = diagnosing / checking
    rows.append(["time diagnosis adds to a failing check", f"{share:.0%} ({diagnosing:.1f} s on {checking:.1f} s)",
                 f"summed over the {len(BUGGY)} gallery bugs, one thread", "< 20%", _met(share < 0.2)])
    rows.append(["time diagnosis adds to a passing check", f"{passing.diagnosis_seconds:.2f} s on {passing_total:.2f} s",
                 "seed attention, quick: nothing failed, nothing is replayed", "none",
                 _met(passing.diagnosis_seconds == 0 and not passing.diagnoses)])


# ------------------------------------------------------------------------------ grade


def make_class(folder: Path, files: list[str], n: int, with_hang: bool = False) -> Path:
    folder.mkdir(parents=True)
    chosen = [files[i % len(files)] for i in range(n - with_hang)] + ([HANGS] if with_hang else [])
    for i, name in enumerate(chosen):
        shutil.copy(SUBMISSIONS / name, folder / f"student{i:02d}.py")
    return folder


def evaluation_seconds() -> float:
    """Mean in-process time to check one correct submission as the default rubric grades it (warm)."""
    import torch

    import attn_spec
    from attn_spec.grading.rubric import load

    rubric = load(None)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the grader judges
    times = []
    for name in CORRECT_SUBS:
        module = runpy.run_path(str(SUBMISSIONS / name))  # what the grader grades: the function, and the module if any
        objs = [module[attr] for attr in ("attention", "MultiHeadAttention") if attr in module]
        kwargs = dict(profile=rubric.profile, seed=rubric.seed, dtypes=list(rubric.dtypes), devices=list(rubric.devices))
        attn_spec.check(*objs, **kwargs)  # warm
        runs = []
        for _ in range(3):  # the median of three: single runs vary by 20% on a shared machine
            start = time.perf_counter()
            attn_spec.check(*objs, **kwargs)
            runs.append(time.perf_counter() - start)
        times.append(statistics.median(runs))
    torch.set_num_threads(threads)
    return statistics.mean(times)


def bench_grade(rows, n: int) -> None:
    def grade(folder, jobs):
        return run([sys.executable, "-m", "attn_spec", "grade", folder, "--out", f"{folder}-out-{jobs}",
                    "--jobs", str(jobs)])

    with tempfile.TemporaryDirectory(prefix="bench-grade-") as tmp:
        tmp = Path(tmp)
        one = grade(make_class(tmp / "one", CORRECT_SUBS[:1], 1), 1)[0]
        correct = make_class(tmp / "correct", CORRECT_SUBS, n)
        mixed = make_class(tmp / "mixed", MIXED_SUBS, n, with_hang=True)
        walls = {}
        for jobs in (1, 2):
            walls[jobs], cpu, _ = grade(correct, jobs)
            mixed_wall = grade(mixed, jobs)[0]
            rows.append([f"grade {n} correct / {n} mixed, --jobs {jobs}",
                         f"{walls[jobs]:.1f} s / {mixed_wall:.1f} s",
                         f"{walls[jobs] / n:.2f} / {mixed_wall / n:.2f} s per submission, start-up included; "
                         f"{cpu / walls[jobs]:.2f} cores busy grading the correct class",
                         f"{n} correct < 60 s" if jobs == 2 else "", _met(walls[jobs] < 60) if jobs == 2 else ""])
        graded = json.loads((tmp / "correct-out-1" / "grades.json").read_text())["submissions"]
        steady = statistics.mean(g["seconds"] for g in graded)  # fork, load, every check, teardown
        judged = statistics.mean(sum(p["seconds"] for p in g["properties"]) for g in graded)  # the checks alone
    evaluation = evaluation_seconds()
    rows.append(["grading a correct submission, steady state", f"{steady:.2f} s ({steady / evaluation:.2f}x)",
                 f"mean per submission at --jobs 1 (grades.json), against {evaluation:.2f} s to check the same "
                 f"code in-process; its checks through the sandbox take {judged:.2f} s, so fork, import and "
                 f"teardown cost {steady - judged:.2f} s; start-up {one - steady:.1f} s once per run; --jobs 2 "
                 f"speed-up {walls[1] / walls[2]:.2f}x", "< 1.5x", _met(steady / evaluation < 1.5)])


def _met(ok: bool) -> str:
    return "yes" if ok else "NO"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3, help="runs per check figure (median; default 3)")
    sections = ("check", "spread", "overhead", "bugs", "diagnosis", "grade", "selftest", "ladder")
    parser.add_argument("--only", nargs="+", choices=sections, default=list(sections))
    parser.add_argument("--seeds", type=int, default=20, help="seeds of the spread section (default 20)")
    parser.add_argument("--ladder-lengths", type=int, nargs="*", default=[],
                        help="rungs of the ladder section (default: every CPU rung, 1024, 4096, 16384)")
    parser.add_argument("--n", type=int, default=30, help="submissions per graded class (default 30)")
    parser.add_argument("--markdown", action="store_true",
                        help="the Performance table as markdown, for README: save it as benchmarks/results.md, then "
                             "run benchmarks/update_docs.py")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    torch_s, _, torch_mb = median_run([sys.executable, "-c", "import torch"], args.repeat)
    rows = [['python -c "import torch"', f"{torch_s:.2f} s, {torch_mb} MB peak", "the unit of the ratios", "", ""]]
    for section in args.only:
        {"check": lambda: bench_check(rows, args.repeat, torch_s), "overhead": lambda: bench_overhead(rows),
         "bugs": lambda: bench_bugs(rows), "diagnosis": lambda: bench_diagnosis(rows),
         "grade": lambda: bench_grade(rows, args.n),
         "spread": lambda: bench_spread(rows, torch_s, args.seeds), "selftest": lambda: bench_selftest(rows),
         "ladder": lambda: rows.extend(measure_rows(ladder_rows(SDPA, "cpu", args.ladder_lengths, [], [], 3600)))
         }[section]()
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    # The first line of benchmarks/results.md: the docs may quote it (benchmarks/update_docs.py).
    print(f"measured {datetime.date.today().isoformat()} on {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}, {gpu}; "
          f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after\n")
    print(tabulate(rows, headers=["measure", "figure", "detail", "target", "met"],
                   tablefmt="github" if args.markdown else "simple"))


if __name__ == "__main__":
    main()
