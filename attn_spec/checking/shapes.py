"""Fixed shapes: check a target at the sizes it runs (``--shapes``, ``shapes=``, the ``scale`` profile).

A shape is ``B,H,N,D`` (self-attention: B sequences of H heads, N positions, head dim D) or
``B,H,HKV,NQ,NKV,D`` (grouped-query attention with HKV key/value heads, cross attention with
NQ queries over NKV keys). For a varlen kernel the same shape is a packed batch: B sequences of up to NQ
queries over up to NKV keys (lengths drawn from the seed, the first sequence the longest; ``packed_case``).
A *rung* is one shape in one dtype on one device.

How a fixed shape flows through the catalog: each property says in ``@prop(at_scale=...)``
whether it makes sense at any size, and with which cases there (mask kinds; grouped K/V). For
each rung the kit builds exactly those :class:`~attn_spec.checking.cases.Case` records (the same
frozen records the strategies draw, with ``batch=(B, H)``, values drawn from the seed) and the
runner calls the property on each, in order, without Hypothesis: nothing is generated and
nothing is shrunk, so a failure is reported at the shape that showed it, and its reproduction
snippet rebuilds that case. Small sizes stay the drawn profiles' job.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_spec.checking.cases import Case, MhaCase, available_devices
from attn_spec.errors import KitUsageError

# The dtypes a rung is checked in when none are asked for: what kernels run in on each device.
DEVICE_DTYPES = {"cpu": ("float32",), "cuda": ("bfloat16", "float16"), "mps": ("float16",)}

# The scale profile's ladder: every length with every head dim. On the CPU the float64 reference
# costs about 4 n^2 d flops per head (16k keys at d=256: 11 s on this 2-core machine).
SCALE_LENGTHS = {"cpu": (1024, 4096, 16384), "gpu": (1024, 4096, 16384, 32768, 65536, 131072)}
SCALE_HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_kv: int
    d: int

    @classmethod
    def parse(cls, text) -> "Shape":
        """``"B,H,N,D"`` or ``"B,H,HKV,NQ,NKV,D"`` (or a tuple of those ints); a KitUsageError otherwise."""
        if isinstance(text, Shape):
            return text
        try:
            parts = [int(x) for x in (text.replace("x", ",").split(",") if isinstance(text, str) else text)]
        except (TypeError, ValueError):
            parts = []
        if len(parts) == 4:
            b, h, n, d = parts
            parts = [b, h, h, n, n, d]
        if len(parts) != 6 or min(parts) < 1:
            raise KitUsageError(f"shape {text!r}: expected B,H,N,D or B,H,HKV,NQ,NKV,D with positive integers "
                                f"(e.g. 1,8,4096,128 or 1,32,8,1,32768,128)")
        shape = cls(*parts)
        if shape.heads % shape.kv_heads:
            raise KitUsageError(f"shape {text!r}: H={shape.heads} query heads is not a multiple of "
                                f"HKV={shape.kv_heads} key/value heads")
        return shape

    def __str__(self) -> str:
        if self.kv_heads == self.heads and self.n_q == self.n_kv:
            return f"{self.batch},{self.heads},{self.n_q},{self.d}"
        return f"{self.batch},{self.heads},{self.kv_heads},{self.n_q},{self.n_kv},{self.d}"


@dataclass(frozen=True)
class Rung:
    shape: Shape
    dtype: str
    device: str

    def __str__(self) -> str:
        return f"{self.shape} {self.dtype} {self.device}"


def parse_shapes(values) -> list[Shape]:
    """Shapes from strings ("1,8,4096,64"), tuples or Shape records."""
    return [Shape.parse(v) for v in values]


def preferred_device() -> str:
    """The device a kernel is checked on when none is named: the accelerator if there is one."""
    return next((d for d in ("cuda", "mps") if d in available_devices()), "cpu")


def ladder(device: str) -> list[Shape]:
    """The scale profile's shapes on ``device``: one head of every length and head dim, and two query
    heads over one key/value head (grouped) at the lengths where the CPU affords the second head."""
    lengths = SCALE_LENGTHS["cpu" if device == "cpu" else "gpu"]
    return [Shape(1, 2, 1, n, n, d) if device != "cpu" or n <= 4096 else Shape(1, 1, 1, n, n, d)
            for n in lengths for d in SCALE_HEAD_DIMS]


def rungs(shapes, *, dtypes=None, devices=None) -> list[Rung]:
    """Every (shape, dtype, device) to check: ``shapes`` (None: the scale ladder of each device) in
    ``dtypes`` (None: what kernels run in on each device) on ``devices`` (None: the preferred one)."""
    devices = list(devices or [preferred_device()])
    out = []
    for device in devices:
        for shape in (parse_shapes(shapes) if shapes is not None else ladder(device)):
            out += [Rung(shape, dtype, device) for dtype in (dtypes or DEVICE_DTYPES[device])]
    return out


def fixed_cases(prop, convention: str, rung: Rung, seed: int) -> list | str:
    """The cases ``prop`` checks at one rung, or the reason it does not apply there."""
    options = prop.at_scale
    if options is None:
        return "not checked at fixed shapes (its cases are drawn at small sizes: run without --shapes)"
    if isinstance(options, str):
        return options
    s = rung.shape
    common = dict(dtype=rung.dtype, device=rung.device)
    if prop.uses_multihead(convention):
        return [MhaCase(n_q=s.n_q, n_kv=s.n_kv, d_model=s.heads * s.d, n_heads=s.heads, mask=mask,
                        seed=seed + i, **common)
                for i, mask in enumerate(m for m in options.get("masks", ("none",)) if m in ("none", "causal"))]
    if options.get("segments"):  # a packed batch (the varlen convention): B sequences of up to NQ, NKV tokens
        return [packed_case(s, rung, seed)]
    kv_heads = 0
    if options.get("grouped"):
        if s.kv_heads == s.heads:
            return (f"shape {s} has as many key/value heads as query heads: give B,H,HKV,NQ,NKV,D with "
                    f"HKV < H to check grouped-query attention")
        kv_heads = s.kv_heads
    return [Case(batch=(s.batch, s.heads), n_q=s.n_q, n_kv=s.n_kv, d_k=s.d, d_v=s.d, values="normal", mask=mask,
                 seed=seed + i, kv_heads=kv_heads, **common)
            for i, mask in enumerate(options.get("masks", ("none",)))]


def packed_case(shape: Shape, rung: Rung, seed: int) -> Case:
    """A shape read as a packed batch for the varlen convention: B sequences of H query heads (HKV key/value heads)
    whose lengths are drawn from the seed, n_q in [1, NQ] and n_kv in [1, NKV], the first sequence the longest
    (max_seqlen_q = NQ, max_seqlen_k = NKV)."""
    gen = torch.Generator().manual_seed(seed)
    n_q = [shape.n_q] + torch.randint(1, shape.n_q + 1, (shape.batch - 1,), generator=gen).tolist()
    n_kv = [shape.n_kv] + torch.randint(1, shape.n_kv + 1, (shape.batch - 1,), generator=gen).tolist()
    return Case(batch=(shape.heads,), n_q=sum(n_q), n_kv=sum(n_kv), d_k=shape.d, d_v=shape.d, values="normal",
                seed=seed, kv_heads=shape.kv_heads if shape.kv_heads != shape.heads else 0,
                segments=tuple(zip(n_q, n_kv)), dtype=rung.dtype, device=rung.device)
