"""Causes read from what a property measured on the formula: the output, the heads, the weights, the scale, the
masks, the batch, large and very negative scores, the softcap. Each function takes the facts a property named
(``because(key, **facts)``) and returns one sentence; :data:`READ` is their part of the table of
:mod:`attn_spec.diagnosis.causes`."""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import chunked, probes
from attn_spec.checking.tolerance import max_error
from attn_spec.diagnosis.mismatch import explain, output
from attn_spec.diagnosis.model import MISTAKES
from attn_spec.diagnosis.numbers import masked_share, weight_factor
from attn_spec.errors import Failure
from attn_spec.properties.informative import NOISY_CALLS, TRIVIALLY, ignored_inputs
from attn_spec.properties.inputs import near
from attn_spec.properties.multi_head import repeat_heads


# ---- the output against the reference (values)

def _output_differs(target, got, q, k, v, mask, budget, case) -> str:
    """The mismatch explained by a catalog model, or the inputs the output ignores."""
    return explain(target, got, q, k, v, mask, budget) or ignored_inputs(target, case)


def _ignores_inputs(names, noisy) -> str:
    """The inputs the output does not depend on (a vacuous pass: TRIVIALLY ends the sentence)."""
    return (f"the output varies from call to call, and its mean over {NOISY_CALLS} calls does not depend on {names}: "
            f"random numbers?" if noisy else
            f"the output does not depend on {names} (zeros, a constant, or an input returned as it is?)") + TRIVIALLY


def _values_nonlinear(target, q, k, v1, mask, out1, ref1, allowed) -> str:
    """Why the output is not linear in V: V normalised before the weighted sum, or a nonlinearity on it."""
    doubled = target.attend(q, k, (2 * v1.double()).to(v1), mask)
    return ("the output does not scale with V: V is normalised or divided by its max before the weighted sum"
            if max_error(doubled, out1) <= allowed and max_error(doubled, 2 * ref1) > allowed
            else "V passes through a nonlinearity (an activation or normalisation) before the weighted sum")


def _nonfinite_shape(target, case) -> str:
    """NaN out of a rectangular case: is it the shape, or does a square case give NaN too?"""
    square = case.replace(n_kv=case.n_q, d_v=case.d_k)
    try:
        out = target.attend(*square.tensors())
    except Failure:
        out = None
    if out is not None and not torch.isfinite(out).all():
        return ("the output has NaN or inf on square inputs too: not a matter of shape (an overflowing exp, a 0/0, "
                "or reads outside the inputs?)")
    return "a square shape (n_q == n_kv or d_v == d_k) is assumed somewhere"


def _heads_differ(got, x_q, x_kv, weights, case, mask, allowed) -> str:
    """Which classic multi-head mistake reproduces the target's output?"""
    W = {n: w.to("cpu", torch.float64) for n, w in weights.items()}
    x_q, x_kv = x_q.to("cpu", torch.float64), x_kv.to("cpu", torch.float64)
    h, d = case.n_heads, case.d_model
    dh = d // h

    def run(split, merge, scale, out_proj=True):
        q, k, v = split(x_q @ W["W_Q"].T), split(x_kv @ W["W_K"].T), split(x_kv @ W["W_V"].T)
        heads, _ = reference.attention(q, k, v, mask, scale=scale)
        concat = merge(heads)
        return concat @ W["W_O"].T if out_proj else concat

    def good_split(t):
        return t.view(t.shape[0], h, dh).transpose(0, 1)

    def good_merge(t):
        return t.transpose(0, 1).reshape(-1, d)

    def view_split(t):
        return t.reshape(h, t.shape[0], dh)

    def view_merge(t):
        return t.reshape(-1, d)

    s = 1 / math.sqrt(dh)
    candidates = [
        ("heads are split with view and no transpose (tokens mixed across heads)", run(view_split, good_merge, s)),
        ("heads are merged with view and no transpose", run(good_split, view_merge, s)),
        ("heads are split and merged with view and no transpose", run(view_split, view_merge, s)),
        ("the scale uses d_model instead of the per-head d_k", run(good_split, good_merge, 1 / math.sqrt(d))),
        ("W_O is not applied to the concatenated heads", run(good_split, good_merge, s, out_proj=False)),
    ]
    for cause, candidate in candidates:
        if max_error(got, candidate) <= max(allowed, 1e-3):
            return cause
    return "the heads are not independent attentions over their own slices"


