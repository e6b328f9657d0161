"""Test cases: small frozen records that materialise into tensors on demand.

A case holds shapes, a dtype, a device and a seed, never tensors, so Hypothesis can shrink
it, a report can print it, and a reproduction snippet can rebuild it exactly.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, replace

import torch

from attn_spec.dtypes import DTYPES
from attn_spec.reference import causal_mask


def available_devices() -> list[str]:
    """CPU always; CUDA and MPS when this machine has them."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices.append("cuda")
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        devices.append("mps")
    return devices


LARGE = 2**22  # entries per tensor beyond which a case draws its values on its own device (below)
KEPT_PAIRS = 2**22  # query-key pairs beyond which a case's drawn Q, K, V are kept and handed out as copies
KEPT_BYTES = 2**28  # what the kept tensors may hold in all, O(n d) (a larger case's are drawn again every time)
_KEPT: OrderedDict = OrderedDict()  # Case -> (Q, K, V, mask), least recently used first


def _values(gen, shape, style, magnitude, dtype=torch.float64, device="cpu"):
    if style == "integers":  # small integers: counterexamples stay readable
        return torch.randint(-2, 3, shape, generator=gen, device=device).to(dtype) * magnitude
    return torch.randn(shape, generator=gen, dtype=dtype, device=device) * magnitude


