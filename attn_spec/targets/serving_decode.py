"""The ``decode`` convention: a KV-cache decoding kernel with flash-attn's signature, detected as it is.

    out = flash_attn_with_kvcache(q [B, S_new, H, D], k_cache [B, S_c, H_kv, D], v_cache [B, S_c, H_kv, D],
                                  k=None, v=None,  # [B, S_new, H_kv, D]: appended in place at cache_seqlens
                                  cache_seqlens=None,  # int32 [B]: rows of the cache already filled
                                  cache_leftpad=None,  # int32 [B]: the first row attended
                                  block_table=None,  # int32 [B, max_blocks]: a paged cache's pages, in order
                                  softmax_scale=None, causal=False, return_softmax_lse=False, ...)

Attended keys of batch element b: cache rows [leftpad_b, seqlens_b + S_new), after k and v are written at
rows [seqlens_b, seqlens_b + S_new). Causal is aligned bottom-right: query i sees the keys up to
n_keys_b - S_new + i, so decoding equals the last S_new rows of full causal attention. With
``return_softmax_lse`` the kernel returns ``(out, lse [B, H, S_new])``. A kernel without this signature (SDPA
with ``causal_lower_right``, say) is wrapped in a function that has it (examples/serving_kernels.py).

A kernel whose signature names ``block_table`` is also called with paged caches ``[num_blocks, page, H_kv, D]``
(properties/paged.py): row r of element b lies in page ``block_table[b, r // page]`` at offset ``r % page``, and
a length past the block table's capacity ``max_blocks * page`` must raise.

The header reports what the kernel does, probed on tiny inputs: the causal alignment, whether it writes the
cache, and, where it returns an LSE, its base (e or 2) and the LSE of a row with no key to attend (-inf is
neutral in a merge; flash-attn's +inf and the CPU flash op's 0 are not). That last probe runs in a forked child
(attn_spec.targets.forked): a kernel may die on zero keys.
"""
from __future__ import annotations

import math

import torch

from attn_spec.failures import fail
from attn_spec.errors import Unsupported
from attn_spec.targets.base import Target, _call, parameter_names
from attn_spec.targets.forked import in_child
from attn_spec.vocabulary import Traits

F64 = torch.float64
ARGUMENTS = ("k", "v", "cache_seqlens", "cache_leftpad", "block_table", "softmax_scale", "causal", "return_softmax_lse",
             "num_splits")
NAMED_ONLY = {"block_table", "num_splits"}  # passed only to a kernel that names them (not through **kwargs)


