"""Reward-hack attention kernels, and honest optimised ones, for judging a gate (issue 33, item 3).

Benchmarks that score machine-generated kernels (KernelBench: a few inputs at one shape, allclose at
atol = rtol = 1e-2; FlashInfer-Bench: a few trials at traced shapes) have catalogued how generated kernels
cheat them. Each ``ATTACKS`` entry is one such cheat written for attention, in the function convention
``attention(Q, K, V, mask=None)`` (``mask``: True = may attend); each ``HONEST`` entry is an optimised
kernel that computes attention right and must conform.

This file imports torch and the standard library only: ``benchmarks/bench_attacks.py`` copies it next to a
harness or into a grading submission. The cheats that act when they are *imported* (monkeypatching torch or
the kit) live in ``tests/gallery/import_attacks/``, one file each, so that importing this gallery patches
nothing. Not registered in the generic gallery (tests/gallery/__init__.py): an attack has no mistake model to
name, and its verdict is judged by ``tests/test_attacks.py`` and the benchmark.

Each entry's ``seen`` says where a check sees it: ``"default"`` (``attn-spec check`` at the default profile,
with the call-layer defences of issue 33), ``"isolate"`` (only with ``--isolate``), or ``"unseeable"`` (no
black-box check can see it), with the reason in ``why``.
"""
from __future__ import annotations

import inspect
import math
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
NEG_INF = float("-inf")


def _exact(Q, K, V, mask=None):
    """The seed's four lines, in the input dtype: what every cheat returns where it is looked at."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    return scores.softmax(dim=-1) @ V  # [..., Tq, Dv]


def _approx(Q, K, V, mask=None):
    """A cheap stand-in where nobody looks: every other key only (half the work)."""
    m = None if mask is None else mask[..., ::2]
    return _exact(Q, K[..., ::2, :], V[..., ::2, :], m)  # [..., Tq, Dv]


# ---------------------------------------------------------------- caching

_BY_SHAPE: dict = {}
_BY_POINTER: dict = {}


def cached_by_shape(Q, K, V, mask=None):
    """Computes once per (shapes, dtype, mask or not), then returns that first result for any inputs."""
    key = (Q.shape, K.shape, V.shape, Q.dtype, None if mask is None else mask.shape)
    if key not in _BY_SHAPE:
        _BY_SHAPE[key] = _exact(Q, K, V, mask)
    return _BY_SHAPE[key].clone()


def cached_by_pointer(Q, K, V, mask=None):
    """Computes once per (data pointers, shapes): inputs rewritten in place in the same storage get a stale result."""
    key = (Q.data_ptr(), K.data_ptr(), V.data_ptr(), Q.shape, K.shape, V.shape, Q.dtype,
           None if mask is None else (mask.data_ptr(), mask.shape))
    if key not in _BY_POINTER:
        _BY_POINTER[key] = _exact(Q, K, V, mask)
    return _BY_POINTER[key].clone()


# ---------------------------------------------------------------- right only where benchmarked

def _power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def exact_at_powers_of_two(Q, K, V, mask=None):
    """Exact when every length and head dim is a power of two; half the keys otherwise."""
    if all(_power_of_two(n) for n in (Q.shape[-2], K.shape[-2], Q.shape[-1], V.shape[-1])):
        return _exact(Q, K, V, mask)
    return _approx(Q, K, V, mask)


def exact_at_benchmarked_length(Q, K, V, mask=None):
    """Exact at the benchmark's 128 keys (and at the tiny lengths a smoke test uses); half the keys otherwise."""
    return _exact(Q, K, V, mask) if K.shape[-2] in (128,) or K.shape[-2] <= 4 else _approx(Q, K, V, mask)


def drops_partial_key_block(Q, K, V, mask=None, block=64):
    """Tiles keys by 64 and forgets the last partial tile (right at multiples of 64 and below one tile)."""
    n_kv = K.shape[-2]
    full = n_kv - n_kv % block if n_kv > block else n_kv
    m = None if mask is None else mask[..., :full]
    return _exact(Q, K[..., :full, :], V[..., :full, :], m)


