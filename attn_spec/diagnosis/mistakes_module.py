"""The catalog of mistakes in multi-head plumbing, in hand-written backward passes, and in what a
target keeps between calls (state, randomness)."""
from __future__ import annotations

import math

import torch

from attn_spec.diagnosis.model import correct, merge_heads, mistake, scale_of, split_heads, weights


def _projected(x_q, x_kv, W):
    return x_q @ W["W_Q"].T, x_kv @ W["W_K"].T, x_kv @ W["W_V"].T  # [Tq, D], [Tk, D], [Tk, D]


# ---------------------------------------------------------------- multi-head plumbing


@mistake("heads-split-without-transpose", level="module", family="multi-head",
         caught_by=("head-concat-equivalence",),
         sentence="heads are split with view/reshape to [h, n, d_head] and no transpose: each 'head' gets "
                  "slices of several tokens, so tokens mix",
         fix="x.view(n, h, d_head).transpose(0, 1) (or .transpose(1, 2) with a batch dim)")
def heads_split_without_transpose(x_q, x_kv, W, h, mask):
    q, k, v = (t.reshape(h, t.shape[0], -1) for t in _projected(x_q, x_kv, W))  # [h, n, Dh], tokens mixed
    return merge_heads(correct(q, k, v, mask)) @ W["W_O"].T


@mistake("heads-merged-without-transpose", level="module", family="multi-head",
         caught_by=("head-concat-equivalence",),
         sentence="heads are merged with view/reshape from [h, n, d_head] to [n, d_model] with no transpose: "
                  "output rows mix tokens and heads",
         fix="heads.transpose(0, 1).reshape(n, d_model)")
def heads_merged_without_transpose(x_q, x_kv, W, h, mask):
    q, k, v = (split_heads(t, h) for t in _projected(x_q, x_kv, W))
    heads = correct(q, k, v, mask)  # [h, Tq, Dh]
    return heads.reshape(heads.shape[1], -1) @ W["W_O"].T


@mistake("heads-split-and-merged-without-transpose", level="module", family="multi-head",
         caught_by=("head-concat-equivalence",),
         sentence="heads are split and merged with view/reshape and no transpose: tokens mix across heads",
         fix="split with view(n, h, d_head).transpose(0, 1); merge with transpose(0, 1).reshape(n, d_model)")
def heads_split_and_merged_without_transpose(x_q, x_kv, W, h, mask):
    q, k, v = (t.reshape(h, t.shape[0], -1) for t in _projected(x_q, x_kv, W))
    heads = correct(q, k, v, mask)
    return heads.reshape(heads.shape[1], -1) @ W["W_O"].T


@mistake("output-projection-missing", level="module", family="multi-head", caught_by=("head-concat-equivalence",),
         sentence="W_O is never applied: the concatenated heads are returned as they are",
         fix="return self.W_O(concat)")
def output_projection_missing(x_q, x_kv, W, h, mask):
    q, k, v = (split_heads(t, h) for t in _projected(x_q, x_kv, W))
    return merge_heads(correct(q, k, v, mask))


@mistake("kv-projections-swapped", level="module", family="multi-head", caught_by=("head-concat-equivalence",),
         sentence="W_K and W_V are swapped: the keys are projected with W_V and the values with W_K",
         fix="K = W_K(x_kv), V = W_V(x_kv)")
def kv_projections_swapped(x_q, x_kv, W, h, mask):
    q, v, k = (split_heads(t, h) for t in _projected(x_q, x_kv, W))
    return merge_heads(correct(q, k, v, mask)) @ W["W_O"].T


@mistake("scale-d-model", level="module", family="multi-head", caught_by=("scale-sqrt-dk", "head-concat-equivalence"),
         sentence="scores are scaled by 1/sqrt(d_model) instead of 1/sqrt(d_k): the whole width, not the "
                  "per-head d_k = d_model / h",
         fix="scale by 1 / math.sqrt(d_model // n_heads)")
def scale_d_model(x_q, x_kv, W, h, mask):
    q, k, v = (split_heads(t, h) for t in _projected(x_q, x_kv, W))
    return merge_heads(correct(q, k, v, mask, 1 / math.sqrt(x_q.shape[-1]))) @ W["W_O"].T


@mistake("kv-cache-left-on", level="module", family="state", stateful=True, caught_by=("determinism",),
         sentence="a KV cache is left on: every call also attends to the keys and values of earlier calls",
         fix="keep no state between calls at inference (or reset the cache per sequence, explicitly)")
def kv_cache_left_on(x_q, x_kv, W, h, mask, state):
    q, k, v = (split_heads(t, h) for t in _projected(x_q, x_kv, W))  # [h, T, Dh]
    cached = state.get("kv")
    if cached is not None and cached[0].shape[-1] == k.shape[-1]:
        k, v = torch.cat([cached[0], k], dim=-2), torch.cat([cached[1], v], dim=-2)
        if mask is not None:  # the cached keys are always visible
            mask = torch.cat([mask.new_ones(*mask.shape[:-1], cached[0].shape[-2]), mask], dim=-1)
    state["kv"] = (k, v)
    return merge_heads(correct(q, k, v, mask)) @ W["W_O"].T


