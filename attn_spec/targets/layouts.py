"""Tensor layouts: how a function-style target lays out heads and sequence.

- ``bhsd``: Q [..., S_q, D], K and V [..., S_kv, D]: the kit's own layout, PyTorch's SDPA, FlexAttention and
  Hugging Face's query/key/value (leading dims are batch and heads);
- ``bshd``: Q [B, S_q, H, D], K and V [B, S_kv, H_kv, D], output [B, S_q, H, D_v]: flash-attn's
  ``flash_attn_func`` and xformers' ``memory_efficient_attention``.

The kit's tensors are always [..., T, D]. To reach a 4-D layout, the last leading dim becomes the heads
(K and V may have fewer: grouped-query attention) and the others flatten into the batch.
"""
from __future__ import annotations

import math

import torch

from attn_spec.targets.integrity import not_plain
from attn_spec.failures import fail
from attn_spec.errors import Failure, TargetRaised, Unsupported

LAYOUTS = ("bhsd", "bshd")
FLASH_NAMES = ("softmax_scale", "window_size")  # parameters only [B, S, H, D] kernels take: `causal` alone is not
# one of them (the Triton tutorial's and FlagAttention's [B, H, S, D] kernels take `causal` and `sm_scale`)


def _grouped(q, k) -> bool:
    """Grouped-query attention: K/V have Hkv heads on dim -3 and Q has g * Hkv (g > 1)."""
    return q.dim() >= 3 and k.dim() >= 3 and 1 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0


def broadcast_shapes(*shapes) -> tuple:
    """torch.broadcast_shapes without its first-call cost (it imports sympy: 0.8 s, a third of a quick check)."""
    rank = max(map(len, shapes))
    out = []
    for dims in zip(*[(1,) * (rank - len(s)) + tuple(s) for s in shapes]):
        sizes = set(dims) - {1}
        if len(sizes) > 1:
            raise RuntimeError(f"shapes {[list(s) for s in shapes]} do not broadcast")
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def attend_shape(q, k, v):
    """[..., Tq, Dv]: leading dims broadcast; grouped K/V heads count as Q's heads."""
    kv = [t.shape[:-3] + q.shape[-3:-2] if _grouped(q, t) else t.shape[:-2] for t in (k, v)]
    batch = broadcast_shapes(q.shape[:-2], *kv)
    return tuple(batch) + (q.shape[-2], v.shape[-1])


class Heads:
    """Q, K, V and the mask as [B, H, T, D] (mask [B or 1, H or 1, S_q, S_kv]); ``restore`` maps
    an output [B, H, S_q, D_v] back to the kit's [..., S_q, D_v]."""

    def __init__(self, q, k, v, mask=None):
        self.out_shape = attend_shape(q, k, v)  # [..., Tq, Dv]
        lead = self.out_shape[:-2]
        self.outer, self.heads = (lead[:-1], lead[-1]) if lead else ((), 1)
        self.batch = math.prod(self.outer)
        self.kv_heads = k.shape[-3] if _grouped(q, k) else self.heads
        self.q, self.k, self.v = self._four(q, self.heads), self._four(k, self.kv_heads), self._four(v, self.kv_heads)
        self.mask = None
        if mask is not None:  # per-head only where the mask varies along the heads
            per_head = mask.dim() >= 3 and lead and mask.shape[-3] != 1
            self.mask = self._four(mask, self.heads if per_head else 1)  # [B, H or 1, Tq, Tk]

    def _four(self, t, heads):  # [..., T, D] -> [B, heads, T, D]
        return t.expand(*self.outer, heads, *t.shape[-2:]).reshape(self.batch, heads, *t.shape[-2:])

    def restore(self, out4) -> torch.Tensor:  # [B, H, Tq, Dv] -> [..., Tq, Dv]
        return out4.reshape(self.out_shape)

    def bshd_shape(self) -> tuple:
        return (self.batch, self.q.shape[-2], self.heads, self.v.shape[-1])