def _padding_mask(gen, batch, n_kv, device="cpu"):
    """Bool key-padding mask [..., 1, Tk]: each batch element keeps its first L keys, L drawn in
    [n_kv / 2, n_kv] (at least 1), as padded sequences of different lengths. O(n) memory at any length."""
    keep = torch.randint((n_kv + 1) // 2, n_kv + 1, batch + (1, 1), generator=gen, device=device).clamp_min(1)
    return torch.arange(n_kv, device=device) < keep  # [..., 1, Tk]


def _random_mask(gen, shape, device="cpu"):
    """Bool mask [..., Tq, Tk] with at least one allowed key per row."""
    mask = torch.rand(shape, generator=gen, device=device) < 0.6  # [..., Tq, Tk]
    keep = torch.randint(0, shape[-1], shape[:-1] + (1,), generator=gen, device=device)  # [..., Tq, 1]
    return mask.scatter(-1, keep, True)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass(frozen=True)
class Case:
    """One attention input: Q [*batch, n_q, d_k], K [*batch, n_kv, d_k], V [*batch, n_kv, d_v]."""

    batch: tuple[int, ...] = ()
    n_q: int = 2
    n_kv: int = 2
    d_k: int = 2
    d_v: int = 2
    dtype: str = "float64"
    device: str = "cpu"
    values: str = "integers"  # "integers" (readable) or "normal"
    magnitude: float = 1.0  # multiplies every entry of Q, K and V
    mask: str = "none"  # "none", "random" (per batch element), "causal" (top-left, [n_q, n_kv]) or
    #                     "padding" (keys beyond each element's length, [..., 1, n_kv])
    seed: int = 0
    layout: str = "contiguous"  # "heads": with batch dims [..., B, H], Q, K, V are views split from
    # [..., B, n, H, d] by view(B, n, H, d).transpose(1, 2), as models make heads (non-contiguous)
    kv_heads: int = 0  # grouped-query attention: K and V have this many heads on the last batch dim (0: as Q)
    segments: tuple = ()  # a packed batch (the varlen convention): ((n_q, n_kv) of each sequence, ...), whose
    #                       sums are n_q and n_kv; lengths may be 0. Empty: one dense batch
    # A batch of decode calls (the decode convention, properties/serving/decode.py), B = batch[0]:
    cache_lengths: tuple = ()  # each element's sequence length L_b in [min(n_q, n_kv), n_kv]; empty: every one n_kv
    page_size: int = 0  # a paged cache's page size (properties/serving/paged.py); 0: pages of 16 (vLLM's default block)
    spare_pages: int = 0  # pages of the pool that no block table lists
    num_splits: int | None = None  # the split-KV setting decoded with (0: the kernel's own); None: 1, 2, 3 and 0

    def __post_init__(self):  # a case read back from JSON has lists: kept as tuples (a case is hashable)
        object.__setattr__(self, "batch", tuple(self.batch))
        object.__setattr__(self, "segments", tuple(tuple(int(n) for n in pair) for pair in self.segments))
        object.__setattr__(self, "cache_lengths", tuple(int(n) for n in self.cache_lengths))

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def replace(self, **changes) -> "Case":
        return replace(self, **changes)

    def _laid_out(self, t):
        """``t`` [..., H, n, d] as the same values in a [..., n, H, d] buffer, seen through transpose(-3, -2)."""
        if self.layout != "heads" or len(self.batch) < 2:
            return t
        return t.transpose(-3, -2).contiguous().transpose(-3, -2)  # [..., H, n, d], strides of [..., n, H, d]

    @property
    def large(self) -> bool:
        """More than LARGE entries in Q, K or V: values are drawn on the case's device, in float32
        (or the case's dtype if wider), from that device's generator: no float64 copy on the CPU."""
        size = max(self.n_q * self.d_k, self.n_kv * max(self.d_k, self.d_v))
        return size * math.prod(self.batch) > LARGE

    def tensors(self):
        """(Q, K, V, mask) in the case's dtype and device; mask is bool or None. A long case (properties at
        fixed shapes ask for its tensors again and again) is drawn once and handed out as fresh copies, with
        the same strides: a target may write into what it gets."""
        if math.prod(self.batch) * self.n_q * self.n_kv <= KEPT_PAIRS:
            return self._draw()
        kept = _KEPT.get(self)
        if kept is None:
            drawn = self._draw()
            kept = drawn[:3] + ((None,) if self.mask == "causal" else drawn[3:])  # an [n_q, n_kv] mask is not kept
            if 2 * _bytes(kept) > KEPT_BYTES:
                return drawn
            _KEPT[self] = kept
            while sum(map(_bytes, _KEPT.values())) > KEPT_BYTES:
                _KEPT.popitem(last=False)
        _KEPT.move_to_end(self)
        q, k, v, mask = (None if t is None else t.clone() for t in kept)
        return q, k, v, causal_mask(self.n_q, self.n_kv, device=self.device) if self.mask == "causal" else mask

    def _draw(self):
        large = self.large
        device = self.device if large else "cpu"
        draw = torch.float64 if not large or self.dtype == "float64" else torch.float32
        gen = torch.Generator(device=device).manual_seed(self.seed)
        b = self.batch
        b_kv = b[:-1] + (self.kv_heads,) if self.kv_heads else b
        q = _values(gen, b + (self.n_q, self.d_k), self.values, self.magnitude, draw, device)  # [..., Tq, Dk]
        k = _values(gen, b_kv + (self.n_kv, self.d_k), self.values, self.magnitude, draw, device)  # [..., Tk, Dk]
        v = _values(gen, b_kv + (self.n_kv, self.d_v), self.values, self.magnitude, draw, device)  # [..., Tk, Dv]
        mask = None
        if self.mask == "random":
            mask = _random_mask(gen, b + (self.n_q, self.n_kv), device)  # [..., Tq, Tk]
        elif self.mask == "causal":
            mask = causal_mask(self.n_q, self.n_kv, device=device)  # [Tq, Tk]
        elif self.mask == "padding":
            mask = _padding_mask(gen, b, self.n_kv, device)  # [..., 1, Tk]
        q, k, v = (self._laid_out(t.to(self.torch_dtype).to(self.device)) for t in (q, k, v))
        return q, k, v, (None if mask is None else mask.to(self.device))

    def summary(self) -> str:
        b_kv = list(self.batch[:-1]) + [self.kv_heads] if self.kv_heads else list(self.batch)
        parts = [f"Q {list(self.batch) + [self.n_q, self.d_k]}", f"K {b_kv + [self.n_kv, self.d_k]}",
                 f"V {b_kv + [self.n_kv, self.d_v]}", self.dtype, self.device]
        if self.mask != "none":
            parts.append(f"{self.mask} mask")
        if self.layout == "heads" and len(self.batch) >= 2:
            parts.append("heads split by view(B, n, H, d).transpose(1, 2)")
        if self.segments:
            parts.append(f"packed segments (n_q, n_kv) {' '.join(f'({q}, {k})' for q, k in self.segments)}")
        if self.cache_lengths:
            parts.append(f"cache lengths {list(self.cache_lengths)}")
        if self.page_size:
            parts.append(f"pages of {self.page_size}, {self.spare_pages} spare")
        if self.num_splits is not None:
            parts.append(f"num_splits={self.num_splits}")
        return ", ".join(parts)


@dataclass(frozen=True)
class MhaCase:
    """One multi-head input: x_q [n_q, d_model], x_kv [n_kv, d_model], random W_Q, W_K, W_V, W_O."""

    n_q: int = 2
    n_kv: int = 2
    d_model: int = 4
    n_heads: int = 2
    dtype: str = "float64"
    device: str = "cpu"
    mask: str = "none"  # "none", "random" or "causal"
    seed: int = 0
    self_attention: bool = False  # x_kv is x_q (for modules that take one input)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def as_self_attention(self) -> "MhaCase":
        return replace(self, self_attention=True, n_kv=self.n_q)

    def replace(self, **changes) -> "MhaCase":
        return replace(self, **changes)

    def tensors(self):
        """(x_q, x_kv, weights, mask): weights maps W_Q, W_K, W_V, W_O to [D, D] nn.Linear weights."""
        gen = torch.Generator().manual_seed(self.seed)
        d = self.d_model
        x_q = torch.randn(self.n_q, d, generator=gen, dtype=torch.float64)  # [Tq, D]
        x_kv = torch.randn(self.n_kv, d, generator=gen, dtype=torch.float64)  # [Tk, D]
        weights = {name: torch.randn(d, d, generator=gen, dtype=torch.float64) / d**0.5  # [D, D]
                   for name in ("W_Q", "W_K", "W_V", "W_O")}
        mask = None
        if self.mask == "random":
            mask = _random_mask(gen, (self.n_q, self.n_kv))  # [Tq, Tk]
        elif self.mask == "causal":
            mask = causal_mask(self.n_q, self.n_kv)  # [Tq, Tk]

        def cast(t):
            return t.to(self.torch_dtype).to(self.device)

        weights = {name: cast(w) for name, w in weights.items()}
        x_q = cast(x_q)
        x_kv = x_q if self.self_attention else cast(x_kv)
        return x_q, x_kv, weights, (None if mask is None else mask.to(self.device))

    def summary(self) -> str:
        kv = "x_kv = x_q" if self.self_attention else f"x_kv [{self.n_kv}, {self.d_model}]"
        text = f"x_q [{self.n_q}, {self.d_model}], {kv}, {self.n_heads} heads, {self.dtype}, {self.device}"
        return text + (f", {self.mask} mask" if self.mask != "none" else "")
