"""Where the self-test's time goes, in CPU seconds per test (#38 item 8).

    python benchmarks/bench_selftest.py [PYTEST ARGS ...]          # e.g. tests/test_varlen.py -n 2
    python benchmarks/bench_selftest.py --top 40 -- -m "not slow"

Runs ``python -m pytest`` with a plugin (this file) that records, around each test (setup, call and teardown),
the CPU time of its worker process (all its threads) and of the children it waited for (the CLI, the grader, a
forked call), then prints the CPU seconds summed over the tests, per file and the costliest tests. On a machine
shared with other work, wall time stretches with the load and CPU time much less: compare these sums before and
after a change. A module fixture's cost lands on the first test that uses it.
"""
from __future__ import annotations

import argparse
import collections
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The plugin: one line per test, ``nodeid, own CPU s, children's CPU s, wall s``, in this worker's file."""
    own, children = _cpu()
    start = time.perf_counter()
    yield
    own_after, children_after = _cpu()
    out = Path(os.environ["ATTN_SPEC_BENCH_CPU"]) / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.tsv"
    with out.open("a", encoding="utf-8") as fh:
        fh.write(f"{item.nodeid}\t{own_after - own:.3f}\t{children_after - children:.3f}\t"
                 f"{time.perf_counter() - start:.3f}\n")


def summary(folder: Path, top: int) -> None:
    rows = [line.split("\t") for f in sorted(folder.glob("*.tsv")) for line in f.read_text().splitlines()]
    tests = [(name, float(own) + float(kids), float(own), float(kids), float(wall)) for name, own, kids, wall in rows]
    per_file = collections.Counter()
    for name, cpu, *_ in tests:
        per_file[name.split("::")[0]] += cpu
    total = sum(t[1] for t in tests)
    print(f"{len(tests)} tests: {total:.0f} CPU s ({sum(t[2] for t in tests):.0f} in the test processes, "
          f"{sum(t[3] for t in tests):.0f} in the children they waited for); {sum(t[4] for t in tests):.0f} s of "
          f"wall summed over the tests")
    print("\nper file (CPU s):")
    for name, cpu in per_file.most_common(top):
        print(f"{cpu:8.1f}  {100 * cpu / total:4.1f}%  {name}")
    print(f"\nthe {top} costliest tests (CPU s: all = own + children; wall s):")
    for name, cpu, own, kids, wall in sorted(tests, key=lambda t: -t[1])[:top]:
        print(f"{cpu:8.1f} = {own:6.1f} + {kids:6.1f}  {wall:7.1f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=30, help="files and tests listed (default 30)")
    args, pytest_args = parser.parse_known_args()
    pytest_args = [a for a in pytest_args if a != "--"]
    with tempfile.TemporaryDirectory(prefix="attn-spec-bench-cpu-") as folder:
        env = {**os.environ, "ATTN_SPEC_BENCH_CPU": folder,
               "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))}
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "bench_selftest", *pytest_args], cwd=ROOT,
                              env=env)
        wall = time.perf_counter() - start
        print(f"\npytest exited {done.returncode} after {wall:.0f} s of wall; load average now "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n")
        summary(Path(folder), args.top)


if __name__ == "__main__":
    main()
