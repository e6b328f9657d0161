"""The catalog of mistakes in the formula itself: scale, softmax, masks, positions, shapes, values.

Each function is the wrong code, written plainly (see :mod:`attn_spec.diagnosis.model` for the
levels, ``exact`` and ``params``). ``attn-spec list --mistakes`` lists them; ``attn-spec explain ID``
shows one with its code and fix.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attn_spec.diagnosis.model import (correct, leave_free, masked, mistake, scale_of, scores,
                                       softmax_keys, weights)
from attn_spec.targets.layouts import broadcast_shapes


def _scaled(q, scale, default):
    return default if scale is None else scale  # an explicit scale argument is used as given


# ---------------------------------------------------------------- scale


@mistake("scale-missing", family="scale", caught_by=("scale-sqrt-dk",),
         cause="scores are not scaled (missing 1/sqrt(d_k))",
         sentence="the scores are not scaled: softmax(Q Kᵀ) instead of softmax(Q Kᵀ / sqrt(d_k))",
         fix="divide the scores by math.sqrt(d_k)")
def scale_missing(q, k, v, mask, scale):
    return correct(q, k, v, mask, _scaled(q, scale, 1.0))


@mistake("scale-one-over-dk", family="scale", caught_by=("scale-sqrt-dk",),
         cause="scores are scaled by 1/d_k instead of 1/sqrt(d_k)",
         sentence="scores are scaled by 1/d_k instead of 1/sqrt(d_k): divided by d_k, or 1/sqrt(d_k) applied twice",
         fix="scale by 1 / math.sqrt(d_k), once")
def scale_one_over_dk(q, k, v, mask, scale):
    return correct(q, k, v, mask, _scaled(q, scale, 1 / q.shape[-1]))


@mistake("scale-one-over-two-dk", family="scale", caught_by=("scale-sqrt-dk",),
         sentence="scores are scaled by 1/(2 d_k) instead of 1/sqrt(d_k): `scores / d_k ** 1/2` divides by d_k, "
                  "then by 2 (** binds tighter than /)",
         fix="write d_k ** 0.5 (or math.sqrt(d_k))")
def scale_one_over_two_dk(q, k, v, mask, scale):
    return correct(q, k, v, mask, _scaled(q, scale, 1 / q.shape[-1] ** 1 / 2))


@mistake("scale-multiplied", family="scale", caught_by=("scale-sqrt-dk",),
         cause="scores are multiplied by sqrt(d_k) instead of divided",
         sentence="scores are scaled by sqrt(d_k) instead of 1/sqrt(d_k): multiplied instead of divided",
         fix="divide the scores by math.sqrt(d_k)")
def scale_multiplied(q, k, v, mask, scale):
    return correct(q, k, v, mask, _scaled(q, scale, math.sqrt(q.shape[-1])))


@mistake("scale-hard-coded", family="scale", caught_by=("scale-sqrt-dk",),
         params=tuple({"width": w} for w in (64, 128, 32, 16, 256, 512, 768, 1024, 8, 4)),
         sentence="scores are scaled by 1/sqrt({width}) instead of 1/sqrt(d_k): d_k is hard-coded, not the width "
                  "of the input",
         fix="compute the scale from the input: 1 / math.sqrt(Q.size(-1))")
def scale_hard_coded(q, k, v, mask, scale, width):
    return correct(q, k, v, mask, _scaled(q, scale, 1 / math.sqrt(width)))


@mistake("scale-d-v", family="scale", caught_by=("scale-sqrt-dk",),
         cause="the scale uses d_v instead of d_k",
         sentence="scores are scaled by 1/sqrt(d_v) instead of 1/sqrt(d_k): the width of V is used",
         fix="scale by 1 / math.sqrt(Q.size(-1)), the width of Q and K")
def scale_d_v(q, k, v, mask, scale):
    return correct(q, k, v, mask, _scaled(q, scale, 1 / math.sqrt(v.shape[-1])))


@mistake("scale-temperature", family="scale", caught_by=("scale-sqrt-dk",),
         params={"temperature": (0.05, 20.0, 0.9)},
         sentence="the scores are divided by an extra factor {temperature:.3g} (a softmax temperature left in?)",
         fix="scale by exactly 1 / math.sqrt(d_k): remove the extra factor")
def scale_temperature(q, k, v, mask, scale, temperature):
    return correct(q, k, v, mask, scale_of(q, scale) / temperature)


# ---------------------------------------------------------------- softmax


QUERY_AXIS = "the queries (dim=-2)"
ABSOLUTE_AXIS = ("the absolute dim 2 (softmax(dim=2): the keys of 3-D scores [B, n_q, n_kv], the queries of 4-D ones "
                 "[B, H, n_q, n_kv])")


@mistake("softmax-over-queries", family="softmax", caught_by=("rows-sum-to-one",),
         cause="the softmax runs over the query axis (dim=-2) instead of the keys",
         sentence="the softmax runs over {over}, not over the keys",
         fix="softmax(scores, dim=-1): each query's weights are a distribution over the keys",
         params=({"dim": -2, "over": QUERY_AXIS}, {"dim": 2, "over": ABSOLUTE_AXIS}))
def softmax_over_queries(q, k, v, mask, scale, dim=-2, over=QUERY_AXIS):
    s = masked(scores(q, k, scale), mask)  # [..., Tq, Tk]
    if dim >= s.dim():  # code written for batched scores: unbatched inputs are given a batch dim
        return softmax_over_queries(q[None], k[None], v[None], None if mask is None else mask[None], scale, dim)[0]
    if dim % s.dim() == s.dim() - 1:  # dim=2 of 3-D scores is the key axis: right there
        return softmax_keys(s) @ v
    unseen = torch.isneginf(s).all(dim=dim, keepdim=True).expand(s.shape)  # all -inf along dim: NaN
    leave_free(unseen)
    return torch.softmax(s, dim=dim).masked_fill(unseen, 0.0) @ v


@mistake("softmax-over-heads", family="softmax", caught_by=("rows-sum-to-one", "batch-independence"),
         sentence="the softmax runs over the head (or batch) dim, dim=-3 or dim=1, not over the keys",
         fix="softmax(scores, dim=-1)")
def softmax_over_heads(q, k, v, mask, scale):
    return torch.softmax(masked(scores(q, k, scale), mask), dim=-3) @ v  # raises on 2-D inputs


@mistake("softmax-over-matrix", family="softmax", caught_by=("rows-sum-to-one",),
         sentence="the softmax runs over the whole score matrix (both axes flattened), not over each row",
         fix="softmax(scores, dim=-1)")
def softmax_over_matrix(q, k, v, mask, scale):
    s = masked(scores(q, k, scale), mask)  # [..., Tq, Tk]
    return torch.softmax(s.flatten(-2), dim=-1).reshape(s.shape) @ v


@mistake("softmax-unnormalised", family="softmax", caught_by=("rows-sum-to-one",),
         sentence="the weights are exp(s - max) without dividing by their sum: the softmax is not normalised",
         fix="divide by the row sum (or call torch.softmax(scores, dim=-1))")
def softmax_unnormalised(q, k, v, mask, scale):
    s = masked(scores(q, k, scale), mask)
    return torch.exp(s - s.amax(dim=-1, keepdim=True)) @ v


@mistake("sigmoid-weights", family="softmax", caught_by=("rows-sum-to-one",),
         sentence="the weights are sigmoid(scores) instead of softmax(scores): rows do not sum to 1",
         fix="torch.softmax(scores, dim=-1)")
def sigmoid_weights(q, k, v, mask, scale):
    return torch.sigmoid(masked(scores(q, k, scale), mask)) @ v


@mistake("relu-normalised", family="softmax", caught_by=("key-shift-invariance",),
         sentence="the weights are relu(scores) divided by their sum, not a softmax (shifting the scores changes them)",
         cause="the weights are relu(scores) normalised by their sum, not a softmax",
         fix="torch.softmax(scores, dim=-1)")
def relu_normalised(q, k, v, mask, scale):
    w = masked(scores(q, k, scale), mask).relu()
    return w / w.sum(dim=-1, keepdim=True) @ v


@mistake("softmax-extra-zero-logit", family="softmax", caught_by=("rows-sum-to-one",),
         sentence="the softmax has an extra 1 in its denominator (a padded key with score 0 and value 0, or "
                  "softmax_one): every weight is scaled by the same factor < 1",
         fix="pad keys with a -inf score (or mask them), and use the plain softmax")
def softmax_extra_zero_logit(q, k, v, mask, scale):
    s = masked(scores(q, k, scale), mask)  # [..., Tq, Tk]
    padded = torch.cat([s, s.new_zeros(*s.shape[:-1], 1)], dim=-1)  # a key with score 0 ...
    return torch.softmax(padded, dim=-1)[..., :-1] @ v  # ... and value 0


@mistake("log-softmax-weights", family="softmax", caught_by=("rows-sum-to-one",),
         sentence="the weights are log_softmax(scores): log-probabilities, not probabilities",
         fix="torch.softmax(scores, dim=-1)")
def log_softmax_weights(q, k, v, mask, scale):
    return torch.log_softmax(masked(scores(q, k, scale), mask), dim=-1) @ v


@mistake("softmax-missing", family="softmax", caught_by=("rows-sum-to-one",),
         sentence="there is no softmax: the raw scores weight the values",
         fix="weights = torch.softmax(scores, dim=-1), then weights @ V")
def softmax_missing(q, k, v, mask, scale):
    return masked(scores(q, k, scale), mask, 0.0) @ v


@mistake("exp-without-max", family="numerics", exact=True, caught_by=("numerical-stability", "long-sequences"),
         sentence="the softmax is exp(s) / sum(exp(s)) without subtracting the row max: exp overflows to inf "
                  "(inf / inf = NaN) once scores are large, and a 16-bit sum overflows over many keys",
         cause="exp overflows or underflows to 0/0 on large scores: subtract each row's max before exp",
         fix="subtract each row's max first (torch.softmax does): exp(s - s.amax(dim=-1, keepdim=True))")
def exp_without_max(q, k, v, mask, scale):
    e = torch.exp(masked(scores(q, k, scale), mask))
    return e / e.sum(dim=-1, keepdim=True) @ v


@mistake("max-over-tensor", family="numerics", exact=True, caught_by=("batch-independence", "numerical-stability"),
         sentence="the max subtracted for a stable softmax is taken over the whole tensor (x.max() without dim): "
                  "rows and batch elements with smaller scores underflow to 0/0",
         cause="the max is taken over more than the row (x.max() without dim=-1?): rows with smaller scores "
               "underflow to 0/0",
         fix="s.amax(dim=-1, keepdim=True): the max of each row")
def max_over_tensor(q, k, v, mask, scale):
    s = masked(scores(q, k, scale), mask)
    e = torch.exp(s - s.max())
    return e / e.sum(dim=-1, keepdim=True) @ v


@mistake("max-over-queries", family="numerics", exact=True, caught_by=("key-shift-invariance",),
         sentence="the max subtracted for a stable softmax is taken over the queries (dim=-2), not the keys",
         cause="the max for a stable softmax is taken over the queries (dim=-2), not the keys",
         fix="s.amax(dim=-1, keepdim=True)")
def max_over_queries(q, k, v, mask, scale):
    s = masked(scores(q, k, scale), mask)
    e = torch.exp(s - s.amax(dim=-2, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True) @ v


@mistake("scores-clamped", family="numerics", caught_by=("numerical-stability",),
         params=tuple({"limit": c} for c in (50, 10, 20, 30, 80, 100, 5, 1e4)),
         sentence="the scores are clamped to [-{limit:g}, {limit:g}] 'to avoid overflow': large scores lose their order",
         fix="do not clamp: subtract the row max inside the softmax (torch.softmax does)")
def scores_clamped(q, k, v, mask, scale, limit):
    return softmax_keys(masked(scores(q, k, scale).clamp(-limit, limit), mask)) @ v


# ---------------------------------------------------------------- positions


@mistake("positional-bias", family="position", caught_by=("permutation-equivariance",),
         params={"slope": (-8.0, 8.0, 0.5)},
         sentence="a term {slope:.3g} · j that grows with the key position j is added to the scores: attention "
                  "depends on where a key sits",
         fix="add positional information to the inputs (or as an explicit bias argument), not inside attention")
def positional_bias(q, k, v, mask, scale, slope):
    position = torch.arange(k.shape[-2], dtype=q.dtype)  # [Tk]
    return softmax_keys(masked(scores(q, k, scale) + slope * position, mask)) @ v


@mistake("values-cumsum", family="position", caught_by=("permutation-equivariance",),
         sentence="the values are summed cumulatively over the keys (V.cumsum(dim=-2)) before weighting",
         fix="weights @ V, with V as given")
def values_cumsum(q, k, v, mask, scale):
    return correct(q, k, v.cumsum(dim=-2), mask, scale)


# ---------------------------------------------------------------- shapes and wiring


@mistake("keys-as-values", family="shapes", caught_by=("cross-attention-shapes",),
         sentence="K is used as the values: weights @ K instead of weights @ V",
         fix="weights @ V")
def keys_as_values(q, k, v, mask, scale):
    return correct(q, k, k, mask, scale)


@mistake("queries-keys-swapped", family="shapes", caught_by=("cross-attention-shapes",),
         sentence="Q and K are swapped: softmax(K Qᵀ) weights the values (it crashes whenever n_q != n_kv)",
         fix="scores = Q @ K.transpose(-2, -1): one row per query")
def queries_keys_swapped(q, k, v, mask, scale):
    return weights(k, q, mask, scale_of(q, scale)) @ v


@mistake("keys-cut-to-queries", family="shapes", caught_by=("matches-reference",),
         sentence="only the first n_q keys are read: one length for queries and keys (a self-attention kernel's "
                  "loop bound), so cross-attention with more keys than queries drops the rest",
         fix="run the key loop to K's own length, n_kv, not to n_q")
def keys_cut_to_queries(q, k, v, mask, scale):
    n = min(q.shape[-2], k.shape[-2])  # keys read: the first n_q
    cut = None if mask is None or mask.shape[-1] == 1 else mask[..., :n]
    return correct(q, k[..., :n, :], v[..., :n, :], mask if cut is None else cut, scale)


@mistake("returns-weights", family="shapes", caught_by=("cross-attention-shapes",),
         sentence="the function returns the attention weights instead of the output (weights @ V is missing)",
         fix="return weights @ V")
def returns_weights(q, k, v, mask, scale):
    return weights(q, k, mask, scale)


@mistake("returns-tuple", family="shapes", caught_by=("matches-reference",),
         sentence="the function returns a tuple (output, weights); the convention returns the output only",
         fix="return only the output tensor (or check it through an adapter that takes [0])")
def returns_tuple(q, k, v, mask, scale):
    return correct(q, k, v, mask, scale), weights(q, k, mask, scale)


@mistake("output-truncated-to-dk", family="shapes", caught_by=("cross-attention-shapes",),
         sentence="the output is cut to the width of Q (d_k): d_v is assumed equal to d_k",
         fix="the output is [..., n_q, d_v]: as wide as V")
def output_truncated_to_dk(q, k, v, mask, scale):
    return correct(q, k, v, mask, scale)[..., :q.shape[-1]]


@mistake("default-mask-square", family="shapes", caught_by=("cross-attention-shapes",),
         sentence="the default mask is built [n_q, n_q] from the query length: cross-attention (n_q != n_kv) breaks",
         fix="when no mask is given, apply none (or build it [n_q, n_kv])")
def default_mask_square(q, k, v, mask, scale):
    if mask is None:
        mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool)  # [Tq, Tq]: raises against [Tq, Tk] scores
    return correct(q, k, v, mask, scale)


@mistake("returns-zeros", family="shapes", caught_by=("matches-reference",),
         cause="the output is all zeros: no attention is computed",
         sentence="the output is all zeros: nothing is computed",
         fix="return softmax(Q Kᵀ / sqrt(d_k)) V")
def returns_zeros(q, k, v, mask, scale):
    return torch.zeros(*broadcast_shapes(q.shape[:-2], v.shape[:-2]), q.shape[-2], v.shape[-1], dtype=v.dtype)


@mistake("returns-values", family="shapes", caught_by=("matches-reference",),
         cause="the output is V itself: the values are returned without attention over the keys",
         sentence="the output is V itself: no attention is computed",
         fix="return softmax(Q Kᵀ / sqrt(d_k)) V")
def returns_values(q, k, v, mask, scale):
    return v


@mistake("uniform-weights", family="shapes", caught_by=("matches-reference",),
         cause="the output is the mean of V over the keys: the weights are uniform, Q, K and the mask are ignored "
               "(scores multiplied by 0?)",
         sentence="every allowed key gets the same weight (the mean of V): the scores are never used",
         fix="weights = softmax(Q Kᵀ / sqrt(d_k)) over the allowed keys")
def uniform_weights(q, k, v, mask, scale):
    return correct(torch.zeros_like(q), k, v, mask, scale)


# ---------------------------------------------------------------- values and keys


@mistake("values-normalised", family="values", exact=True, caught_by=("value-linearity",),
         sentence="V is L2-normalised before weighting (a QK-norm applied to V too): the output is not linear in V",
         fix="normalise Q and K if the model wants it, never V")
def values_normalised(q, k, v, mask, scale):
    return correct(q, k, F.normalize(v, dim=-1), mask, scale)


@mistake("values-divided-by-max", family="values", caught_by=("value-linearity",),
         sentence="V is divided by its largest entry (for float16 safety?) and never scaled back",
         fix="weights @ V with V as given; keep the softmax in float32 instead if precision is the worry")
def values_divided_by_max(q, k, v, mask, scale):
    return correct(q, k, v / v.abs().amax().clamp_min(1e-6), mask, scale)


@mistake("values-activation", family="values", caught_by=("value-linearity",),
         sentence="an activation (ReLU) is applied to V before the weighted sum",
         fix="weights @ V; activations belong outside attention")
def values_activation(q, k, v, mask, scale):
    return correct(q, k, v.relu(), mask, scale)


@mistake("keys-normalised", family="values", exact=True, caught_by=("key-shift-invariance",),
         sentence="K is L2-normalised (cosine attention without a learned temperature)",
         cause="the keys are L2-normalised (cosine similarity), which a shift changes",
         fix="use the keys as given (or normalise Q and K both and learn a temperature, deliberately)")
def keys_normalised(q, k, v, mask, scale):
    return correct(q, F.normalize(k, dim=-1), v, mask, scale)
