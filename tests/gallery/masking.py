"""Correct variants and classic bugs for masking, batching, linearity, shift invariance and numerics."""
import itertools
import math

import torch
import torch.nn.functional as F

from gallery import buggy, correct
from gallery.core import _masked, _scores, seed_function

NEG_INF = float("-inf")


def _softmax_rows(scores):
    """softmax over keys that gives all-zero weights to a row with no allowed key."""
    peak = scores.amax(dim=-1, keepdim=True)  # [..., Tq, 1]
    e = torch.exp(scores - torch.where(torch.isinf(peak), torch.zeros_like(peak), peak))  # [..., Tq, Tk]
    total = e.sum(dim=-1, keepdim=True)
    return e / torch.where(total == 0, torch.ones_like(total), total)


# ---------------------------------------------------------------- correct variants


@correct()
def skips_masked_keys(Q, K, V, mask=None):
    """Each query attends only the keys its mask row allows: masked K/V are never read."""
    if mask is None:
        return seed_function(Q, K, V)
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2], mask.shape[:-2])
    Q, K, V = (t.expand(*batch, *t.shape[-2:]) for t in (Q, K, V))
    if mask.dim() > 2:
        mask = mask.expand(*batch, *mask.shape[-2:])
    out = torch.zeros(*batch, Q.shape[-2], V.shape[-1], dtype=Q.dtype, device=Q.device)  # [..., Tq, Dv]
    for index in itertools.product(*map(range, mask.shape[:-2])):  # a 2-D mask: every batch element at once
        q, k, v, o = Q[index], K[index], V[index], out[index]
        for i, keep in enumerate(mask[index]):  # keep: [Tk]
            if keep.any():
                o[..., i, :] = seed_function(q[..., i:i + 1, :], k[..., keep, :], v[..., keep, :])[..., 0, :]
    return out


@correct()
def upcast_softmax(Q, K, V, mask=None):
    """Scores and softmax in float32 for 16-bit inputs, weights cast back (the Hugging Face fix)."""
    wide = Q.float() if Q.element_size() < 4 else Q
    scores = _masked(_scores(wide, K.to(wide.dtype)), mask)  # [..., Tq, Tk]
    return torch.softmax(scores, dim=-1).to(Q.dtype) @ V


@correct()
def zero_for_empty_rows(Q, K, V, mask=None):
    """Max-subtracted exp whose fully masked rows give zeros, as PyTorch's safe softmax does."""
    return _softmax_rows(_masked(_scores(Q, K), mask)) @ V


@correct()
def mask_eq_zero_idiom(Q, K, V, mask=None):
    """The tutorials' idiom, masked_fill(mask == 0, ...), with a fill every dtype holds: right on bool masks,
    which is all the function convention promises."""
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ V


# ---------------------------------------------------------------- bugs: masks


@buggy("causal-mask", "mask-semantics", "matches-reference",
       bug="the masked path crashes inside torch with NotImplementedError (a sparse mask), which is no declaration")
def sparse_mask(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask.to_sparse(), NEG_INF)  # aten::bitwise_not has no sparse kernel
    return torch.softmax(scores, dim=-1) @ V


@buggy("mask-semantics", "rows-sum-to-one",
       mistake="mask-after-softmax", bug="mask applied after the softmax by multiplying")
def mask_after_softmax(Q, K, V, mask=None):
    weights = torch.softmax(_scores(Q, K), dim=-1)
    return (weights if mask is None else weights * mask) @ V


@buggy("mask-semantics",
       mistake="mask-after-softmax-renormalised", bug="mask applied after the softmax, then renormalised (masked scores still set the max)")
def mask_after_softmax_renormalised(Q, K, V, mask=None):
    weights = torch.softmax(_scores(Q, K), dim=-1)
    if mask is not None:
        weights = weights * mask
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ V