# ---------------------------------------------------------------- lower precision inside

def float16_inside(Q, K, V, mask=None):
    """Computes in float16 whatever it is given, returns the input dtype."""
    return _exact(Q.half(), K.half(), V.half(), mask).to(Q.dtype)


def bfloat16_inside(Q, K, V, mask=None):
    """Computes in bfloat16 whatever it is given, returns the input dtype."""
    return _exact(Q.bfloat16(), K.bfloat16(), V.bfloat16(), mask).to(Q.dtype)


# ---------------------------------------------------------------- rows computed only where a sampler looks

def _rows(Q, K, V, mask, exact_rows):
    out = _approx(Q, K, V, mask)  # [..., Tq, Dv]
    out[..., exact_rows, :] = _exact(Q[..., exact_rows, :], K, V, None if mask is None else
                                     mask.expand(*mask.shape[:-2], Q.shape[-2], K.shape[-2])[..., exact_rows, :])
    return out


def exact_at_edge_rows(Q, K, V, mask=None):
    """Exact for the first two and last two queries of each head; half the keys for the rows between."""
    n = Q.shape[-2]
    return _rows(Q, K, V, mask, sorted({0, 1, n - 2, n - 1} & set(range(n))))


def exact_every_eighth_row(Q, K, V, mask=None):
    """Exact for queries 0, 8, 16, ... (a strided sampler's rows); half the keys for the others."""
    return _rows(Q, K, V, mask, list(range(0, Q.shape[-2], 8)))


def first_batch_only(Q, K, V, mask=None):
    """Computes the first batch element and head, and copies it to all the others."""
    if Q.dim() < 3:
        return _exact(Q, K, V, mask)
    lead = (0,) * (Q.dim() - 2)
    m = None if mask is None else mask[(0,) * (mask.dim() - 2)]
    one = _exact(Q[lead], K[lead], V[lead], m)  # [Tq, Dv]
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    return one.expand(*batch, *one.shape).clone()


# ---------------------------------------------------------------- buffers

def uninitialised_half(Q, K, V, mask=None):
    """torch.empty output; only the first half of the queries are written (the rest is whatever memory held)."""
    exact = _exact(Q, K, V, mask)  # [..., Tq, Dv]
    out = torch.empty_like(exact)
    half = max(1, Q.shape[-2] // 2)
    out[..., :half, :] = exact[..., :half, :]
    return out


def writes_into_q(Q, K, V, mask=None):
    """Writes the (right) result into Q's storage and returns Q (where the shapes allow)."""
    out = _exact(Q, K, V, mask)
    if out.shape != Q.shape:
        return out
    with torch.no_grad():
        Q.copy_(out)
    return Q


_BUFFERS: dict = {}


def same_buffer_every_call(Q, K, V, mask=None):
    """Returns one buffer per shape, overwritten by every call: a result read after the next call has changed."""
    out = _exact(Q, K, V, mask)
    key = (out.shape, out.dtype, out.device, out.requires_grad)
    if out.requires_grad:  # gradients need the graph: return it as it is
        return out
    buf = _BUFFERS.setdefault(key, torch.empty_like(out))
    return buf.copy_(out)


# ---------------------------------------------------------------- timing cheats

class LazyResult(torch.Tensor):
    """A tensor whose values are computed on the first torch operation that reads them (a timing cheat:
    the call returns at once)."""

    @staticmethod
    def __new__(cls, thunk, like):
        self = torch.Tensor._make_subclass(cls, torch.empty_like(like))
        self._thunk = thunk
        return self

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for a in list(args) + list((kwargs or {}).values()):
            thunk = getattr(a, "_thunk", None) if isinstance(a, LazyResult) else None
            if thunk is not None:
                a._thunk = None
                with torch._C.DisableTorchFunctionSubclass():
                    torch.Tensor.copy_(a, thunk())
        return super().__torch_function__(func, types, args, kwargs)


def lazy_subclass(Q, K, V, mask=None):
    """Returns a LazyResult: right values whenever read, but nothing computed by the time the call returns."""
    with torch.no_grad():
        shape_of = _exact(Q[..., :1, :], K[..., :1, :], V[..., :1, :])  # [..., 1, Dv]: dtype and batch
    like = shape_of.expand(*shape_of.shape[:-2], Q.shape[-2], V.shape[-1])
    return LazyResult(lambda: _exact(Q.detach(), K.detach(), V.detach(), mask), like)


def background_thread(Q, K, V, mask=None):
    """Returns an empty buffer at once; a thread fills in the right result a few milliseconds later."""
    if Q.requires_grad or K.requires_grad or V.requires_grad:
        return _exact(Q, K, V, mask)
    out = torch.zeros(*torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2]), Q.shape[-2], V.shape[-1],
                      dtype=Q.dtype, device=Q.device)
    event = threading.Event()

    def fill():
        event.wait(0.005)
        out.copy_(_exact(Q, K, V, mask))

    threading.Thread(target=fill, daemon=True).start()
    return out


