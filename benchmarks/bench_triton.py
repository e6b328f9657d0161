"""A check of a Triton kernel, timed: examples/triton_attention.py's flash-style forward.

    python benchmarks/bench_triton.py                  # the quick profile; on a GPU natively, else the interpreter
    python benchmarks/bench_triton.py --profile default --only matches-reference

On a machine without a CUDA device the kit runs the kernel under Triton's interpreter (TRITON_INTERPRET=1), each
call in a forked child (attn_spec.targets.interpreter); on a GPU it runs compiled, in the kit's process. Prints the
verdict line, the header's runtime note, the calls the target got and the seconds (wall and CPU) the check took.
"""
from __future__ import annotations

import argparse
import collections
import importlib.metadata
import os
import time
from pathlib import Path

import torch

from attn_spec import api

KERNEL = Path(__file__).resolve().parents[1] / "examples" / "triton_attention.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--only", nargs="*", default=None, help="property ids (default: the whole catalog)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wall, cpu = time.perf_counter(), time.process_time()
    report = api.check(f"{KERNEL}:attention", profile=args.profile, only=args.only, devices=[device])
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    (target,) = report.targets
    print(f"device: {device}; TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET') or '(unset)'}; triton "
          f"{importlib.metadata.version('triton')}")
    print(f"verdict: {target.verdict}")
    for note in target.notes:
        if note.startswith(("runtime:", "bfloat16:")):
            print(note[:160] + ("…" if len(note) > 160 else ""))
    counts = collections.Counter(getattr(r.status, "value", r.status) for r in target.properties)
    print(f"profile {args.profile}: {len(target.properties)} properties ({dict(counts)}), {target.calls} calls, "
          f"{wall:.1f} s wall, {cpu:.1f} s CPU in the kit's process ({wall / max(target.calls, 1):.3f} s a call)")


if __name__ == "__main__":
    main()
