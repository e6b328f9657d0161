"""A check of a Triton kernel, timed: examples/triton_attention.py's flash-style forward.

    python benchmarks/bench_triton.py                  # the quick profile; on a GPU natively, else the interpreter
    python benchmarks/bench_triton.py --profile default --only matches-reference

On a machine without a CUDA device the kit runs the kernel under Triton's interpreter (TRITON_INTERPRET=1), each
call in a forked child (attn_spec.targets.interpreter); on a GPU it runs compiled, in the kit's process. Prints the
verdict line, the header's runtime note, the calls the target got and the seconds (wall and CPU) the check took,
with the seconds of one call on a small case (1 x 2 x 64 x 64) beside it.
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from attn_spec import api

KERNEL = Path(__file__).resolve().parents[1] / "examples" / "triton_attention.py"


def one_call_seconds(target, device: str, repeat: int = 3) -> float:
    """The median seconds of one call of the checked target on Q, K, V [1, 2, 64, 64] (float32)."""
    q, k, v = (torch.randn(1, 2, 64, 64, device=device) for _ in range(3))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        target.attend(q, k, v)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--only", nargs="*", default=None, help="property ids (default: the whole catalog)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wall, cpu = time.perf_counter(), time.process_time()
    report = api.check(f"{KERNEL}:attention", profile=args.profile, only=args.only, devices=[device])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    (target_report,) = report.targets
    print(f"device: {device}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '(unset)')}; triton "
          f"{__import__('triton').__version__}")
    for note in target_report.notes:
        if note.startswith(("runtime:", "bfloat16:")):
            print(note)
    counts = {}
    for result in target_report.properties:
        counts[result.status] = counts.get(result.status, 0) + 1
    print(f"verdict: {report.verdict_line() if hasattr(report, 'verdict_line') else counts}")
    print(f"profile {args.profile}: {len(target_report.properties)} properties {counts}, {target_report.calls} calls, "
          f"{wall:.1f} s wall, {cpu:.1f} s CPU in the kit's process")


if __name__ == "__main__":
    main()
