"""Error budgets earned by measurement, not guessed.

A target's output is compared with the float64 reference. The error it may have is what an
ordinary, correct implementation in the *same dtype* shows on the *same inputs*, times a
small factor, plus a floor of a few units in the last place of the output (the rounding any
arithmetic on the result would add):

    |target - ref64|_max  <=  FACTOR * |naive - ref64|_max  +  FLOOR_ULPS * floor_unit

where |naive - ref64| is the larger error of two ordinary orderings of the formula, and
floor_unit = eps(dtype) * max|V| * (sqrt(n_kv) + max|scaled score|), the score the largest the call computed.

This is how FlashAttention and PyTorch's SDPA tests judge kernels; see
``shared/anchors/attention-test-suites.md``. The factor and floor were calibrated on the
correct variants in ``tests/gallery`` (einsum, online softmax, float64 inside, SDPA,
logsumexp, chunked, ...): ``python benchmarks/calibrate_tolerance.py`` prints, per dtype and
variant, the worst error seen in units of floor_unit (at most 0.32 over 200 thorough cases
each) and relative to the naive error.

At lengths where the whole score matrix would not fit in one chunk (``chunked.fits``), both
naive implementations run a chunk of query rows at a time, in the same dtype and on the same
device: each row's arithmetic, hence its rounding, is what the one-shot form does, and the
memory stays O(chunk x n_kv + n x d).
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import chunked

FACTOR = 4.0
FLOOR_ULPS = 2.0


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def earned(naive: float, unit: float, *, factor: float = FACTOR) -> float:
    """The error budget, stated once: FACTOR * naive + FLOOR_ULPS * unit.

    ``naive``: the error an ordinary implementation in the same dtype showed against the float64 reference on the
    same inputs (the larger of its orders); ``unit``: one unit of rounding of the result (``floor_unit`` for an
    attention output). ``factor``: a larger one where a computation rounds more (gradients: GRAD_FACTOR)."""
    return factor * naive + FLOOR_ULPS * unit


def same_dtype_attention(q, k, v, mask=None, *, scale=None, first_scale=True, softcap=None, fused=False):
    """The seed's formula in the inputs' dtype and device: the one formula every budget samples ordinary
    rounding with, in one of its orders. ``first_scale``: the scale applied to Q first (FlashAttention's
    ``reorder_ops``: its rounding differs from the float64 reference even on float64 inputs), else to the
    scores; ``softcap``: cap * tanh(s / cap) before the mask; ``fused``: torch.softmax, else exp and sum."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1) if first_scale else q @ k.transpose(-2, -1) * scale  # [..., Tq, Tk]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    if fused:
        return torch.softmax(scores, dim=-1) @ v  # [..., Tq, Dv]
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # [..., Tq, Tk]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v  # [..., Tq, Tk] x [..., Tk, Dv] -> [..., Tq, Dv]


def naive_attention(q, k, v, mask=None, *, scale=None):
    """The formula with the scale applied to Q first, softmax as exp and sum."""
    return same_dtype_attention(q, k, v, mask, scale=scale)


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in float64; NaN or inf anywhere counts as an infinite error.

    Computed where both live when they share a device with float64 (a long output stays on its
    GPU), on the CPU otherwise."""
    same = got.device == ref.device and got.device.type != "mps"
    device = got.device if same else "cpu"
    diff = got.detach().to(device, torch.float64) - ref.detach().to(device, torch.float64)
    if diff.numel() == 0:
        return 0.0
    largest = diff.abs_().max().item()  # NaN propagates through max (inf - inf is NaN): one pass, no isfinite
    return largest if math.isfinite(largest) else math.inf


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or inf in ``t``: its largest and smallest entries (NaN propagates through both), two passes that
    take a tenth of ``torch.isfinite(t).all()`` on the CPU."""
    t = t.detach()
    return not t.numel() or (math.isfinite(t.amax().item()) and math.isfinite(t.amin().item()))


def seed_attention(q, k, v, mask=None, *, scale=None):
    """The seed's formula verbatim, in the inputs' dtype: a second sample of ordinary rounding."""
    return same_dtype_attention(q, k, v, mask, scale=scale, first_scale=False, fused=True)


