"""Fixed shapes: check a target at the sizes it runs (``--shapes``, ``shapes=``, the ``scale`` profile).

A shape is ``B,H,N,D`` (self-attention: B sequences of H heads, N positions, head dim D),
``B,H,NQ,NKV,D`` (cross attention with NQ queries over NKV keys) or ``B,H,HKV,NQ,NKV,D`` (grouped-query attention
with HKV key/value heads). For a varlen kernel the same shape is a packed batch: B sequences of up to NQ queries
over up to NKV keys (lengths drawn from the seed, the first sequence the longest; ``packed_case``). For a decode
kernel it is ``B,H,[HKV,]S_NEW,S_CACHE,D[,page=P]``: B sequences of up to S_CACHE tokens in the cache, the last
S_NEW of each decoded (S_CACHE counts them; the first sequence the longest, the others' lengths drawn from the seed
in [S_NEW, S_CACHE]), a paged cache in pages of P rows (``decode_case``; default 16, or the kernel's smallest); on the
scale ladder a decode kernel decodes one new token over each length.
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

from dataclasses import dataclass, field, replace

import torch

from attn_spec.checking.cases import Case, MhaCase, available_devices
from attn_spec.errors import KitUsageError

# The dtypes a rung is checked in when none are asked for: what kernels run in on each device.
DEVICE_DTYPES = {"cpu": ("float32",), "cuda": ("bfloat16", "float16"), "mps": ("float16",)}

# The scale profile's ladder: every length with every head dim. On the CPU the float64 reference
# costs about 4 n^2 d flops per head (16k keys at d=256: 11 s on this 2-core machine).
SCALE_LENGTHS = {"cpu": (1024, 4096, 16384), "gpu": (1024, 4096, 16384, 32768, 65536, 131072)}
SCALE_HEAD_DIMS = (64, 128, 256)
# Entries of one [n_q, n_kv] mask the kit builds at a fixed shape (1 GiB of bool, 4 GiB once a target makes it a float
# bias): past it a causal or random mask case is not built, so the kit's memory stays O(n d) (is-causal checks
# causality through is_causal at any length, matches-reference a [B, 1, 1, n_kv] padding mask)
MASK_LIMIT = 2**30
USAGE = ("expected B,H,N,D, B,H,NQ,NKV,D or B,H,HKV,NQ,NKV,D with positive integers, a decode kernel's "
         "B,H,[HKV,]S_NEW,S_CACHE,D optionally followed by ,page=P (e.g. 1,8,4096,128, 1,32,8,1,32768,128 or "
         "4,32,8,1,4096,128,page=256)")


@dataclass(frozen=True)
class Shape:
    batch: int
    heads: int
    kv_heads: int
    n_q: int
    n_kv: int
    d: int
    page: int = 0  # a decode kernel's page size (",page=P"); 0: not given

    @classmethod
    def parse(cls, text) -> "Shape":
        """``"B,H,N,D"``, ``"B,H,NQ,NKV,D"`` or ``"B,H,HKV,NQ,NKV,D"``, each optionally followed by ``",page=P"`` (or a
        tuple of those ints); a KitUsageError otherwise."""
        if isinstance(text, Shape):
            return text
        fields = text.replace("x", ",").split(",") if isinstance(text, str) else list(text)
        paged = bool(fields) and str(fields[-1]).strip().startswith("page=")
        try:
            page = int(fields.pop().strip()[len("page="):]) if paged else 0
            parts = [int(x) for x in fields]
        except (TypeError, ValueError):
            parts = []
        if len(parts) in (4, 5):  # B,H,N,D or B,H,NQ,NKV,D: as many key/value heads as query heads
            b, h, *lengths, d = parts
            parts = [b, h, h, lengths[0], lengths[-1], d]
        if len(parts) != 6 or min(parts) < 1 or (paged and page < 1):
            raise KitUsageError(f"shape {text!r}: {USAGE}")
        shape = cls(*parts, page=page)
        if shape.heads % shape.kv_heads:
            raise KitUsageError(f"shape {text!r}: H={shape.heads} query heads is not a multiple of "
                                f"HKV={shape.kv_heads} key/value heads")
        return shape

    def __str__(self) -> str:
        page = f",page={self.page}" if self.page else ""
        if self.kv_heads == self.heads and self.n_q == self.n_kv:
            return f"{self.batch},{self.heads},{self.n_q},{self.d}{page}"
        if self.kv_heads == self.heads:
            return f"{self.batch},{self.heads},{self.n_q},{self.n_kv},{self.d}{page}"
        return f"{self.batch},{self.heads},{self.kv_heads},{self.n_q},{self.n_kv},{self.d}{page}"


@dataclass(frozen=True)
class Rung:
    shape: Shape
    dtype: str
    device: str
    ladder: bool = field(default=False, compare=False)  # a scale profile shape: a decode kernel decodes one token there

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
            out += [Rung(shape, dtype, device, ladder=shapes is None) for dtype in (dtypes or DEVICE_DTYPES[device])]
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
    masks = list(options.get("masks", ("none",)))
    square = [m for m in masks if m in ("causal", "random")]  # built [n_q, n_kv]; padding is [1, n_kv]
    if square and s.n_q * s.n_kv > MASK_LIMIT:
        masks = [m for m in masks if m not in square]
        if not masks:
            return (f"its {square[0]} mask would be [{s.n_q}, {s.n_kv}], {s.n_q * s.n_kv / 2**30:.0f} GiB of bool, past the "
                    f"kit's {MASK_LIMIT // 2**30} GiB per mask at fixed shapes (O(n d) memory): is-causal checks causality "
                    f"through is_causal at this length, the drawn sizes a mask argument")
    if prop.uses_multihead(convention):
        return [MhaCase(n_q=s.n_q, n_kv=s.n_kv, d_model=s.heads * s.d, n_heads=s.heads, mask=mask,
                        seed=seed + i, **common)
                for i, mask in enumerate(m for m in masks if m in ("none", "causal"))]
    if options.get("segments"):  # a packed batch (the varlen convention): B sequences of up to NQ, NKV tokens
        return [packed_case(s, rung, seed)]
    if options.get("cache"):  # a batch of decode calls (the decode convention)
        s = replace(s, n_q=1) if rung.ladder else s  # the scale ladder: one new token over each length
        if s.n_q > s.n_kv:
            return (f"shape {s} decodes S_NEW={s.n_q} new tokens per sequence, more than its S_CACHE={s.n_kv} tokens "
                    f"(S_CACHE counts the new ones): give B,H,[HKV,]S_NEW,S_CACHE,D with S_NEW <= S_CACHE")
        return [decode_case(s, rung, seed)]
    kv_heads = 0
    if options.get("grouped"):
        if s.kv_heads == s.heads:
            return (f"shape {s} has as many key/value heads as query heads: give B,H,HKV,NQ,NKV,D with "
                    f"HKV < H to check grouped-query attention")
        kv_heads = s.kv_heads
    return [Case(batch=(s.batch, s.heads), n_q=s.n_q, n_kv=s.n_kv, d_k=s.d, d_v=s.d, values="normal", mask=mask,
                 seed=seed + i, kv_heads=kv_heads, **common)
            for i, mask in enumerate(masks)]


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


def decode_case(shape: Shape, rung: Rung, seed: int) -> Case:
    """A shape read as a batch of decode calls: B sequences of H query heads (HKV key/value heads) of up to S_CACHE =
    NKV tokens, the last S_NEW = NQ of each decoded; the first sequence S_CACHE long, the others' lengths drawn from
    the seed in [S_NEW, S_CACHE]; pages of ``page`` rows where the kernel is paged (properties/serving/paged.py; 0: its
    default)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [shape.n_kv] + torch.randint(shape.n_q, shape.n_kv + 1, (shape.batch - 1,), generator=gen).tolist()
    return Case(batch=(shape.batch, shape.heads), n_q=shape.n_q, n_kv=shape.n_kv, d_k=shape.d, d_v=shape.d,
                values="normal", seed=seed, kv_heads=shape.kv_heads if shape.kv_heads != shape.heads else 0,
                cache_lengths=tuple(lengths), page_size=shape.page, spare_pages=1, dtype=rung.dtype, device=rung.device)
