"""The catalog of mistakes in masking: a mask ignored, inverted, transposed, applied after the softmax,
filled with a finite value, scaled with the scores, or applied to one batch element only.

Each function is the wrong code, written plainly (see :mod:`attn_spec.diagnosis.model`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attn_spec.diagnosis.model import NEG_INF, correct, masked, mistake, scale_of, scores, softmax_keys, weights


@mistake("mask-ignored", family="masking", caught_by=("causal-mask", "mask-semantics"),
         cause="the mask is ignored",
         sentence="the mask is ignored: every query attends every key",
         fix="scores.masked_fill(~mask, float('-inf')) before the softmax")
def mask_ignored(q, k, v, mask, scale):
    return correct(q, k, v, None, scale)


@mistake("mask-inverted", family="masking", caught_by=("causal-mask", "mask-semantics"),
         cause="the mask is applied with inverted polarity (True taken as 'ignore')",
         sentence="the mask is applied with inverted polarity: True is taken as 'ignore' (the kit's and "
                  "PyTorch's bool masks say True = may attend)",
         fix="scores.masked_fill(~mask, float('-inf')), not masked_fill(mask, ...)")
def mask_inverted(q, k, v, mask, scale):
    return correct(q, k, v, ~mask if mask is not None and mask.dtype == torch.bool else mask, scale)


@mistake("mask-inverted-bias", family="masking", exact=True, caught_by=("causal-mask", "mask-semantics"),
         sentence="the mask is applied with inverted polarity, as a bias (scores + mask * finfo.min): allowed "
                  "keys are pushed down, masked ones kept",
         fix="scores + (~mask) * finfo.min, or scores.masked_fill(~mask, float('-inf'))")
def mask_inverted_bias(q, k, v, mask, scale):
    s = scores(q, k, scale)
    if mask is not None:
        s = s + mask.to(q.dtype) * torch.finfo(q.dtype).min
    return torch.softmax(s, dim=-1) @ v


@mistake("mask-transposed", family="masking", caught_by=("causal-mask",),
         sentence="the mask is transposed: mask[j, i] is used for query i and key j",
         fix="use mask[..., i, j] for query i and key j (do not transpose it)")
def mask_transposed(q, k, v, mask, scale):
    if mask is None or mask.dtype != torch.bool:
        return correct(q, k, v, mask, scale)
    n_q, n_kv = q.shape[-2], k.shape[-2]
    m = mask.transpose(-2, -1)[..., :n_q, :n_kv]  # a rectangular mask: cut to fit, padded with True
    m = F.pad(m, (0, n_kv - m.shape[-1], 0, n_q - m.shape[-2]), value=True)
    return correct(q, k, v, m, scale)


@mistake("mask-after-softmax", family="masking", caught_by=("mask-semantics", "causal-mask"),
         sentence="the mask multiplies the weights after the softmax: masked keys get 0 but rows no longer sum to 1",
         fix="mask the scores before the softmax: scores.masked_fill(~mask, float('-inf'))")
def mask_after_softmax(q, k, v, mask, scale):
    w = weights(q, k, None, scale)
    return (w if mask is None else w * mask) @ v


@mistake("mask-after-softmax-renormalised", family="masking", exact=True, caught_by=("mask-semantics",),
         sentence="the mask multiplies the weights after the softmax, then rows are renormalised: masked keys' "
                  "large scores still set the max, so the allowed weights underflow to 0/0",
         fix="mask the scores before the softmax: scores.masked_fill(~mask, float('-inf'))")
def mask_after_softmax_renormalised(q, k, v, mask, scale):
    w = torch.softmax(scores(q, k, scale), dim=-1)
    if mask is not None:
        w = w * mask
        w = w / w.sum(dim=-1, keepdim=True)
    return w @ v


@mistake("mask-fill-zero", family="masking", caught_by=("mask-semantics", "causal-mask"),
         sentence="masked scores are set to 0 instead of -inf: masked keys keep the weight of a zero score",
         fix="scores.masked_fill(~mask, float('-inf'))")
def mask_fill_zero(q, k, v, mask, scale):
    return correct(q, k, v, None, scale) if mask is None else softmax_keys(masked(scores(q, k, scale), mask, 0.0)) @ v


@mistake("mask-fill-finite", family="masking", exact=True, caught_by=("mask-semantics",),
         params=tuple({"fill": f} for f in (-1e9, -1e4, -1e5, -1e6, -1e8, -1e10, -1e12, -1e20, -1e30, -1e3)),
         sentence="masked scores are set to {fill:g}, a finite value: larger scores overwhelm it, and a 16-bit "
                  "dtype cannot hold it",
         fix="scores.masked_fill(~mask, float('-inf')) (or torch.finfo(scores.dtype).min)")
def mask_fill_finite(q, k, v, mask, scale, fill):
    s = scores(q, k, scale)
    return torch.softmax(s if mask is None else s.masked_fill(~mask, fill), dim=-1) @ v


@mistake("mask-bias-finite", family="masking", exact=True, caught_by=("mask-semantics",),
         params=tuple({"bias": b} for b in (-1e4, -1e9, -1e5, -1e6, -1e8, -1e3, -1e30)),
         sentence="the mask is a finite additive bias ({bias:g} on masked keys): large scores overwhelm it",
         fix="use -inf (or torch.finfo(dtype).min) for masked scores")
def mask_bias_finite(q, k, v, mask, scale, bias):
    s = scores(q, k, scale)
    return torch.softmax(s if mask is None else s + (~mask) * bias, dim=-1) @ v


@mistake("mask-scaled-with-scores", family="masking", caught_by=("mask-semantics",),
         sentence="an additive mask is scaled with the scores ((Q Kᵀ + mask) / sqrt(d_k)): finite biases shrink",
         fix="add the mask after scaling: Q Kᵀ / sqrt(d_k) + mask")
def mask_scaled_with_scores(q, k, v, mask, scale):
    if mask is not None:  # (Q Kᵀ + mask) · scale: the bias the softmax sees is the mask times the scale
        bias = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, NEG_INF) if mask.dtype == torch.bool else mask
        mask = bias * scale_of(q, scale)
    return correct(q, k, v, mask, scale)


@mistake("mask-first-batch-only", family="masking", caught_by=("mask-semantics", "batch-independence"),
         sentence="the mask is applied to the first batch element only (mask[0]); the others are unmasked",
         fix="broadcast the mask over every batch element: scores.masked_fill(~mask, float('-inf'))")
def mask_first_batch_only(q, k, v, mask, scale):
    out = correct(q, k, v, None, scale)  # [..., Tq, Dv]
    if mask is None or out.dim() < 3:
        return correct(q, k, v, mask, scale)
    first = (0,) * (out.dim() - 2)
    b = out.shape[:-2]
    q, k, v = (t.expand(*b, *t.shape[-2:]) for t in (q, k, v))
    m = mask.expand(*b, *mask.shape[-2:])
    out[first] = correct(q[first], k[first], v[first], m[first], scale)
    return out


@mistake("causal-hard-coded", family="masking", caught_by=("permutation-equivariance",),
         sentence="a causal mask is hard-coded inside the attention: queries never see later keys, even "
                  "without a mask",
         fix="apply only the mask the caller passes; build a causal mask outside, where it is wanted")
def causal_hard_coded(q, k, v, mask, scale):
    return correct(q, k, v, mask, scale, causal=True)  # key j <= query i, whatever the caller passed