def by_rows(impl, q, k, v, mask=None, *, scale=None, causal=False, causal_alignment="top-left"):
    """``impl(q, k, v, mask)`` [..., Tq, Dv] in the inputs' dtype, in chunks of query rows when the
    whole score matrix does not fit in one (``causal``: the causal mask of each chunk's rows)."""
    if chunked.fits(q, k, v, mask) and not causal:
        return impl(q, k, v, mask, scale=scale)
    batch = chunked.batch_shape(q, k, v, mask)
    out = torch.empty(*batch, q.shape[-2], v.shape[-1], dtype=q.dtype, device=q.device)  # [..., Tq, Dv]
    n_q, n_kv = q.shape[-2], k.shape[-2]
    offset = reference.key_offset(n_q, n_kv, causal_alignment)
    for index, q_e, k_e, v_e, mask_e in chunked.elements(q, k, v, mask):
        for rows in chunked.row_chunks(n_q, n_kv, chunked.chunk_bytes_for(q.device)):
            m = chunked.row_mask(mask_e, rows)  # [c or 1, Tk]
            if causal:
                positions = torch.arange(rows.start, rows.stop, device=q.device) + offset  # [c]
                m = reference.fold(m, reference.visible(positions, n_kv))  # [c, Tk]
            out[index][rows] = impl(q_e[rows], k_e, v_e, m, scale=scale)  # [c, Dv]
    return out


def naive_error(q, k, v, mask, ref_out, *, scale=None, causal=False, causal_alignment="top-left") -> float:
    """The larger error of two ordinary same-dtype implementations; one alone can be lucky."""
    errors = [max_error(by_rows(impl, q, k, v, mask, scale=scale, causal=causal, causal_alignment=causal_alignment),
                        ref_out) for impl in (naive_attention, seed_attention)]
    finite = [e for e in errors if math.isfinite(e)]
    return max(finite) if finite else 0.0  # both overflowed: judge by the floor alone


def max_score(q, k, mask=None, *, scale=None, causal=False, causal_alignment="top-left") -> float:
    """max |scale * q_i . k_j| over the entries a query may attend, in float64 (a bool mask's False, a float mask's
    -inf and the causal future left out), a chunk of query rows at a time: what the call really computed."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(scale)
    device, n_q, top = chunked.compute_device(q), q.shape[-2], 0.0
    for _, q_e, k_e, _, mask_e in chunked.elements(q, k, k, mask):
        k64 = k_e.detach().to(device, torch.float64)  # [Tk, Dk]
        for rows in chunked.row_chunks(n_q, k.shape[-2], chunked.chunk_bytes_for(device)):
            scores, _ = chunked.chunk_scores(q_e[rows].detach().to(device, torch.float64), k64, None, rows, n_q,
                                             scale=scale, causal=causal, causal_alignment=causal_alignment)  # [c, Tk]
            allowed = torch.isfinite(scores)  # [c, Tk]: the causal future is -inf
            if mask_e is not None:
                m = chunked.row_mask(mask_e, rows).to(device)  # [c or 1, Tk]
                allowed &= m if m.dtype == torch.bool else ~torch.isneginf(m)
            if allowed.any():
                top = max(top, scores.abs()[allowed].max().item())
    return top


def floor_unit(q, k, v, mask=None, *, scale=None, causal=False, causal_alignment="top-left") -> float:
    """eps(dtype) * max|V| * (sqrt(n_kv) + max|scaled score|).

    sqrt(n_kv): rounding in a sum of n_kv weighted values. max|score|: a score s carries a
    rounding error of about eps * |s|, and the softmax passes it on to the weights. The score is
    the largest the call computed (:func:`max_score`), not a bound: max|q| max|k| d scale is 143.9 at
    128 x 256, d 64, where the largest is 4.28, a budget loose enough to pass a kernel that reads
    the wrong keys. Where Q and K do not broadcast (grouped heads), that bound.
    """
    if not v.numel() or not k.shape[-2]:
        return eps(q.dtype)
    try:
        score = max_score(q, k, mask, scale=scale, causal=causal, causal_alignment=causal_alignment)
    except RuntimeError:  # grouped heads: Q's and K's head dims differ
        score = q.detach().abs().amax().item() * k.detach().abs().amax().item() * q.shape[-1] * (
            1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(scale))
    score = score if math.isfinite(score) else 1e6
    v_scale = max(1.0, v.detach().abs().max().item())
    return eps(q.dtype) * v_scale * (math.sqrt(k.shape[-2]) + min(score, 1e6))


def budget(q, k, v, mask, ref_out, *, scale=None, causal=False, causal_alignment="top-left") -> float:
    """The largest error a correct implementation may show on these inputs (``causal``: under the
    causal mask of that alignment, as ``reference.attention`` takes it)."""
    naive = naive_error(q, k, v, mask, ref_out, scale=scale, causal=causal, causal_alignment=causal_alignment)
    return earned(naive, floor_unit(q, k, v, mask, scale=scale, causal=causal, causal_alignment=causal_alignment))


def same_dtype_lse(q, k, mask=None, *, scale=None, first_scale=True, softcap=None):
    """logsumexp of the scaled scores [..., Tq] in the inputs' dtype and device, the row max subtracted first (as any
    kernel does): the one formula an LSE budget samples ordinary rounding with. q [..., Tq, D], k [..., Tk, D], mask
    bool [..., Tq, Tk]; ``first_scale``, ``softcap``: as in same_dtype_attention; -inf for a row with no key."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1) if first_scale else q @ k.transpose(-2, -1) * scale  # [..., Tq, Tk]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)  # [..., Tq, 1]
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)  # a row with no key: exp(-inf) = 0
    return (top + torch.log(torch.exp(scores - top).sum(dim=-1, keepdim=True))).squeeze(-1)  # [..., Tq]