@buggy("mask-semantics", mistake="mask-bias-finite", bug="additive mask of -1e4, which large scores overwhelm")
def additive_minus_1e4(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores + (~mask) * -1e4
    return torch.softmax(scores, dim=-1) @ V


@buggy("mask-semantics", mistake="mask-fill-finite", bug="masked_fill(-1e9), which float16 cannot hold")
def fill_minus_1e9(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e9)
    return torch.softmax(scores, dim=-1) @ V


def _additive(mask, dtype):
    """A bool mask becomes 0 / -inf; a float mask is already additive."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, NEG_INF)
    return mask


@buggy("mask-semantics", mistake="mask-scaled-with-scores",
       bug="additive mask scaled with the scores ((QK^T + mask) / sqrt(d_k)); it takes float masks too, declared "
           "(on a bool mask, turned into 0 / -inf, the scaling does no harm)", masks=("bool", "additive"))
def scaled_additive_mask(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1)
    if mask is not None:
        scores = scores + _additive(mask, Q.dtype)
    return torch.softmax(scores / math.sqrt(Q.size(-1)), dim=-1) @ V


@buggy("mask-semantics", "causal-mask",
       mistake="mask-inverted-bias", bug="bool mask turned into a bias with inverted polarity (mask * finfo.min)")
def bias_from_mask_inverted(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores + mask.to(Q.dtype) * torch.finfo(Q.dtype).min
    return torch.softmax(scores, dim=-1) @ V


# ---------------------------------------------------------------- bugs: batching


@buggy("batch-independence",
       mistake="batch-sequence-first", bug="keys and values read sequence-first (reshape instead of transpose)")
def sequence_first_reshape(Q, K, V, mask=None):
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    K, V = K.expand(*batch, *K.shape[-2:]), V.expand(*batch, *V.shape[-2:])
    n_kv = K.shape[-2]
    K = K.reshape(n_kv, -1, K.shape[-1]).transpose(0, 1).reshape(K.shape)  # [Tk, B, Dk] read from [B, Tk, Dk]
    V = V.reshape(n_kv, -1, V.shape[-1]).transpose(0, 1).reshape(V.shape)
    return seed_function(Q, K, V, mask)


@buggy("batch-independence", "numerical-stability",
       mistake="max-over-tensor", bug="stable softmax with a max over the whole tensor (no dim)")
def global_max_softmax(Q, K, V, mask=None):
    scores = _masked(_scores(Q, K), mask)
    e = torch.exp(scores - scores.max())  # numpy habit: max without an axis
    return (e / e.sum(dim=-1, keepdim=True)) @ V


@buggy("batch-independence",
       mistake="batch-flattened-with-view", bug="batch dims flattened with .view (breaks on broadcast K/V)")
def flattens_with_view(Q, K, V, mask=None):
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    Q, K, V = (t.expand(*batch, *t.shape[-2:]) for t in (Q, K, V))
    q, k, v = (t.view(-1, *t.shape[-2:]) for t in (Q, K, V))  # [B, T, D]
    if mask is not None:
        mask = mask.expand(*batch, *mask.shape[-2:]).view(-1, *mask.shape[-2:])
    return seed_function(q, k, v, mask).view(*batch, Q.shape[-2], V.shape[-1])


# ---------------------------------------------------------------- bugs: values


@buggy("value-linearity", mistake="values-normalised", bug="values L2-normalised (QK-norm applied to V too)")
def normalised_values(Q, K, V, mask=None):
    return seed_function(Q, K, F.normalize(V, dim=-1), mask)


@buggy("value-linearity",
       mistake="values-divided-by-max", bug="values divided by their max for float16 safety, never scaled back")
def values_divided_by_max(Q, K, V, mask=None):
    return seed_function(Q, K, V / V.abs().amax().clamp_min(1e-6), mask)


@buggy("value-linearity", mistake="values-activation", bug="a ReLU left on the values")
def relu_values(Q, K, V, mask=None):
    return seed_function(Q, K, V.relu(), mask)


# ---------------------------------------------------------------- bugs: softmax shift invariance


@buggy("key-shift-invariance", mistake="relu-normalised", bug="weights are relu(scores) normalised by their sum")
def relu_normalised(Q, K, V, mask=None):
    weights = _masked(_scores(Q, K), mask).relu()
    return (weights / weights.sum(dim=-1, keepdim=True)) @ V


@buggy("key-shift-invariance",
       mistake="keys-normalised", bug="keys L2-normalised (cosine attention without a temperature)")
def normalised_keys(Q, K, V, mask=None):
    return seed_function(Q, F.normalize(K, dim=-1), V, mask)


@buggy("key-shift-invariance", mistake="max-over-queries", bug="stabilising max taken over the queries (dim=-2)")
def max_over_queries(Q, K, V, mask=None):
    scores = _masked(_scores(Q, K), mask)
    e = torch.exp(scores - scores.amax(dim=-2, keepdim=True))
    return (e / e.sum(dim=-1, keepdim=True)) @ V


# ---------------------------------------------------------------- bugs: large scores


@buggy("numerical-stability", mistake="exp-without-max", bug="exp without subtracting the row max")
def exp_without_max(Q, K, V, mask=None):
    e = torch.exp(_masked(_scores(Q, K), mask))
    return (e / e.sum(dim=-1, keepdim=True)) @ V


@buggy("numerical-stability", mistake="scores-clamped", bug="scores clamped to [-50, 50] 'to avoid overflow'")
def clamped_scores(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K).clamp(-50, 50), mask), dim=-1) @ V