# ---------------------------------------------------------------- hand-written backward passes

def _closed_form(q, k, v, mask, scale, G, *, rowsum=True, scale_grads=True):
    """(out, dQ, dK, dV) of <attention, G>; the flags drop one term of the softmax backward."""
    s = scale_of(q, scale)
    A = weights(q, k, mask, s)  # [..., Tq, Tk]
    dA = G @ v.transpose(-2, -1)  # [..., Tq, Tk]
    dS = A * (dA - (A * dA).sum(dim=-1, keepdim=True)) if rowsum else A * dA
    if scale_grads:
        dS = dS * s
    return A @ v, dS @ k, dS.transpose(-2, -1) @ q, A.transpose(-2, -1) @ G


@mistake("backward-missing-rowsum", level="backward", family="gradients", caught_by=("gradients",),
         sentence="a hand-written backward misses the - rowsum(A * dA) term of the softmax backward "
                  "(dS = A * dA instead of A * (dA - rowsum(A * dA)))",
         fix="dS = A * (dA - (A * dA).sum(dim=-1, keepdim=True)), or let autograd differentiate the forward")
def backward_missing_rowsum(q, k, v, mask, scale, G):
    return _closed_form(q, k, v, mask, scale, G, rowsum=False)


@mistake("backward-missing-scale", level="backward", family="gradients", caught_by=("gradients",),
         sentence="a hand-written backward forgets the 1/sqrt(d_k) of the forward in dQ and dK",
         fix="multiply dS by the forward's scale before dQ = dS K and dK = dSᵀ Q")
def backward_missing_scale(q, k, v, mask, scale, G):
    return _closed_form(q, k, v, mask, scale, G, scale_grads=False)


@mistake("backward-ignores-mask", level="backward", family="gradients", caught_by=("gradients",),
         sentence="a hand-written backward recomputes the weights without the mask: gradients reach masked "
                  "(future) keys",
         fix="save the masked weights from the forward (or recompute them with the same mask)")
def backward_ignores_mask(q, k, v, mask, scale, G):
    out = correct(q, k, v, mask, scale)
    return (out, *_closed_form(q, k, v, None, scale, G)[1:])


@mistake("backward-unmasked-padding", level="backward", family="gradients", caught_by=("gradients",),
         params=tuple({"block": b} for b in (4, 8, 16, 32, 64, 128)),
         sentence="a hand-written backward pads the keys to a block of {block} and never masks the padding: "
                  "0 * NaN puts NaN in dQ and dK",
         fix="mask (or zero) the padded keys and values before any sum over the block")
def backward_unmasked_padding(q, k, v, mask, scale, G, block):
    out, dq, dk, dv = _closed_form(q, k, v, mask, scale, G)
    if k.shape[-2] % block:  # uninitialised padding: the row sums of the softmax backward become NaN
        dq, dk = torch.full_like(dq, math.nan), torch.full_like(dk, math.nan)
    return out, dq, dk, dv


@mistake("values-detached", family="gradients", caught_by=("gradients",),
         sentence="V is detached (.detach(), .data, or a no_grad block): no gradient reaches the values",
         fix="keep V in the graph: weights @ V")
def values_detached(q, k, v, mask, scale):
    return correct(q, k, v.detach(), mask, scale)


@mistake("output-detached", family="gradients", caught_by=("gradients",),
         sentence="the output is detached from autograd (computed under torch.no_grad(), through .detach() or "
                  ".data, or by a NumPy round trip): the attention cannot be trained",
         fix="compute it with torch operations on Q, K, V outside no_grad; an inference kernel says so with "
             "--inference-only")
def output_detached(q, k, v, mask, scale):
    return correct(q, k, v, mask, scale).detach()


# ---------------------------------------------------------------- randomness at inference


@mistake("dropout-at-inference", level="stochastic", family="state", caught_by=("determinism",), params=({"p": 0.1},),
         sentence="dropout (p ≈ {p:.2g}) is applied to the weights at inference: F.dropout defaults to "
                  "training=True",
         fix="F.dropout(weights, p, training=self.training), or an nn.Dropout module (eval() turns it off)")
def dropout_at_inference(samples, expected):
    w = torch.stack(samples)  # [S, Tq, Tk] readings of the same weights
    a = expected.expand_as(w)
    live, kept = a > 1e-9, w.abs() > 1e-12
    if not (live & ~kept).any() or not (live & kept).any():
        return None  # nothing dropped, or everything: not dropout
    ratio = w[live & kept] / a[live & kept]  # 1 / (1 - p) for every kept weight
    c = ratio.median()
    if (ratio - c).abs().max() > 1e-4 * c or c < 1:
        return None
    return {"p": 1 - 1 / c.item()}


@mistake("noise-at-inference", level="stochastic", family="state", caught_by=("determinism",),
         params=({"size": 1e-3},),
         sentence="random noise (up to {size:.1g} in a weight) is added to the scores or weights at inference",
         fix="remove the noise (to break ties deterministically, compare indices, not random jitter)")
def noise_at_inference(samples, expected):
    w = torch.stack(samples)
    if not (w != w[0]).any():
        return None
    size = (w - expected).abs().max().item()
    return {"size": size} if size < 0.05 else None
