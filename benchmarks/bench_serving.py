"""The serving properties at the sizes serving kernels run: decode over long caches (32k to 128k cached tokens on a
GPU), merges of many rows, packed batches of 64 sequences. Each kernel present is checked on fixed cases, one property at a time, and timed.

    python benchmarks/bench_serving.py            # on a GPU: flash-attn (if installed) and the examples, real sizes
    python benchmarks/bench_serving.py --tiny     # anywhere: the CPU examples at tiny sizes (what CI runs)

Kernels: flash_attn.flash_attn_with_kvcache and flash_attn_varlen_func (GPU only, when installed), FlashInfer's
merge_state (GPU only, when installed), torch's varlen_attn (GPU only), and examples/serving_kernels.py's kernels. Prints one row per (kernel, property,
size): pass or the failure's first line, and the seconds it took.
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path

import torch
from attn_spec.checking.cases import Case
from attn_spec.properties import catalog
from attn_spec.errors import Failure, Unsupported
from attn_spec.targets.conventions import make_target
from attn_spec.targets.loading import load_target

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "serving_kernels.py"


def kernels(device: str) -> list:
    """(name, target) for every kernel present on ``device``."""
    found = [(name, make_target(load_target(f"{KERNELS}:{name}"), name))
             for name in ("decode_kernel", "sdpa_decode", "merge_state", "merge_state_base2", "varlen_kernel",
                          "nested_sdpa_varlen")]
    if device == "cuda":
        from torch.nn.attention.varlen import varlen_attn

        found.append(("varlen_attn", make_target(varlen_attn, "varlen_attn")))
    if device == "cuda" and importlib.util.find_spec("flash_attn"):
        from flash_attn import flash_attn_with_kvcache

        from flash_attn import flash_attn_varlen_func

        found.append(("flash_attn_with_kvcache", make_target(flash_attn_with_kvcache, "flash_attn_with_kvcache")))
        found.append(("flash_attn_varlen_func", make_target(flash_attn_varlen_func, "flash_attn_varlen_func")))
    if device == "cuda" and importlib.util.find_spec("flashinfer"):
        from flashinfer import merge_state

        found.append(("flashinfer.merge_state", make_target(merge_state, "flashinfer.merge_state", "merge")))
    return found


def cases(tiny: bool, device: str, dtype: str, convention: str) -> list[Case]:
    """Decode: B sequences of up to n_kv cached tokens, one new token each (B, H = batch); merge: n_q rows;
    varlen: a packed batch of 4 (tiny) or 64 sequences of up to 16 or 2048 tokens (H heads = batch), n_q and n_kv
    drawn apart, some 0."""
    if convention == "varlen":
        gen = torch.Generator().manual_seed(0)
        n, most, heads, d = (4, 16, 2, 64) if tiny else (64, 2048, 8, 128)
        segments = tuple(tuple(int(x) for x in pair) for pair in torch.randint(0, most + 1, (n, 2), generator=gen))
        return [Case(batch=(heads,), n_q=sum(s[0] for s in segments), n_kv=sum(s[1] for s in segments), d_k=d, d_v=d,
                     dtype=dtype, device=device, values="normal", seed=0, segments=segments)]
    lengths = (64,) if tiny else (32768, 131072)
    batch = (2, 2) if tiny else (4, 8)
    return [Case(batch=batch, n_q=1, n_kv=n, d_k=64 if tiny else 128, d_v=64 if tiny else 128, dtype=dtype,
                 device=device, values="normal", seed=0) for n in lengths]


def run(tiny: bool) -> int:
    device = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    dtype = "float32" if device == "cpu" else "bfloat16"
    failures = 0
    print(f"{'kernel':26} {'property':28} {'n_kv':>7}  verdict  seconds")
    for name, target in kernels(device):
        for prop in (p for p in catalog().values() if target.convention in p.only_for):
            for case in cases(tiny, device, dtype, target.convention):
                start = time.perf_counter()
                try:
                    prop.fn(target, case)
                    verdict = "pass"
                except Unsupported as exc:
                    verdict = f"skip ({exc})"
                except Failure as exc:
                    verdict, failures = f"FAIL: {str(exc).splitlines()[0][:80]}", failures + 1
                print(f"{name:26} {prop.id:28} {case.n_kv:7}  {verdict}  {time.perf_counter() - start:.2f}")
    return 1 if failures else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny sizes (runs anywhere)")
    raise SystemExit(run(parser.parse_args().tiny))
