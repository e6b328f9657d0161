"""Hypothesis strategies that generate the attention inputs most likely to expose bugs.

Every strategy draws a :class:`~attn_spec.checking.cases.Case` (shapes, dtype, device, seed), not raw
tensors: drawing a seed instead of every element keeps generation fast at d_k = 256 and
lets shrinking move towards small shapes, float64 and small-integer entries, which print as
readable matrices. Two or more batch dims are [B, H, n, d]: half of such cases hold Q, K and V
as models do, heads split from [B, n, H, d] by ``view(B, n, H, d).transpose(1, 2)`` (a
non-contiguous view, ``Case.layout == "heads"``).

Profiles set the budget:

========  ========  ==============================  ======================  ==========  ===========  ==========
profile   examples  lengths (n_q, n_kv)             head dims (d_k, d_v)    batch dims  page sizes   num_splits
========  ========  ==============================  ======================  ==========  ===========  ==========
quick     6         1..6                            1..6                    up to 2     1..6         0..3
default   15        1..8, or 17, 64, 113, 130       1..8, or 32, 59, 128,   up to 2     1..8, or 16  0..4
                                                    256
thorough  120       1..12, or up to 512             1..12, or up to 256     up to 3     1..12, or    0..8
                                                                                        16, 64, 256
========  ========  ==============================  ======================  ==========  ===========  ==========

Serving cases draw more (properties/serving/decode.py, paged.py, splits.py, varlen.py): a decode case each element's
cache length in [S_new, n_kv]; a paged one its page size (from the table; multiples of the kernel's smallest page
where it takes no other) and 0..3 spare pages in the pool; a split-KV one its ``num_splits`` (0: the kernel's own
choice); a varlen one its segments, each (n_q, n_kv) from 0 up. Where the kernel takes grouped heads, decode and
varlen cases draw H = g * H_kv query heads over H_kv = 1 or 2 key/value heads, g in 1..3. All of them shrink
(towards the shortest caches, page 1, no spare page, num_splits 0, no grouping), and the hand-picked edges
(page 1, a non-divisor, a page longer than the sequence; num_splits 1, 2, 3, 0; zero-length segments) are each
property's explicit examples.

Default and thorough also check each property's long examples (``Property.long_examples``): matches-reference's
is one case of 1531 queries and keys, d = 64, float32, scores far beyond exp's range (a kernel that skips the max
subtraction above some length overflows there) and judged on rows the kit draws after the call (checking.rows).
None of the lengths a profile draws or its examples use is all powers of two or all multiples of a tile.

A fourth profile, ``scale``, draws nothing: a check runs a fixed ladder of shapes
(``attn_spec.checking.shapes.ladder``: lengths 1k, 4k, 16k on the CPU, up to 128k on a GPU, head
dims 64, 128, 256), float32 on the CPU, bfloat16 and float16 on a GPU, with the properties that
apply at such sizes.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hypothesis import strategies as st

from attn_spec.errors import KitUsageError
from attn_spec.checking.cases import DTYPES, Case, MhaCase, available_devices


@dataclass(frozen=True)
class Profile:
    """How hard to look: examples per property and the sizes drawn."""

    name: str
    max_examples: int
    small: int  # lengths and dims are usually drawn from 1..small
    lengths: tuple[int, ...]  # ... and sometimes from these larger lengths
    dims: tuple[int, ...]  # ... and these larger head dims
    max_batch_dims: int
    magnitudes: tuple[float, ...]  # entry scales; large ones make the softmax nearly one-hot
    pages: tuple[int, ...] = ()  # paged caches: page sizes from 1..small, and sometimes these larger ones
    max_splits: int = 3  # split-KV decoding: num_splits from 0..max_splits
    ladder: bool = False  # check the fixed shapes of attn_spec.checking.shapes.ladder instead of drawing
    # Who shrinks a failure of a drawn case: Hypothesis (hundreds of candidates, the smallest case it can find), or
    # the kit's greedy shrinker that explicit examples get (attn_spec.checking.shrink: at most TRIES candidates)
    shrinker: str = "hypothesis"
    long: bool = False  # also each property's long examples (matches-reference: ~1.5k keys, scores that overflow exp)


PROFILES = {
    "quick": Profile("quick", 6, 6, (), (), 2, (1.0, 3.0), max_splits=3, shrinker="kit"),
    "default": Profile("default", 15, 8, (17, 64, 113, 130), (32, 59, 128, 256), 2, (1.0, 3.0, 8.0), pages=(16,),
                       max_splits=4, long=True),
    "thorough": Profile("thorough", 120, 12, (17, 64, 113, 130, 257, 512), (32, 59, 64, 111, 128, 256),
                        3, (0.1, 1.0, 3.0, 8.0), pages=(16, 64, 256), max_splits=8, long=True),
    # Draws like default when asked to (strategies.cases("scale")), but a check runs the ladder.
    "scale": Profile("scale", 15, 8, (17, 64, 113, 130), (32, 59, 128, 256), 2, (1.0, 3.0, 8.0), pages=(16,),
                     max_splits=4, ladder=True),
}


BLOCK_LENGTHS = (200,)  # drawn for a kernel with a head-dim envelope: no multiple of 16, 64 or 128, past 3 blocks of 64
MASK_KINDS = ("none", "random", "causal", "padding")  # padding: key-padding masks [..., 1, Tk]
MHA_MASK_KINDS = ("none", "random", "causal")  # a multi-head case draws no key-padding mask (MhaCase)


def get_profile(name: str) -> Profile:
    if name not in PROFILES:
        raise KitUsageError(f"profile={name!r}, but it must be one of {', '.join(PROFILES)}")
    return PROFILES[name]


def sizes(small: int, large: tuple[int, ...] = ()) -> st.SearchStrategy[int]:
    """Mostly 1..small, sometimes one of ``large``; shrinks towards 1."""
    base = st.integers(1, small)
    return st.one_of(base, st.sampled_from(large)) if large else base


def checked(values, allowed, what):
    """``values`` as a list, each one of ``allowed``; a KitUsageError naming the bad ones otherwise."""
    values = list(values)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise KitUsageError(f"{what}={values}, but each must be one of {', '.join(allowed)}")
    return values


def _frozen(value):
    """``value`` as a hashable key: lists and tuples as tuples, dicts as sorted items."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return value


