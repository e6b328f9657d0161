"""How long does a default ``attn-spec check`` of a conforming function take, against ``import torch``? (#38 item 7)

    python benchmarks/bench_startup.py [--seeds 20] [--profile default] [--repeat 5]

Runs ``python -m attn_spec check examples/seed_attention.py:attention --seed S`` once per seed (each seed draws
other cases, some larger) and ``python -c "import torch"`` --repeat times, each in a fresh process, and prints
the check's time divided by the median ``import torch``: the median and the 90th percentile over the seeds
(the 18th of 20, sorted), in CPU time (user + sys of the child and all it waited for, from os.wait4) and in wall
time. On a machine shared with other work, wall time stretches with the load and CPU time much less: the CPU
ratio is the figure to judge (target: p90 <= 2x), the wall ratio is the one a user feels on an idle machine.
Both processes run with the environment this one has (set OMP_NUM_THREADS to measure what one thread costs),
less PYTHONDONTWRITEBYTECODE: an installed kit has its bytecode compiled (pip does it), so one check runs first,
unmeasured, to write it for a source checkout too.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED_TARGET = f"{ROOT / 'examples' / 'seed_attention.py'}:attention"
TARGET_P90 = 2.0  # the default check's p90 over 20 seeds, in units of import torch (#38 item 7)


def run(cmd) -> tuple[float, float, int]:
    """(wall s, CPU s, peak RSS MB) of one process and all it waited for."""
    start = time.perf_counter()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) not in (0, 1):
        sys.exit(f"failed: {' '.join(map(str, cmd))}\n{proc.stderr.read().decode()[-2000:]}")
    proc.stderr.close()
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss // 1024


def p90(values: list[float]) -> float:
    """The 90th percentile as the benchmarks read it: the 18th of 20 sorted values."""
    ordered = sorted(values)
    return ordered[max(0, round(0.9 * len(ordered)) - 1)]


def check_runs(seeds: int, profile: str = "default") -> list[tuple[float, float, int]]:
    """(wall, CPU, MB) of one fresh ``attn-spec check`` of the seed attention per seed 0 .. seeds - 1."""
    return [run([sys.executable, "-m", "attn_spec", "check", SEED_TARGET, "--profile", profile, "--seed", str(s)])
            for s in range(seeds)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=20, help="checks, one per seed (default 20)")
    parser.add_argument("--profile", default="default", help="the check's profile (default: default)")
    parser.add_argument("--repeat", type=int, default=5, help="runs of import torch, the unit (median; default 5)")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    check_runs(1, args.profile)  # writes the kit's bytecode, warms the disk cache
    torch_runs = [run([sys.executable, "-c", "import torch"]) for _ in range(args.repeat)]
    checks = check_runs(args.seeds, args.profile)
    torch_runs += [run([sys.executable, "-c", "import torch"]) for _ in range(args.repeat)]  # before and after
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; load average "
          f"{load:.1f} before, {os.getloadavg()[0]:.1f} after; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}")
    for i, what in ((1, "CPU "), (0, "wall")):
        unit = statistics.median(r[i] for r in torch_runs)
        times = [r[i] for r in checks]
        ratio = p90(times) / unit
        print(f"{what}: import torch {unit:.2f} s; {args.profile} check over {args.seeds} seeds: median "
              f"{statistics.median(times):.2f} s ({statistics.median(times) / unit:.2f}x), p90 {p90(times):.2f} s "
              f"({ratio:.2f}x), worst {max(times):.2f} s ({max(times) / unit:.2f}x)"
              + (f"; target p90 <= {TARGET_P90}x: {'met' if ratio <= TARGET_P90 else 'NOT met'}" if i else ""))
    print(f"peak memory: import torch {max(r[2] for r in torch_runs)} MB, check {max(r[2] for r in checks)} MB")


if __name__ == "__main__":
    main()