# ---- the weights (softmax)

def _row_sums(sums, w, ref_w, allowed) -> str:
    """Why the rows of weights do not sum to 1: NaN, a softmax over queries, a factor, or no normalisation."""
    col_sums = w.double().sum(dim=-2)  # [..., Tk]
    n_q = w.shape[-2]
    return ("the weights have NaN or inf although every input is finite (0/0 or an overflowing exp?)"
            if not torch.isfinite(sums).all() else "weights sum over queries, not keys (softmax over dim -2?)"
            if n_q > 1 and max_error(col_sums, torch.ones_like(col_sums)) <= allowed * n_q
            else weight_factor(w, ref_w) or "the weights are not normalised by the sum over keys")


SHIFT_MISTAKES = ("relu-normalised", "keys-normalised", "max-over-queries")  # catalog weightings a key shift changes


def _key_shift(before, after, q, k, shifted, v, mask, allowed) -> str:
    """The classic weighting (a model of the catalog, attn_spec.diagnosis) that reproduces the target's outputs
    before and after the shift, in the model's own words."""
    def reproduces(got, out):  # NaN where the mistake gives NaN counts as reproduced
        if out is None:  # the model raised on these inputs
            return False
        limit = max(allowed, 1e-3 * max(1.0, out.nan_to_num(0.0).abs().max().item()))
        return max_error(got.nan_to_num(0.0), out.nan_to_num(0.0)) <= limit

    for mistake_id in SHIFT_MISTAKES:
        if reproduces(before, output(mistake_id, q, k, v, mask)) and \
                reproduces(after, output(mistake_id, q, shifted, v, mask)):
            return MISTAKES[mistake_id].cause_for()
    if torch.isfinite(before).all() and not torch.isfinite(after).all():
        return "shifted scores overflow exp: subtract each row's max before exp"
    return "the weights are not a softmax of the scores (a shift of every score in a row changes them)"


# ---- the scale

def _scale_named(name) -> str:
    """The scale the probe recovered, named (attn_spec.checking.probes.name_scale)."""
    return (f"scores are scaled by {name} instead of 1/sqrt(d_k)" if not name.startswith(("unreadable", "negative"))
            else f"the scale is {name}")


def _scale_argument(got, q, k, v, mask, scale, allowed) -> str:
    """How the scale argument is misused: ignored, applied on top of the default, split, or not one factor."""
    default, _ = reference.attention(q, k, v, mask)
    both, _ = reference.attention(q, k, v, mask, scale=scale / math.sqrt(q.shape[-1]))
    return ("the scale argument is ignored (the default 1/sqrt(d_k) is used)"
            if max_error(got, default) <= allowed
            else "the default 1/sqrt(d_k) is applied on top of the given scale"
            if max_error(got, both) <= allowed
            else "a negative scale breaks the computation (sqrt(scale) split between Q and K?)"
            if scale < 0 else "the given scale is not applied to Q K^T as a single factor")


# ---- masks

def _causal_leak(w, future) -> str:
    """Why queries see future keys under the causal mask: polarity, a shifted diagonal, a finite fill, or none."""
    diag = torch.diagonal(w, dim1=-2, dim2=-1)
    return ("the mask is applied with inverted polarity (True taken as 'ignore'): masked keys get the weight"
            if w.masked_fill(future, 0.0).abs().max() < 1e-3
            else "the causal mask is shifted by one (the diagonal is masked)" if diag.abs().max() < 1e-3
            else masked_share(w, ~future) or "the mask is ignored or applied after the softmax")


def _mask_leak(w, allowed, q, k, mask) -> str:
    """Why masked keys got weight: inverted polarity, an ignored mask, or a finite fill value."""
    mixed = (~allowed).any(dim=-1)  # [..., Tq] rows with some masked key
    on_allowed = w.masked_fill(~allowed, 0.0).nan_to_num(0.0).sum(dim=-1)  # [..., Tq]
    if mixed.any() and on_allowed[mixed].abs().max() < 1e-3:
        return "the mask is applied with inverted polarity (True taken as 'ignore'): masked keys get all the weight"
    if max_error(w, reference.attention(q, k, k, None)[1]) < 1e-3:
        return "the mask is ignored"
    shared = masked_share(w, allowed)
    if shared:
        return shared
    if w.masked_fill(allowed, 0.0).nan_to_num(1.0).abs().max() < 1e-2:
        return "masked keys keep a small weight: the fill value is finite and too small (use -inf or finfo.min)"
    return "the mask does not reach these keys (broadcast over the wrong dims, or applied to the wrong axis?)"