def built_once(make):
    """``make``'s strategy built once per set of arguments and reused (a strategy is immutable, so it draws the
    same examples): building one costs Hypothesis a reading of the draw function's source (``st.composite``)
    and a validation, about 5 ms, paid before by every property of every check."""
    built: dict = {}

    @functools.wraps(make)
    def cached(profile="default", **options):
        key = (profile, _frozen(options))
        try:
            return built[key]
        except TypeError:  # an unhashable option: build it each time
            return make(profile, **options)
        except KeyError:
            built[key] = strategy = make(profile, **options)
            return strategy

    return cached


@built_once
def cases(profile: str | Profile = "default", *, dtypes=tuple(DTYPES), devices=None,
          masks=("none", "random", "causal"), cross: bool | None = None, batch: bool | None = None,
          min_n_kv: int = 1, square: bool = False, same_width: bool = False,
          max_length: int | None = None, segments: bool = False, cache: bool = False, pages: bool = False,
          page_granule: int = 1, splits: bool = False, grouped: int | None = None,
          head_dims: tuple[int, ...] | None = None) -> st.SearchStrategy[Case]:
    """Attention cases for one profile.

    - ``dtypes``: dtype names drawn from, first one preferred when shrinking (default all four).
    - ``devices``: device names (default every available device).
    - ``masks``: mask kinds drawn from: "none", "random", "causal".
    - ``cross``: True forces n_q != n_kv and d_v != d_k, False forces self-attention shapes,
      None draws both.
    - ``batch``: True forces leading batch/head dims, False forbids them, None draws both.
    - ``min_n_kv``: the fewest keys (probes that compare two keys need 2).
    - ``square``: n_kv = n_q (for targets that do self-attention only); ``same_width``: d_v = d_k.
    - ``max_length``: n_q and n_kv at most this (a target's probed max length: a fixed position buffer).
    - ``segments``: a packed batch of 1 to 4 sequences (the varlen convention), each (n_q, n_kv) drawn like
      the lengths but from 0 up (an empty sequence, or one with no key, is a case of its own); n_q and n_kv
      are their sums.
    - ``cache``: a batch of decode calls (batch[0] elements): each element's cache length in [min(n_q, n_kv), n_kv];
      ``pages``: a page size (a multiple of ``page_granule``, the kernel's smallest) and 0..3 spare pages;
      ``splits``: a num_splits in 0..the profile's max_splits.
    - ``head_dims``: d_k and d_v drawn from these only (a kernel's envelope, attn_spec.targets.envelope), smallest
      first; the large lengths then add BLOCK_LENGTHS, past the blocks kernels tile by.
    - ``grouped``: the batch dims from this one on are heads, and the last of them is drawn grouped: g * H_kv query
      heads over H_kv key/value heads (``kv_heads``; 0 where g = 1). None: never grouped.

    Examples shrink towards one query, one key, width 1, float64, integer entries.
    """
    prof = profile if isinstance(profile, Profile) else get_profile(profile)
    dtypes = checked(dtypes, DTYPES, "dtypes")
    devices = checked(devices or available_devices(), available_devices(), "devices")
    masks = checked(masks, MASK_KINDS, "masks")
    small = sizes(prof.small)
    length, dim, small_dim = sizes(prof.small, prof.lengths), sizes(prof.small, prof.dims), small
    if head_dims:  # a kernel's envelope: its own widths at every size, and lengths past its blocks
        length = sizes(prof.small, tuple(dict.fromkeys(prof.lengths + BLOCK_LENGTHS)))
        small_dim = dim = st.sampled_from(tuple(head_dims))
    batch_dims = st.lists(st.integers(1, 3), min_size=1 if batch else 0,
                          max_size=0 if batch is False else prof.max_batch_dims).map(tuple)

    # Strategies are built once, here: building one inside the draw costs a validation per example.
    large_sizes = st.sampled_from((False, False, False, True))
    kv_lengths = {big: s.filter(lambda n: n >= min_n_kv) if min_n_kv > 1 else s
                  for big, s in ((False, small), (True, length))}
    rest = st.fixed_dictionaries({
        "batch": batch_dims, "dtype": st.sampled_from(dtypes), "device": st.sampled_from(devices),
        "values": st.sampled_from(["integers", "normal"]), "magnitude": st.sampled_from(prof.magnitudes),
        "mask": st.sampled_from(list(masks)), "seed": st.integers(0, 2**16),
        "layout": st.sampled_from(["contiguous", "heads"])})
    segment = {big: st.tuples(s, s) for big, s in ((False, st.integers(0, prof.small)),
                                                     (True, st.one_of(st.integers(0, prof.small), length)))}
    packed = {big: st.lists(segment[big], min_size=1, max_size=4).map(tuple) for big in (False, True)}
    page_sizes = (sizes(prof.small, prof.pages) if page_granule == 1
                  else st.sampled_from((page_granule, 2 * page_granule)))  # the kernel's smallest page, or twice it
    paged = st.tuples(page_sizes, st.integers(0, 3))  # (page size, spare pages)
    split_counts = st.integers(0, prof.max_splits)
    grouping = st.tuples(st.integers(1, 2), st.integers(1, 3))  # (H_kv, g): shrinks to one head, no grouping

    @st.composite
    def draw(draw_):
        # One case in four may use the large sizes: they find other bugs (blocking, overflow)
        # but cost far more per example. Shrinks towards small.
        large = draw_(large_sizes)
        lengths, dims = (length, dim) if large else (small, small_dim)
        n_q, n_kv = draw_(lengths), draw_(kv_lengths[large])
        d_k, d_v = draw_(dims), draw_(dims)
        if cross is True:
            n_kv = n_kv if n_kv != n_q else n_q + 1
            d_v = d_v if d_v != d_k else next((d for d in head_dims or () if d != d_k), d_k + 1)
        elif cross is False:
            n_kv, d_v = n_q, d_k
        n_kv = max(n_kv, min_n_kv)
        if square:
            n_q = n_kv = max(n_q, n_kv)
        if same_width:
            d_v = d_k
        if max_length is not None:
            n_q, n_kv = min(n_q, max_length), min(n_kv, max_length)
        fields = draw_(rest)
        if segments:
            fields["segments"] = draw_(packed[large])
            n_q, n_kv = (sum(pair[i] for pair in fields["segments"]) for i in (0, 1))
        if grouped is not None and len(fields["batch"]) > grouped:
            kv_heads, group = draw_(grouping)
            if group > 1:
                fields["batch"], fields["kv_heads"] = fields["batch"][:-1] + (kv_heads * group,), kv_heads
        if cache:  # each element's sequence: S = min(n_q, n_kv) new tokens after L_b - S cached ones
            lengths = st.integers(min(n_q, n_kv), n_kv)
            fields["cache_lengths"] = tuple(draw_(lengths) for _ in range(fields["batch"][0]))
        if pages:
            fields["page_size"], fields["spare_pages"] = draw_(paged)
        if splits:
            fields["num_splits"] = draw_(split_counts)
        if len(fields["batch"]) < 2:
            fields["layout"] = "contiguous"  # the heads layout needs [..., B, H, n, d]
        return Case(n_q=n_q, n_kv=n_kv, d_k=d_k, d_v=d_v, **fields)

    return draw()


