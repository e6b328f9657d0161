"""A FlashInfer-Bench-style correctness check (bench/evaluators/default.py, as the kit's anchors describe it;
no code copied): the solution runs in a worker process; a few trials of random inputs at a handful of traced
workload shapes (ragged lengths, a decode step, causal prefill); the output's shape and dtype are checked, then
non-finite values, then every element within atol + rtol * |ref| (1e-2 each) of the reference, computed in the
evaluator's process.

    python flashinfer_bench_style.py path/to/file.py:attention   -> prints one JSON line
"""
import json
import math
import subprocess
import sys
import tempfile

import torch

# (B, H, NQ, NKV, D, causal): traced shapes of a serving workload, float32 on a CPU
SHAPES = ((1, 8, 128, 128, 64, True), (2, 4, 77, 77, 64, True), (1, 8, 1, 513, 128, False),
          (1, 4, 300, 300, 128, False), (1, 2, 1000, 1000, 64, True))
TRIALS, ATOL, RTOL = 3, 1e-2, 1e-2

WORKER = """
import importlib.util, sys, torch
path, name, inputs, outputs = sys.argv[1:]
spec = importlib.util.spec_from_file_location("solution", path)
module = sys.modules["solution"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
fn = getattr(module, name)
results = []
for q, k, v, mask in torch.load(inputs):
    try:
        results.append(fn(q, k, v, mask).detach().clone().as_subclass(torch.Tensor))  # values as its checks read them
    except Exception as exc:
        results.append(f"{type(exc).__name__}: {exc}"[:200])
torch.save(results, outputs)
"""


def workload():
    cases = []
    for i, (b, h, nq, nkv, d, causal) in enumerate(SHAPES):
        for trial in range(TRIALS):
            g = torch.Generator().manual_seed(1000 * i + trial)
            q, k, v = (torch.randn(b, h, n, d, generator=g) for n in (nq, nkv, nkv))
            mask = torch.ones(nq, nkv, dtype=torch.bool).tril(nkv - nq) if causal else None
            cases.append((q, k, v, mask))
    return cases


def reference(q, k, v, mask):
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v.double()).float()


def judge(spec: str) -> dict:
    path, _, name = spec.rpartition(":")
    cases = workload()
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(cases, f"{tmp}/inputs.pt")
        worker = f"{tmp}/flashinfer_bench_worker.py"  # the worker's own code, as a solution running there sees it
        with open(worker, "w") as fh:
            fh.write(WORKER)
        done = subprocess.run([sys.executable, worker, path, name, f"{tmp}/inputs.pt", f"{tmp}/outputs.pt"],
                              capture_output=True, text=True, timeout=600)
        if done.returncode:
            return {"correct": False, "why": f"the worker failed: {done.stderr.strip().splitlines()[-1:]}"}
        outputs = torch.load(f"{tmp}/outputs.pt")
    for i, ((q, k, v, mask), out) in enumerate(zip(cases, outputs)):
        where = f"shape {SHAPES[i // TRIALS][:5]} trial {i % TRIALS}"
        ref = reference(q, k, v, mask)
        if isinstance(out, str):
            return {"correct": False, "why": f"{where}: raised {out}"}
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return {"correct": False, "why": f"{where}: {tuple(out.shape)} {out.dtype}"}
        if not torch.isfinite(out).all():
            return {"correct": False, "why": f"{where}: non-finite values"}
        if ((out - ref).abs() > ATOL + RTOL * ref.abs()).any():
            return {"correct": False, "why": f"{where}: max error {float((out - ref).abs().max()):.3g}"}
    return {"correct": True, "why": f"{len(cases)} trials at {len(SHAPES)} shapes"}


if __name__ == "__main__":
    print(json.dumps(judge(sys.argv[1])))
