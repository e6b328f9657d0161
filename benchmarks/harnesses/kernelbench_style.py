"""A KernelBench-style correctness check (src/kernelbench/eval.py, as the kit's anchors describe it; no code
copied): the candidate is imported into the harness's own process, then a handful of trials at one fixed
shape, each with fresh inputs from ``torch.rand`` (as its attention problem ships) or ``torch.randn``, and
``torch.allclose(out, ref, atol=1e-2, rtol=1e-2)`` against torch's SDPA after a shape check.

    python kernelbench_style.py path/to/file.py:attention rand|randn   -> prints one JSON line
"""
import importlib.util
import json
import sys

import torch
import torch.nn.functional as F

SHAPE = (2, 8, 128, 64)  # B, H, N, D: KernelBench's SDPA problem (32, 32, 512, 1024) scaled down for a CPU
TRIALS, ATOL, RTOL = 5, 1e-2, 1e-2


def load(spec: str):
    path, _, name = spec.rpartition(":")
    module_spec = importlib.util.spec_from_file_location("candidate", path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules["candidate"] = module
    module_spec.loader.exec_module(module)  # in this process: whatever it does at import, it does here
    return getattr(module, name)


def judge(spec: str, draw: str) -> dict:
    candidate = load(spec)
    make = torch.rand if draw == "rand" else torch.randn
    for trial in range(TRIALS):
        torch.manual_seed(42 + trial)
        q, k, v = (make(*SHAPE) for _ in range(3))
        ref = F.scaled_dot_product_attention(q, k, v)
        try:
            out = candidate(q.clone(), k.clone(), v.clone())
        except Exception as exc:  # noqa: BLE001 - a runtime error is an incorrect kernel
            return {"correct": False, "why": f"trial {trial}: raised {type(exc).__name__}"}
        if out.shape != ref.shape:
            return {"correct": False, "why": f"trial {trial}: shape {tuple(out.shape)}"}
        if not torch.allclose(out, ref, atol=ATOL, rtol=RTOL):
            return {"correct": False, "why": f"trial {trial}: max error {float((out - ref).abs().max()):.3g}"}
    return {"correct": True, "why": f"{TRIALS} trials at {SHAPE}"}


if __name__ == "__main__":
    print(json.dumps(judge(sys.argv[1], sys.argv[2])))