class DecodeTarget(Target):
    """``fn(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_leftpad=None, softmax_scale=None,
    causal=False, return_softmax_lse=False)``: the arguments it does not declare are never passed."""

    traits = Traits("decode", "flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, "
                    "cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, "
                    "return_softmax_lse=False, ...)", kind="serving", trained=False, masks=(),
                    layout="bshd: q [B, S_new, H, D], caches [B, S_c, H_kv, D]", detect_rank=35)

    @staticmethod
    def detects(obj, names) -> bool:
        return bool(names) and {"k_cache", "v_cache"} <= set(names)

    def __init__(self, obj, name, masks=None, **kwargs):
        super().__init__(obj, name, masks, **kwargs)
        names = parameter_names(obj) or ()
        # **kwargs takes every argument but block_table: a paged cache only where the signature names it
        self.accepts = {a for a in ARGUMENTS if a in names} if "kwargs" not in names else set(ARGUMENTS) - NAMED_ONLY
        self.log = None  # a list while a failure is replayed (attn_spec.diagnosis.serving): every call kept
        self.probed = None

    def _attend(self, q, k, v, mask, **options):
        raise Unsupported("a decode kernel is checked by the decode properties (attn-spec list)", total=True)

    def lacks_option(self, key):
        return "a decode kernel is checked by the decode properties"

    def decode(self, q, k_cache, v_cache, cache_seqlens, k=None, v=None, cache_leftpad=None, *, causal=True,
               scale=None, lse=False, block_table=None, num_splits=None):
        """One call of the kernel: ``out`` [B, S_new, H, D], or ``(out, lse [B, H, S_new])`` with ``lse``. The caches
        are the caller's tensors ([num_blocks, page, H_kv, D] with ``block_table``), written in place by a kernel
        that appends k and v."""
        given = {"k": k, "v": v, "cache_seqlens": cache_seqlens, "cache_leftpad": cache_leftpad,
                 "block_table": block_table, "softmax_scale": scale, "causal": causal or None,
                 "return_softmax_lse": lse or None, "num_splits": num_splits}
        given = {key: value for key, value in given.items() if value is not None}
        missing = [key for key in given if key not in self.accepts]
        if missing:
            raise Unsupported(f"{self.name} takes no {', '.join(missing)} argument", total=True)
        before = [t.clone() for t in (q, k_cache, v_cache)] if self.log is not None else None
        call = f"{self.name}(q, k_cache, v_cache{''.join(f', {key}=...' for key in given)})"
        self.calls += 1
        with torch.no_grad():
            result = _call(lambda: self.obj(q, k_cache, v_cache, **given), (), call, self.state)
        out, found_lse = result if lse and isinstance(result, (tuple, list)) else (result, None)
        expected = (*q.shape[:3], v_cache.shape[-1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected:
            fail(f"{list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}", what="the output",
                 expected=f"a tensor of shape {list(expected)}: [B, S_new, H, D]", call=call,
                 cause="a decode kernel returns out [B, S_new, H, D] (and the LSE with return_softmax_lse=True)")
        if self.log is not None:
            self.log.append({"q": before[0], "k_cache": before[1], "v_cache": before[2], "cache_seqlens": cache_seqlens,
                             "k": k, "v": v, "cache_leftpad": cache_leftpad, "block_table": block_table,
                             "causal": causal, "scale": scale, "num_splits": num_splits,
                             "out": out.detach().clone(), "k_after": k_cache.detach().clone(),
                             "v_after": v_cache.detach().clone(), "lse": natural_log(found_lse, self.probed)})
        return (out, found_lse) if lse else out

    def behaviour(self) -> dict:
        """Probed once on tiny float64 inputs: causal alignment, whether it writes the cache, whether NaN in an unread row
        reaches the output, the LSE's base and empty-row value, page sizes, grouped heads."""
        if self.probed is None:
            self.probed = {}  # filled in PROBES' order: a probe may read those before it (unread-nan: page-sizes)
            for key, probe in PROBES.items():
                self.probed[key] = _safely(probe, self)
        return self.probed

    def notes(self):
        found = self.behaviour()
        return [f"decode: causal alignment {found['causal-alignment']}, writes the cache: {found['writes-cache']}, "
                f"NaN in unread cache rows: {found['unread-nan']}, LSE: {found['lse-base']}, LSE of an empty row: {found['lse-empty-row']}", "calls: q, k, v [B, S, H, D]; caches [B, S_c, H_kv, D]; "
                f"arguments it takes: {', '.join(sorted(self.accepts)) or 'none'}; grouped heads (H_kv < H): "
                f"{found['grouped-heads']}; paged caches: {self.paged()}"
                + (f", page sizes: {found['page-sizes']}" if "block_table" in self.accepts else "")]

    def draws(self) -> dict:
        """What its cases draw (attn_spec.targets.capabilities.Supports): grouped K/V heads where it takes them, pages
        in multiples of the smallest page size it takes (none where it takes no block table)."""
        return {"gqa": self.behaviour()["grouped-heads"] == "yes",
                "page_granule": page_granule(self) if "block_table" in self.accepts else 0}

    def paged(self) -> str:
        """Whether the kernel is called with paged caches: it is when its signature takes block_table."""
        if "block_table" in self.accepts:
            return "yes (block_table [B, max_blocks] over caches [num_blocks, page, H_kv, D])"
        return "no (it takes no block_table)"


def natural_log(lse, probed):
    """A returned LSE as natural logs, in its own dtype (base 2 where the header's probe found it), for the record a
    replay keeps; None where no LSE tensor came back."""
    if not isinstance(lse, torch.Tensor):
        return None
    return lse.detach() * math.log(2) if (probed or {}).get("lse-base") == "2" else lse.detach().clone()


def _safely(probe, target) -> str:
    try:
        return probe(target)
    except Unsupported:
        return "n/a (an argument it does not take)"
    except Exception as exc:  # noqa: BLE001 - the target's exception, reported in the header
        return f"raises ({type(exc).__name__})"


def _tiny():
    """q = 0 over one head, one query, a cache of 3 rows whose values are 1, 2, 3: each weighting is readable."""
    q = torch.zeros(1, 1, 1, 1, dtype=F64)  # [B, S, H, D]
    k_cache = torch.zeros(1, 4, 1, 1, dtype=F64)  # [B, S_c, H, D]
    v_cache = torch.tensor([1.0, 2.0, 3.0, 0.0], dtype=F64).reshape(1, 4, 1, 1)
    return q, k_cache, v_cache, torch.tensor([3], dtype=torch.int32)


def causal_alignment(target) -> str:
    """One query over 3 keys, causal: bottom-right sees all three (mean 2), top-left only the first (1)."""
    q, k_cache, v_cache, seqlens = _tiny()
    out = target.decode(q, k_cache, v_cache, seqlens, causal=True).to(F64).flatten()
    return {2.0: "bottom-right", 1.0: "top-left"}.get(round(out.item(), 6), f"other (out {out.item():.4g})")


def writes_cache(target) -> str:
    """Append one row (k = 0, v = 7) to a cache of 3 (+ 1 spare): the kernel writes it in place somewhere, or not
    (where is append-writes-exactly's to check)."""
    q, k_cache, v_cache, seqlens = _tiny()
    k_cache, v_cache = torch.cat([k_cache, k_cache], 1), torch.cat([v_cache, v_cache], 1)  # [1, 8, 1, 1]
    k_new, v_new = torch.zeros(1, 1, 1, 1, dtype=F64), torch.full((1, 1, 1, 1), 7.0, dtype=F64)
    target.decode(q, k_cache, v_cache, seqlens, k_new, v_new, causal=True)
    return "yes" if (v_cache == 7.0).any() else "no"


def unread_nan(target) -> str:
    """NaN in K and V of the cache row past cache_seqlens (no query may attend it): "ignored", or "propagates" where a
    kernel multiplies every row's value by its weight, 0 for that row (0 * NaN = NaN: FlexAttention's eager path, which
    materialises the scores over the whole cache). A convention, like the dense ``masked-nan``: where it propagates, the
    properties that poison unread rows fill them with stale finite values instead (a real read still moves the output).
    A kernel whose output also moves with a finite value there reads the row: "read (a bug: ...)", NaN kept."""
    q, k_cache, v_cache, seqlens = _tiny()
    call, clean = _unread_call(target)
    k_cache[:, 3], v_cache[:, 3] = STALE, STALE  # row 3 of 4: past cache_seqlens = 3
    if not torch.equal(call(q, k_cache, v_cache, seqlens), clean):
        return "read (a bug: cache-outside-invariance says where)"
    k_cache[:, 3], v_cache[:, 3] = math.nan, math.nan
    return "ignored" if torch.isfinite(call(q, k_cache, v_cache, seqlens)).all() else "propagates"


def _unread_call(target):
    """How unread_nan calls the kernel on its 4-row cache (as is, or, for a kernel that takes only paged caches, as
    pages of the size the page-sizes probe found, the rows past the 4th filled like the 4th), and the output of that
    call on the clean cache."""
    q, k_cache, v_cache, seqlens = _tiny()
    try:
        clean = target.decode(q, k_cache.clone(), v_cache.clone(), seqlens, causal=True)
        return (lambda q, k, v, lengths: target.decode(q, k.clone(), v.clone(), lengths, causal=True)), clean
    except Exception:  # noqa: BLE001 - a kernel that wants a block table (or raises anyway: asked below again)
        if "block_table" not in target.accepts:
            raise
    size = page_granule(target)
    pages = -(-4 // size)
    table = torch.arange(pages, dtype=torch.int32)[None]  # [1, pages]

    def paged(q, k, v, lengths):
        def pool(t):  # [1, 4, 1, 1] -> [pages, size, 1, 1], the rows past the 4th like the 4th
            rows = torch.cat([t, t[:, 3:].expand(1, pages * size - 4, 1, 1)], 1)  # [1, pages * size, 1, 1]
            return rows.reshape(pages, size, 1, 1).clone()
        return target.decode(q, pool(k), pool(v), lengths, causal=True, block_table=table)
    return paged, paged(q, k_cache, v_cache, seqlens)


def unread_fill(target) -> tuple[float, str]:
    """What the properties write into rows no query may attend, and its name for their messages: NaN (any read
    shows), or a stale finite value where the kernel's probe found that NaN there propagates through a zero weight
    (a read with nonzero weight still shows)."""
    if target.behaviour().get("unread-nan") == "propagates":
        return STALE, f"{STALE:g}"
    return math.nan, "NaN"


STALE = 100.0  # unlike every drawn value (|x| <= a few units), so a read with any nonzero weight moves the output


def lse_base(target) -> str:
    """q = 0 over 3 keys: the LSE is ln 3 in base e, log2 3 in base 2."""
    if "return_softmax_lse" not in target.accepts:
        return "not returned"
    q, k_cache, v_cache, seqlens = _tiny()
    _, lse = target.decode(q, k_cache, v_cache, seqlens, causal=True, lse=True)
    if lse is None:
        return "not returned"
    return which_base(lse.to(F64).flatten()[0].item())


def which_base(value: float) -> str:
    """The base of an LSE read as ``value`` for 3 keys of equal score: "e" (ln 3) or "2" (log2 3), within float32's
    rounding (a float32 log2 3 and a float64 one differ in the 7th digit), else "other (value)"."""
    for base, exact in (("e", math.log(3)), ("2", math.log2(3))):
        if abs(value - exact) <= 1e-5:
            return base
    return f"other ({value:.4g})"


def lse_empty_row(target) -> str:
    """cache_seqlens = 0 and nothing appended: no key to attend. Its LSE is -inf (the empty state of a merge), or
    a value that is not neutral when merged (+inf, 0); the call runs in a forked child (it may crash)."""
    if "return_softmax_lse" not in target.accepts:
        return "not returned"
    q, k_cache, v_cache, _ = _tiny()

    def call():
        _, lse = target.decode(q, k_cache, v_cache, torch.tensor([0], dtype=torch.int32), causal=True, lse=True)
        value = lse.to(F64).flatten()[0].item()
        return "-inf" if value == -math.inf else f"{value:g} (not neutral in a merge: the empty state's LSE is -inf)"
    return in_child(call)


PAGE_SIZES = (1, 16, 256)  # flash-attn 2 takes multiples of 256 only, FA3 and FlashInfer any


def page_sizes(target) -> str:
    """The smallest page size of PAGE_SIZES the kernel takes, on one query over a one-page pool of 3 filled rows:
    "any" (page 1 works), "multiples of N", or why none works. The paged properties draw multiples of it."""
    if "block_table" not in target.accepts:
        return "n/a (no block_table)"
    q, _, _, seqlens = _tiny()
    refused = []
    for size in PAGE_SIZES:
        pages = -(-3 // size)
        k_pool = torch.zeros(pages, size, 1, 1, dtype=F64)  # [num_blocks, page, H, D]
        v_pool = torch.arange(pages * size, dtype=F64).add(1).reshape(pages, size, 1, 1)  # rows 1, 2, 3, ...
        table = torch.arange(pages, dtype=torch.int32)[None]  # [1, pages]
        try:
            target.decode(q, k_pool, v_pool, seqlens, causal=True, block_table=table)
        except Exception as exc:  # noqa: BLE001 - the kernel refusing this page size
            refused.append(f"page {size}: {type(getattr(exc, 'exc', exc)).__name__}")
            continue
        return "any" if size == 1 else f"multiples of {size} ({', '.join(refused)})"
    return f"none of {', '.join(map(str, PAGE_SIZES))} ({', '.join(refused)})"


def page_granule(target) -> int:
    """The page size the paged properties draw multiples of: the probed one, or 1 where none was taken."""
    found = target.behaviour()["page-sizes"]
    return int(found.split()[2]) if found.startswith("multiples of") else 1


def grouped_heads(target) -> str:
    """One query of 4 heads over a cache of 3 rows of 2 key/value heads (flash-attn's caches [B, S_c, H_kv, D]):
    "yes" where the kernel takes it (the properties then draw grouped heads; whether it groups them right is theirs
    to check), "no" where it raises (they draw none)."""
    q, k_cache, v_cache, seqlens = _tiny()
    try:
        target.decode(q.expand(1, 1, 4, 1).contiguous(), k_cache.expand(1, 4, 2, 1).contiguous(),
                      v_cache.expand(1, 4, 2, 1).contiguous(), seqlens, causal=True)
    except Exception as exc:  # noqa: BLE001 - the kernel declining grouped heads
        return f"no ({type(getattr(exc, 'exc', exc)).__name__})"
    return "yes"


PROBES = {"causal-alignment": causal_alignment, "writes-cache": writes_cache, "lse-base": lse_base,  # in this order:
          "lse-empty-row": lse_empty_row, "page-sizes": page_sizes, "unread-nan": unread_nan,  # unread-nan reads
          "grouped-heads": grouped_heads}  # page-sizes