@built_once
def mha_cases(profile: str | Profile = "default", *, dtypes=tuple(DTYPES), devices=None,
              masks=("none", "random", "causal"), max_length: int | None = None) -> st.SearchStrategy[MhaCase]:
    """Multi-head cases: d_model = n_heads * d_head with 1..4 heads; shrinks towards 1 head (``max_length``: see cases)."""
    prof = profile if isinstance(profile, Profile) else get_profile(profile)
    dtypes = checked(dtypes, DTYPES, "dtypes")
    devices = checked(devices or available_devices(), available_devices(), "devices")
    masks = checked(masks, MHA_MASK_KINDS, "masks")
    length = sizes(prof.small, prof.lengths[:2])
    if max_length is not None:
        length = length.map(lambda n: min(n, max_length))
    return st.builds(
        lambda n_q, n_kv, d_head, n_heads, **kw: MhaCase(n_q=n_q, n_kv=n_kv, d_model=d_head * n_heads,
                                                         n_heads=n_heads, **kw),
        n_q=length, n_kv=length, d_head=sizes(prof.small, prof.dims[:2]), n_heads=st.integers(1, 4),
        dtype=st.sampled_from(dtypes), device=st.sampled_from(devices),
        mask=st.sampled_from(list(masks)), seed=st.integers(0, 2**16))
