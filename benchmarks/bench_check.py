"""Wall time of ``attn-spec check``: one conforming target per profile, and the whole gallery.

    python benchmarks/bench_check.py

Each figure is the median of --repeat runs of a fresh ``attn-spec check`` process (so it
includes importing torch), beside the time of ``python -c "import torch"`` on this machine.
The gallery figure checks every gallery entry (correct and buggy) in one process.
"""
import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
SEED_TARGET = f"{ROOT / 'examples' / 'seed_attention.py'}:attention"
GALLERY_SCRIPT = f"""
import sys, time
sys.path.insert(0, {str(ROOT / 'tests')!r})
import attn_spec
from gallery import BUGGY, CORRECT
start = time.perf_counter()
for entry in CORRECT + BUGGY:
    attn_spec.check(entry.obj, name=entry.name, convention=entry.convention, profile=sys.argv[1], seed=1)
print(len(CORRECT + BUGGY), time.perf_counter() - start)
"""


def timed(cmd) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=os.environ)
    return time.perf_counter() - start


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--profiles", nargs="+", default=["quick", "default", "thorough"])
    args = parser.parse_args()
    py = sys.executable
    torch_s = statistics.median(timed([py, "-c", "import torch"]) for _ in range(args.repeat))
    rows = [["python -c 'import torch'", "", f"{torch_s:.2f}", "1.00"]]
    for profile in args.profiles:
        cmd = [py, "-m", "attn_spec", "check", SEED_TARGET, "--profile", profile, "--seed", "1"]
        s = statistics.median(timed(cmd) for _ in range(args.repeat))
        rows.append(["check seed attention (function)", profile, f"{s:.2f}", f"{s / torch_s:.2f}"])
    for profile in ("quick", "default"):
        start = time.perf_counter()
        out = subprocess.run([py, "-c", GALLERY_SCRIPT, profile], cwd=ROOT, capture_output=True, text=True)
        total = time.perf_counter() - start
        n = out.stdout.split()[0] if out.stdout else "?"
        rows.append([f"check the whole gallery ({n} targets, one process)", profile, f"{total:.2f}",
                     f"{total / torch_s:.2f}"])
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}")
    print(tabulate(rows, headers=["what", "profile", "wall s", "x import torch"]))


if __name__ == "__main__":
    main()