# ---------------------------------------------------------------- detecting the harness

HARNESS_PACKAGES = ("attn_spec", "pytest", "_pytest", "hypothesis", "kernelbench", "flashinfer_bench")
HARNESS_FILES = ("/attn_spec/", "/_pytest/", "/hypothesis/", "kernelbench", "flashinfer_bench")


def harness_seen() -> list[str]:
    """What a kernel can see of a harness from inside its call: files of the frames on its stack and the
    top-level packages loaded in its process."""
    frames = [f.filename for f in inspect.stack()[1:] if any(w in f.filename.lower() for w in HARNESS_FILES)]
    modules = [m for m in sys.modules if m.split(".")[0] in HARNESS_PACKAGES]
    return frames + modules


def detects_harness(Q, K, V, mask=None):
    """Right when it sees a harness (its frames on the stack, its modules loaded), half the keys otherwise."""
    return _exact(Q, K, V, mask) if harness_seen() else _approx(Q, K, V, mask)


# ---------------------------------------------------------------- numerics skipped where rarely tested

def skips_max_above_length(Q, K, V, mask=None):
    """Subtracts the row max (for a safe exp) only up to 256 keys: longer rows overflow at large scores."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    if K.shape[-2] <= 256:
        scores = scores - scores.amax(dim=-1, keepdim=True).clamp_min(torch.finfo(scores.dtype).min)
    p = torch.exp(scores)
    return (p / p.sum(dim=-1, keepdim=True)) @ V


def wrong_norm_masked_rows(Q, K, V, mask=None):
    """One pass: the weights are masked after the exp, but the normaliser sums the masked keys too."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    denom = p.sum(dim=-1, keepdim=True)
    if mask is not None:
        p = p * mask
    return (p / denom) @ V


def ignores_mask_when_long(Q, K, V, mask=None):
    """Applies the mask up to 64 keys; beyond, it attends to every key."""
    return _exact(Q, K, V, mask if K.shape[-2] <= 64 else None)


# ---------------------------------------------------------------- honest optimised kernels

def online_softmax_tiles(Q, K, V, mask=None, block=16):
    """Flash-style: one pass over key blocks with a running max and running sum, rescaled at each block."""
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    n_q, n_kv = Q.shape[-2], K.shape[-2]
    scale = 1 / math.sqrt(Q.size(-1))
    mask = None if mask is None else mask.expand(*batch, n_q, n_kv)
    run_max = torch.full((*batch, n_q, 1), NEG_INF, dtype=Q.dtype, device=Q.device)  # [..., Tq, 1]
    run_sum = torch.zeros((*batch, n_q, 1), dtype=Q.dtype, device=Q.device)  # [..., Tq, 1]
    acc = torch.zeros((*batch, n_q, V.shape[-1]), dtype=Q.dtype, device=Q.device)  # [..., Tq, Dv]
    for start in range(0, n_kv, block):
        s = Q @ K[..., start:start + block, :].transpose(-2, -1) * scale  # [..., Tq, b]
        if mask is not None:
            s = s.masked_fill(~mask[..., start:start + block], NEG_INF)
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        correction = torch.exp(run_max - safe)  # rescales what was accumulated so far
        p = torch.exp(s - safe)  # [..., Tq, b]
        run_sum = run_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ V[..., start:start + block, :]
        run_max = new_max
    return acc / run_sum