def _masked_keys_count(got) -> str:
    """Why moving K at masked positions moves the output: 0/0 after the softmax, or a mask the scores overwhelm."""
    return ("masked keys' large scores still enter the softmax, so the allowed weights underflow to 0/0 "
            "(mask applied after the softmax, then renormalised?)" if not torch.isfinite(got).all() else
            "masked keys still count: the mask is applied after the softmax, or as a finite additive "
            "bias that large scores overwhelm (fill with -inf or finfo.min)")


def _float_mask_read(got, q, k, v, mask) -> str:
    """How a 0 / -inf float mask is misread: as a keep-mask, or not added to the scores."""
    return ("the float mask is read as a keep-mask (positions equal to 0 are masked)"
            if max_error(got, reference.attention(q, k, v, ~mask)[0]) < 1e-3 else
            "a float mask is not added to the scores as a bias")


def _float_mask_scaled(got, q, k, v, bias, allowed) -> str:
    """A finite float mask scaled with the scores, or not added to them."""
    scaled = reference.attention(q, k, v, bias / math.sqrt(q.shape[-1]))[0]
    return ("the float mask is scaled with the scores ((QK^T + mask) / sqrt(d_k)); add it after scaling"
            if max_error(got, scaled) <= max(allowed, 1e-3) else
            "a finite float mask is not added to the scaled scores as a bias")


def _causal_rows(got, q, k, v, mask, allowed) -> str:
    """Which wrong mask reproduces the output, on a few rows (probes.sample_rows)."""
    rows = probes.sample_rows(q.shape[-2])  # [R] first and last among them
    i, j = rows[:, None], torch.arange(k.shape[-2])[None, :]  # [R, 1], [1, Tk]
    m = mask[..., rows.to(mask.device), :].cpu()  # [R, Tk]
    candidates = [("the mask is ignored", None),
                  ("the mask is applied with inverted polarity (True taken as 'ignore')", ~m),
                  ("the causal mask is off by one (the diagonal is masked: triu with diagonal=0?)", m & (j < i))]
    got_rows = got[..., rows.to(got.device), :]
    for cause, candidate in candidates:
        if max_error(got_rows, reference.attention(q[..., rows.to(q.device), :], k, v, candidate)[0]) <= allowed:
            return cause
    return "the mask does not reach every query and key (applied to the wrong axis or a fixed-size block?)"


# ---- batches

def _batch_reduction(got) -> str:
    """The other batch elements' outputs moved: a reduction over the whole batch."""
    return ("a reduction runs over the whole batch: a max without dim= lets element 0's large scores "
            "underflow the others to 0/0" if not torch.isfinite(got).all() else
            "batch elements influence each other (a max, sum or normalisation over the batch dims?)")


# ---- grouped heads

def _gqa_mapping(got, q, k, v, mask, group, allowed, grouping, contract=False) -> str:
    """Which head mapping reproduces the output? ``contract``: the convention fixes ``grouping`` (hf: repeat_kv)."""
    for other in ("blocked", "tile"):
        repeated = [repeat_heads(t, group, other) for t in (k, v)]
        if other != grouping and max_error(got, chunked.reference_output(q, *repeated, mask)) <= allowed:
            if contract:
                return (f"the query heads follow the {other} grouping, but the convention's is {grouping} (Hugging "
                        f"Face's repeat_kv: query head h reads KV head h // g, as every GQA checkpoint is trained)")
            return (f"on these inputs the query heads follow the {other} grouping, but the probe found "
                    f"gqa-grouping={grouping}: the head mapping depends on the input")
    if max_error(got, chunked.reference_output(q, k[..., :1, :, :], v[..., :1, :, :], mask)) <= allowed:
        return "every query head reads KV head 0 (an MQA path applied to grouped heads?)"
    return "query heads are mapped to KV heads by neither grouping (blocked h // g, tile h % Hkv)"


# ---- numerics