def lse_budget(q, k, mask, ref_lse, lse_dtype, *, scale=None, softcap=None) -> float:
    """The largest error a correct kernel's log-sum-exp may show on these inputs (every row with a key to attend):

        FACTOR * |naive - ref64|_max  +  FLOOR_ULPS * (eps(dtype) (max|scaled score| + sqrt(n_kv)) + eps(lse) max|lse|)

    where naive is same_dtype_lse in both orders, each rounded to ``lse_dtype`` (the dtype the kernel returns its
    LSE in: float32 for half-precision inputs in flash-attn, and a float64 input's LSE may come back in float32).
    The floor: a score s carries eps |s| of rounding, which d lse / d s_j = softmax_j passes on at most whole; the
    sum of n_kv exponentials rounds by about eps sqrt(n_kv); the LSE's own rounding is eps(lse) |lse|."""
    errors = [max_error(same_dtype_lse(q, k, mask, scale=scale, first_scale=first, softcap=softcap).to(lse_dtype),
                        ref_lse) for first in (True, False)]
    naive = max((e for e in errors if math.isfinite(e)), default=0.0)
    if not q.numel() or not k.shape[-2]:
        return earned(naive, eps(lse_dtype))
    factor = 1.0 / math.sqrt(q.shape[-1]) if scale is None else abs(scale)
    scores = (q.detach().double() @ k.detach().double().transpose(-2, -1) * factor).abs()  # [..., Tq, Tk]
    score = scores.masked_fill(~mask, 0.0).max().item() if mask is not None else scores.max().item()
    score = min(score, softcap) if softcap else min(score, 1e6)
    top = ref_lse[torch.isfinite(ref_lse)].abs().max().item() if torch.isfinite(ref_lse).any() else 0.0
    unit = eps(q.dtype) * (score + math.sqrt(k.shape[-2])) + eps(lse_dtype) * max(1.0, top)
    return earned(naive, unit)


def naive_multihead(x_q, x_kv, weights, n_heads, mask=None):
    """The seed's multi-head module, in the inputs' dtype: the noise floor for multi-head outputs."""
    d_model = x_q.shape[-1]

    def split(t):  # [T, D] -> [H, T, Dh]
        return t.view(t.shape[0], n_heads, d_model // n_heads).transpose(0, 1)

    W = weights
    heads = naive_attention(split(x_q @ W["W_Q"].T), split(x_kv @ W["W_K"].T), split(x_kv @ W["W_V"].T), mask)
    return heads.transpose(0, 1).reshape(x_q.shape[0], d_model) @ W["W_O"].T  # [Tq, D]


def multihead_budget(x_q, x_kv, weights, n_heads, mask, ref_out) -> float:
    """The largest error a correct multi-head module may show on these inputs."""
    naive_err = max_error(naive_multihead(x_q, x_kv, weights, n_heads, mask), ref_out)
    naive_err = naive_err if math.isfinite(naive_err) else 0.0
    scale = max(1.0, ref_out.abs().max().item()) if ref_out.numel() else 1.0
    unit = eps(x_q.dtype) * scale * (math.sqrt(x_kv.shape[0]) + math.sqrt(x_q.shape[-1]))
    return earned(naive_err, unit)


def softcap_attention(q, k, v, mask, cap: float, *, first_scale: bool, scale=None):
    """The ordinary formula under logit soft-capping (cap * tanh(s / cap) before the mask), in the inputs'
    dtype, with the scale applied to Q first (``first_scale``) or to the scores."""
    return same_dtype_attention(q, k, v, mask, scale=scale, first_scale=first_scale, softcap=cap, fused=True)


def softcap_budget(q, k, v, mask, ref_out, cap: float) -> float:
    """The budget under logit soft-capping: the two ordinary orderings of the formula, capped, in the inputs'
    dtype; the floor's score term is at most the cap."""
    errors = [e for e in (max_error(softcap_attention(q, k, v, mask, cap, first_scale=first), ref_out)
                          for first in (True, False)) if math.isfinite(e)]
    capped_unit = eps(q.dtype) * max(1.0, v.detach().abs().max().item() if v.numel() else 1.0) * (math.sqrt(k.shape[-2]) + cap)
    return earned(max(errors, default=0.0), min(floor_unit(q, k, v, mask), capped_unit))