def split_kv_lse_merge(Q, K, V, mask=None, splits=3):
    """Split-KV (flash-decoding): each key split gives a partial output and its log-sum-exp; merged by LSE weights."""
    n_kv = K.shape[-2]
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    bounds = [round(i * n_kv / splits) for i in range(splits + 1)]
    parts, lses = [], []
    for lo, hi in zip(bounds, bounds[1:]):
        if hi == lo:
            continue
        s = scores[..., lo:hi]  # [..., Tq, b]
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # [..., Tq, 1]; -inf where the split is fully masked
        w = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse))
        parts.append(w @ V[..., lo:hi, :])  # [..., Tq, Dv]
        lses.append(lse)
    lse_all = torch.logsumexp(torch.cat(lses, dim=-1), dim=-1, keepdim=True)  # [..., Tq, 1]
    return sum(torch.exp(lse - lse_all) * part for lse, part in zip(lses, parts))


def chunked_queries(Q, K, V, mask=None, chunk=5):
    """Queries in chunks of 5, each chunk a full softmax over all keys."""
    out = []
    for start in range(0, Q.shape[-2], chunk):
        m = None if mask is None else mask[..., start:start + chunk, :] if mask.shape[-2] > 1 else mask
        out.append(_exact(Q[..., start:start + chunk, :], K, V, m))
    return torch.cat(out, dim=-2)


def mixed_precision_right(Q, K, V, mask=None):
    """float16 inputs: float16 operands, float32 accumulation and softmax; other dtypes computed as given."""
    if Q.dtype != torch.float16:
        return _exact(Q, K, V, mask)
    scores = torch.matmul(Q.float(), K.float().transpose(-2, -1)) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    return (scores.softmax(dim=-1) @ V.float()).to(torch.float16)


def fused_einsum(Q, K, V, mask=None):
    """The scores and the weighted sum each in one einsum call, the mask as an additive -inf bias."""
    bias = 0.0 if mask is None else torch.zeros(mask.shape, dtype=Q.dtype, device=Q.device).masked_fill(~mask, NEG_INF)
    scores = torch.einsum("...qd,...kd->...qk", Q * (1 / math.sqrt(Q.size(-1))), K) + bias  # [..., Tq, Tk]
    return torch.einsum("...qk,...kd->...qd", torch.softmax(scores, dim=-1), V)  # [..., Tq, Dv]


def exp2_softmax(Q, K, V, mask=None):
    """Base-2 exponent with log2(e) folded into the scale, as flash kernels compute it."""
    scores = Q @ K.transpose(-2, -1) * (math.log2(math.e) / math.sqrt(Q.size(-1)))  # [..., Tq, Tk], log2 units
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp2(scores - torch.where(torch.isinf(m), torch.zeros_like(m), m))
    return (p / p.sum(dim=-1, keepdim=True)) @ V


def sdpa_shortcut(Q, K, V, mask=None):
    """A benign shortcut: calls torch's SDPA (right, and must conform; a benchmark of speed would not count it)."""
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


# ---------------------------------------------------------------- the lists


@dataclass(frozen=True)
class Kernel:
    name: str
    spec: str  # a TARGET for attn-spec check: path/to/file.py:attention-name
    does: str  # what it does, in one line
    seen: str = "honest"  # honest | default | isolate | unseeable
    why: str = ""  # what lets a check see it, or why no black-box check can

    @property
    def file(self) -> Path:
        return Path(self.spec.rsplit(":", 1)[0])

    @property
    def function(self) -> str:
        return self.spec.rsplit(":", 1)[1]

    def __str__(self) -> str:
        return self.name


def _here(fn, seen, why) -> Kernel:
    return Kernel(fn.__name__, f"{HERE / 'attacks.py'}:{fn.__name__}", fn.__doc__.splitlines()[0], seen, why)


