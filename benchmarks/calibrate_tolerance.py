"""Calibrate the error budget: how far do *correct* implementations stray from the float64 reference?

Two parts (each figure is measured in this run):

1. Drawn sizes. For every correct function variant in the gallery and every dtype, draw random cases
   (thorough profile shapes and magnitudes) and print the worst ratio of the variant's error to
     (a) the naive same-dtype error (what FACTOR must cover), and
     (b) the floor unit eps(dtype) * max|V| * (sqrt(n_kv) + max|score|) (what FLOOR_ULPS must cover
         when the naive implementation is lucky).
   A variant passes when  err <= FACTOR * naive + FLOOR_ULPS * unit;  the last column shows the
   smallest FACTOR that would pass every case given the current floor.
2. Long sequences (``--lengths``). At fixed shapes B=1, H=2, n_q = n_kv = n, head dims 64 and 128,
   with no mask and a causal mask, the chunked reference and the chunked budget judge correct
   implementations in the styles kernels use: SDPA's backends (math, flash, memory-efficient, as
   available on this device), FlexAttention (``--flex``: torch.compile'd, minutes to compile on a CPU),
   queries in chunks, and an online softmax over key blocks (``examples/blocked_attention.py``).
   The table shows each style's worst error as a fraction of the budget (must stay below 1) and in
   floor units.

    python benchmarks/calibrate_tolerance.py [--cases 300] [--lengths 1024 4096 16384] [--flex] [--device cuda]
"""
import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from tabulate import tabulate  # noqa: E402

import blocked_attention  # noqa: E402
from attn_spec import reference  # noqa: E402
from attn_spec.checking import chunked, strategies, tolerance  # noqa: E402
from attn_spec.checking.cases import DTYPES, Case  # noqa: E402
from attn_spec.checking.shapes import DEVICE_DTYPES  # noqa: E402
from gallery import CORRECT  # noqa: E402


def drawn(cases: int) -> None:
    variants = [e for e in CORRECT if e.convention == "function"]
    rows = []
    for dtype in DTYPES:
        stats = {e.name: [0.0, 0.0, 0.0] for e in variants}  # worst err/naive, err/unit, needed factor

        @settings(max_examples=cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(strategies.cases("thorough", dtypes=[dtype]))
        def sample(case):
            q, k, v, mask = case.tensors()
            ref, _ = reference.attention(q, k, v, mask)
            naive = tolerance.naive_error(q, k, v, mask, ref)
            unit = tolerance.floor_unit(q, k, v)
            for e in variants:
                err = tolerance.max_error(e.obj(q, k, v, mask), ref)
                s = stats[e.name]
                s[0] = max(s[0], err / naive if naive else (0.0 if err == 0 else math.inf))
                s[1] = max(s[1], err / unit)
                slack = err - tolerance.FLOOR_ULPS * unit
                s[2] = max(s[2], slack / naive if slack > 0 and naive else (math.inf if slack > 0 else 0.0))

        sample()
        rows += [[dtype, name, f"{a:.3g}", f"{b:.3g}", f"{c:.3g}"] for name, (a, b, c) in stats.items()]
    print(tabulate(rows, headers=["dtype", "variant", "max err/naive", "max err/unit", "FACTOR needed"]))
    print(f"\ncurrent: FACTOR={tolerance.FACTOR}, FLOOR_ULPS={tolerance.FLOOR_ULPS}")


# ------------------------------------------------------------------------------ long sequences


def _sdpa_backend(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attend(q, k, v, mask=None):
        with sdpa_kernel(getattr(SDPBackend, name)):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attend


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention)

    def attend(q, k, v, mask=None):
        if mask is None:
            return compiled(q, k, v)

        def keep(score, b, h, i, j):  # mask [Tq, Tk] (causal here): -inf where a key may not be attended
            return torch.where(mask[i, j], score, -math.inf)
        return compiled(q, k, v, score_mod=keep)
    return attend


def _queries_in_chunks(q, k, v, mask=None, rows=256):
    outs = []
    for start in range(0, q.shape[-2], rows):
        m = None if mask is None else mask[..., start:start + rows, :]
        outs.append(tolerance.seed_attention(q[..., start:start + rows, :], k, v, m))
    return torch.cat(outs, dim=-2)


def styles(device: str, flex: bool) -> dict:
    """The correct styles to judge, each only if it runs here (a backend with no kernel is left out)."""
    found = {}
    probe = [torch.randn(1, 2, 8, 16, device=device) for _ in range(3)]
    for name in ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"):
        try:
            _sdpa_backend(name)(*probe)
        except RuntimeError:
            continue
        found[f"sdpa {name.lower().replace('_attention', '')}"] = _sdpa_backend(name)
    if flex:
        found["flex_attention (compiled)"] = _flex()
    found["queries in chunks of 256"] = _queries_in_chunks
    found["online softmax, key blocks of 1024"] = blocked_attention.attention
    return found


def long_sequences(lengths, device: str, flex: bool, seeds: int) -> None:
    judged = styles(device, flex)
    dtypes = ["float32", "bfloat16", "float16"] if device == "cpu" else ["float32", *DEVICE_DTYPES[device]]
    worst = {}  # (length, dtype, style) -> [err/budget, err/unit]
    start = time.perf_counter()
    for n in lengths:
        for dtype in dtypes:
            for d in (64, 128):
                for mask_kind in ("none", "causal"):
                    for seed in range(seeds):
                        case = Case(batch=(1, 2), n_q=n, n_kv=n, d_k=d, d_v=d, dtype=dtype, device=device,
                                    values="normal", mask=mask_kind, seed=seed)
                        q, k, v, mask = case.tensors()
                        ref = chunked.reference_output(q, k, v, mask)
                        allowed = tolerance.budget(q, k, v, mask, ref)
                        unit = tolerance.floor_unit(q, k, v)
                        for name, attend in judged.items():
                            try:
                                err = tolerance.max_error(attend(q, k, v, mask), ref)
                            except RuntimeError as exc:  # e.g. a backend without this dtype or mask
                                print(f"  {name} at {case.summary()}: {str(exc).splitlines()[0][:90]}", file=sys.stderr)
                                continue
                            w = worst.setdefault((n, dtype, name), [0.0, 0.0])
                            w[0], w[1] = max(w[0], err / allowed), max(w[1], err / unit)
    rows = [[n, dtype, name, f"{a:.3g}", f"{b:.3g}", "yes" if a <= 1 else "NO"]
            for (n, dtype, name), (a, b) in worst.items()]
    print(tabulate(rows, headers=["n_q = n_kv", "dtype", "style", "max err/budget", "max err/unit", "within"]))
    print(f"\n{device}; B=1, H=2, d in (64, 128), no mask and causal, {seeds} seed(s) each; "
          f"{time.perf_counter() - start:.0f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=300, help="drawn cases per dtype (0: skip part 1)")
    parser.add_argument("--lengths", type=int, nargs="*", default=[], help="long-sequence lengths (part 2)")
    parser.add_argument("--seeds", type=int, default=1, help="cases per long-sequence configuration")
    parser.add_argument("--flex", action="store_true", help="judge torch.compile'd FlexAttention too")
    parser.add_argument("--device", default="cpu", help="device for part 2 (default cpu)")
    args = parser.parse_args()
    if args.cases:
        drawn(args.cases)
    if args.lengths:
        long_sequences(args.lengths, args.device, args.flex, args.seeds)


if __name__ == "__main__":
    main()