UNSTABLE_MISTAKES = ("exp-without-max", "max-over-tensor")  # the catalog's unstable softmaxes


def _large_scores(got, q, k, v, mask) -> str:
    """The unstable softmax of the catalog that gives NaN in the same rows, else what large scores lose."""
    bad = ~torch.isfinite(got).all(dim=-1)  # [..., Tq] rows with NaN or inf
    unstable = ((MISTAKES[m].cause_for(), output(m, q, k, v, mask)) for m in UNSTABLE_MISTAKES) \
        if chunked.fits(q, k, v, mask) else ()  # each model in the inputs' dtype, its outputs [..., Tq, Dv]
    return next((d for d, out in unstable
                 if bad.any() and out is not None and torch.equal(~torch.isfinite(out).all(dim=-1), bad.cpu())),
                "large scores are clipped or lose precision (a clamp on the scores, or a narrower type inside?)"
                if not bad.any() else "NaN or inf in rows with large scores")


def _sunk_rows(got, q, k, v, mask, allowed) -> str:
    """Why rows of very negative scores lose their weights: 0/0, a finite fill above them, or a clamp."""
    if not torch.isfinite(got).all():
        return "exp underflows to 0/0 on very negative scores: subtract each row's max before exp"
    if mask is not None and max_error(got, reference.attention(q, k, v, ~mask)[0]) <= max(allowed, 1e-3):
        return ("masked scores are replaced by a finite fill (masked_fill(~mask, -1e4) or -1e9) that lies "
                "above the allowed scores: the masked keys take the weight (fill with -inf or finfo(dtype).min)")
    return "very negative scores lose the row's weights (a clamp on the scores, or a finite fill above them?)"


# ---- scores (softcap)

def _candidates(q, k, v, mask, cap):
    """(cause, output) for the classic softcap mistakes on these inputs, in float64: the catalog's models
    (attn_spec.diagnosis: softcap-without-factor, softcap-after-mask) in their own words, and the reference with its
    options for the cap ignored, cap * tanh(s) and the cap before the scale."""
    scale = 1 / math.sqrt(q.shape[-1])

    def scaled_after_cap(s):  # s = cap * tanh(Q K^T / cap), masked: the reference's softmax of s / sqrt(d_k)
        return reference.softmax_keys(s * scale)

    def mistake(mistake_id):
        return MISTAKES[mistake_id].cause_for(), output(mistake_id, q, k, v, mask, softcap=cap)

    yield "the softcap argument is ignored: scores are not capped", reference.attention(q, k, v, mask)[0]
    yield mistake("softcap-without-factor")
    yield ("the scores are not divided by the cap: cap * tanh(s) instead of cap * tanh(s / cap)",
           reference.attention(q, k, v, mask, scale=scale * cap, softcap=cap)[0])  # cap tanh(scale cap QK^T / cap)
    yield mistake("softcap-after-mask")
    yield ("the cap is applied before the scale: cap * tanh(Q K^T / cap) / sqrt(d_k)",
           reference.attention(q, k, v, mask, scale=1.0, softcap=cap, softmax=scaled_after_cap)[0])


def _softcap(got, q, k, v, mask, cap, allowed) -> str:
    """The classic softcap mistake whose output the target's matches, else what the cap should be."""
    return next((text for text, out in _candidates(q, k, v, mask, cap) if out is not None and near(got, out, allowed)),
                "the scores are not capped as cap * tanh(s / cap) before the mask")


READ = {  # cause key -> the function that words it from the facts
    "output-differs": _output_differs,
    "ignores-inputs": _ignores_inputs,
    "values-nonlinear": _values_nonlinear,
    "nonfinite-shape": _nonfinite_shape,
    "heads-differ": _heads_differ,
    "row-sums": _row_sums,
    "key-shift": _key_shift,
    "scale-named": _scale_named,
    "scale-argument": _scale_argument,
    "causal-leak": _causal_leak,
    "causal-rows": _causal_rows,
    "gqa-mapping": _gqa_mapping,
    "mask-leak": _mask_leak,
    "masked-keys-count": _masked_keys_count,
    "float-mask-read": _float_mask_read,
    "float-mask-scaled": _float_mask_scaled,
    "batch-reduction": _batch_reduction,
    "large-scores": _large_scores,
    "sunk-rows": _sunk_rows,
    "softcap": _softcap,
}