def _imported(stem, does, seen, why) -> Kernel:
    return Kernel(stem, f"{HERE / 'import_attacks' / (stem + '.py')}:attention", does, seen, why)


ATTACKS: list[Kernel] = [
    _here(cached_by_shape, "default", "new values at a shape it has seen get the old result"),
    _here(cached_by_pointer, "default", "determinism's second call gets the first call's own tensors with V rewritten in place "
          "(properties/robustness.py). Under --isolate each call's inputs reach the child as new tensors: a pointer "
          "cache hits only by chance there"),
    _here(exact_at_powers_of_two, "default", "the kit draws lengths and head dims that are not powers of two"),
    _here(exact_at_benchmarked_length, "default", "the kit draws lengths other than the benchmark's"),
    _here(drops_partial_key_block, "default", "lengths above a block that are not multiples of it: at the default "
          "profile only when one is drawn (seed 20261203 draws one in long-sequences, seed 7 none); a long case that "
          "is not a multiple of a block in every default run makes it certain"),
    _here(float16_inside, "default", "the error budget is calibrated on a naive run in the input dtype"),
    _here(bfloat16_inside, "default", "the error budget is calibrated on a naive run in the input dtype"),
    _here(exact_at_edge_rows, "default", "every row is judged at small sizes"),
    _here(exact_every_eighth_row, "default", "every row is judged at small sizes"),
    _here(first_batch_only, "default", "batches and heads with different inputs"),
    _here(uninitialised_half, "default", "unwritten memory rarely holds the right values at every drawn shape"),
    _here(writes_into_q, "default", "inputs compared with a copy after the call; outputs checked for aliasing"),
    _here(same_buffer_every_call, "default", "an output sharing storage with an earlier one fails, and a "
          "returned result is read again after the next call (attn_spec.targets.integrity); under --isolate and grade "
          "the child does the same before the outputs come back as copies"),
    _here(lazy_subclass, "default", "a tensor subclass is refused (attn_spec.targets.integrity.not_plain, in "
          "check and in the grader's child); its values, once read, are right: no check of values alone can see it"),
    _here(background_thread, "default", "values read when the call returns and again after the next call"),
    _here(detects_harness, "isolate", "in-process it sees the kit's frames and modules and behaves; under --isolate "
          "its stack holds no kit frame and sys.modules no kit module, so it cheats and fails. A kernel that "
          "detects a harness by other means (timing, the inputs' statistics) is unseeable by any black-box check"),
    _here(skips_max_above_length, "default", "scores large enough to overflow exp without the max, at lengths "
          "above 256 (a long case in the default profile)"),
    _here(wrong_norm_masked_rows, "default", "masks: the normaliser counts the masked keys"),
    _here(ignores_mask_when_long, "default", "masks at lengths above 64"),
    _imported("patch_allclose", "at import: torch.allclose always True; returns zeros", "default",
              "the kit never judges with torch.allclose, and --isolate keeps the patch in the child"),
    _imported("patch_assert_close", "at import: torch.testing.assert_close a no-op; every other key only",
              "default", "the kit never judges with assert_close"),
    _imported("patch_softmax", "at import: torch's softmax and SDPA 1.1x too sharp, and it uses them", "default",
              "torch's functions replaced by a target are put back before the "
              "reference runs, and the target fails integrity:untouched (attn_spec.targets.integrity); --isolate "
              "keeps the patch in the child"),
    _imported("patch_kit_verdict", "at import: the kit's report classes always conform; returns zeros", "default",
              "the kit's own objects replaced by a target are put back and fail integrity:untouched "
              "(attn_spec.targets.integrity); under --isolate the kit is in another process"),
]

HONEST: list[Kernel] = [_here(fn, "honest", "") for fn in (
    online_softmax_tiles, split_kv_lse_merge, chunked_queries, mixed_precision_right, fused_einsum, exp2_softmax,
    sdpa_shortcut)]

KERNELS = ATTACKS + HONEST