def call_bshd(fn, h: Heads):
    """``fn(q, k, v, mask)`` (the user's code) on [B, S, H, D] views of ``h`` (mask [B, H or 1, S_q, S_kv] or
    None); its output read back as [B, H, S_q, D_v] (transpose(1, 2)), not yet checked (see restore_bshd)."""
    try:
        out = fn(h.q.transpose(1, 2), h.k.transpose(1, 2), h.v.transpose(1, 2), h.mask)  # [B, S, H, D] views
    except TargetRaised as exc:
        exc.cause = _raised_cause(fn, h) or exc.cause
        raise
    return out.transpose(1, 2) if isinstance(out, torch.Tensor) and out.dim() >= 3 else out


def restore_bshd(out, h: Heads, call: str) -> torch.Tensor:
    """The kernel's output, read back by call_bshd, as the kit's [..., S_q, D_v], its shape checked: in the
    bshd layout the kernel returns [B, S_q, H, D_v]."""
    if not isinstance(out, torch.Tensor) or tuple(out.transpose(1, 2).shape if out.dim() >= 3 else out.shape) \
            != h.bshd_shape():
        got = (f"shape {list(out.transpose(1, 2).shape if out.dim() >= 3 else out.shape)}"
               if isinstance(out, torch.Tensor) else f"a {type(out).__name__}")
        fail(got, what="the output", expected=f"[B, S_q, H, D_v] = {list(h.bshd_shape())}", call=call,
             cause="in the bshd layout the output is [B, S_q, H, D_v], like the query")
    return h.restore(out)


def _raised_cause(fn, h: Heads) -> str:
    """When a [B, S, H, D] call raises: does the kernel run when given [B, H, S, D]? Then it reads heads
    and sequence transposed."""
    if h.q.shape[-2] == h.heads and h.k.shape[-2] == h.kv_heads:
        return ""  # the two readings have the same shapes: nothing to learn
    try:
        out = fn(h.q, h.k, h.v, h.mask)  # [B, H, S, D]: the other reading
    except (TargetRaised, Unsupported, Failure):
        return ""
    if isinstance(out, torch.Tensor) and tuple(out.shape) == (h.batch, h.heads, h.q.shape[-2], h.v.shape[-1]):
        return ("the kernel reads its [B, S, H, D] inputs as [B, H, S, D] (heads and sequence transposed): it runs "
                "when given [B, H, S, D]; transpose(1, 2) inside it, or pass --layout bhsd if that is its layout")
    return ""


def detect(call, names) -> tuple[str, str]:
    """(layout, why) of a function-style target: bshd when it takes flash-attn's parameter names, else
    probed on tiny inputs where one reading alone runs, else bhsd.

    ``call(q, k, v)`` calls the user's code and raises on any failure. The probes: Q [1, 3, 2, 4] with
    K, V [1, 5, 2, 4|6] runs only as [B, S, H, D] (3 and 5 are sequence lengths); Q [1, 2, 3, 4] with K, V
    [1, 2, 5, 4|6] only as [B, H, S, D] (3 and 5 heads do not group).
    """
    def runs(shape_q, shape_kv, expected) -> bool:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(shape_q, generator=gen)
        k, v = torch.randn(shape_kv, generator=gen), torch.randn(shape_kv[:-1] + (6,), generator=gen)
        try:
            out = call(q, k, v)
        except Exception:  # noqa: BLE001 - a probe: any failure means "not this layout"
            return False
        return (isinstance(out, torch.Tensor) and not_plain(out) is None and tuple(out.shape) == expected
                and bool(torch.isfinite(out).all()))

    flash = [n for n in FLASH_NAMES if n in (names or ())]
    if flash:
        return "bshd", f"detected from flash-attn's parameter names ({', '.join(flash)})"
    bshd, bhsd = runs((1, 3, 2, 4), (1, 5, 2, 4), (1, 3, 2, 6)), runs((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 3, 6))
    if bshd != bhsd:
        which = "bshd" if bshd else "bhsd"
        return which, (f"detected: Q [1, 3, 2, 4] against K [1, 5, 2, 4] runs only as "
                       f"{'[B, S, H, D]' if bshd else '[B, H, S, D]'}")
    return "bhsd", "the default; --layout bshd for [B, S, H, D] kernels"
