"""Dropout (dropout_p) and ALiBi (alibi_slopes) in the sdpa convention: correct kernels and the classic bugs."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attn_spec import reference
from gallery import buggy, correct


def _weights(query, key, attn_mask, is_causal, scale):
    scale = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * scale  # [..., Tq, Tk]
    if is_causal:
        attn_mask = reference.causal_mask(query.size(-2), key.size(-2), device=query.device)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, -math.inf) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1)


def _kept(weights, p):
    return torch.rand(weights.shape, device=weights.device) >= p  # [..., Tq, Tk]


@correct("sdpa")
def sdpa_with_dropout(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                          is_causal=is_causal, scale=scale)


@correct("sdpa")
def manual_dropout(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """F.dropout on the weights, as the seed's module does in training."""
    w = _weights(query, key, attn_mask, is_causal, scale)
    return F.dropout(w, dropout_p, training=dropout_p > 0) @ value


@buggy("dropout-mask", mistake="dropout-not-rescaled", bug="kept weights are not divided by (1 - p)", convention="sdpa")
def dropout_not_rescaled(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    return (w * _kept(w, dropout_p)) @ value


@buggy("dropout-mask", mistake="dropout-scaled-by-p", bug="kept weights are divided by p", convention="sdpa")
def dropout_scaled_by_p(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    return (w * _kept(w, dropout_p) / dropout_p if dropout_p else w) @ value


@buggy("dropout-mask", "dropout-mean", mistake="dropout-renormalised", bug="the softmax is taken over the kept scores",
       convention="sdpa")
def dropout_renormalised(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    dropped = w * _kept(w, dropout_p)
    return (dropped / dropped.sum(-1, keepdim=True).clamp(min=1e-30) if dropout_p else w) @ value


@buggy("dropout-mask", mistake="dropout-keep-inverted", bug="keeps where rand < p", convention="sdpa")
def dropout_keep_inverted(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    return (w * (torch.rand(w.shape) < dropout_p) / (1 - dropout_p) if dropout_p else w) @ value


@buggy("dropout-mask", mistake="dropout-keep-fraction", bug="the keep threshold is p / 4 (keeps 0.977 at p = 0.1)",
       convention="sdpa")
def dropout_keep_fraction(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    return (w * (torch.rand(w.shape) >= dropout_p / 4) / (1 - dropout_p)) @ value


@buggy("dropout-mask", mistake="dropout-on-output", bug="F.dropout on the output, not the weights", convention="sdpa")
def dropout_on_output(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.dropout(_weights(query, key, attn_mask, is_causal, scale) @ value, dropout_p, training=dropout_p > 0)


@buggy("dropout-mask", mistake="dropout-masked-keys", bug="the dropout path takes no mask: with dropout_p > 0 "
       "attn_mask and is_causal are dropped, masked keys get weight", convention="sdpa")
def dropout_masked_keys(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    if not dropout_p:
        return _weights(query, key, attn_mask, is_causal, scale) @ value
    w = _weights(query, key, None, False, scale)  # the training path: a fused dropout kernel with no mask argument
    return F.dropout(w, dropout_p) @ value


_FIXED = torch.Generator()


@buggy("dropout-mask", mistake="dropout-same-mask", bug="a generator seeded once with 0 per call: the same mask "
       "every step", convention="sdpa")
def dropout_same_mask(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    keep = torch.rand(w.shape, generator=_FIXED.manual_seed(0)) >= dropout_p
    return (w * keep / (1 - dropout_p)) @ value


@buggy("dropout-mean", mistake="dropout-unseeded", bug="the mask comes from a generator torch.manual_seed does not "
       "reach", convention="sdpa")
def dropout_unseeded(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    w = _weights(query, key, attn_mask, is_causal, scale)
    _FIXED.seed()  # a fresh, non-deterministic seed
    keep = torch.rand(w.shape, generator=_FIXED) >= dropout_p
    return (w * keep / (1 - dropout_p)) @ value


# ---------------------------------------------------------------- ALiBi (flash-attn's alibi_slopes)

def _alibi(query, key, value, alibi_slopes, causal, softmax_scale, sign=-1.0, offset=None, slopes_order=1):
    from attn_spec.properties.alibi import distance

    n_q, n_kv = query.shape[-2], key.shape[-2]
    scale = 1 / math.sqrt(query.size(-1)) if softmax_scale is None else softmax_scale
    scores = (query @ key.transpose(-2, -1)) * scale  # [B, H, Tq, Tk]
    if alibi_slopes is not None:
        slopes = alibi_slopes.flip(0) if slopes_order < 0 else alibi_slopes  # [H]
        d = distance(n_q, n_kv, offset).abs().to(scores.device, scores.dtype)  # [Tq, Tk]
        scores = scores + sign * slopes.to(scores.dtype)[:, None, None] * d
    if causal:
        scores = scores.masked_fill(~reference.causal_mask(n_q, n_kv, alignment="bottom-right", device=scores.device),
                                    -math.inf)
    return torch.softmax(scores, dim=-1) @ value


@correct("sdpa", layout="bhsd")
def alibi_kernel(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, alibi_slopes=None):
    """flash-attn's flash_attn_func signature (bhsd here), ALiBi aligned bottom-right."""
    return _alibi(q, k, v, alibi_slopes, causal, softmax_scale)


@buggy("alibi-slopes", mistake="alibi-sign-flipped", bug="the ALiBi bias is added with a + sign", convention="sdpa", layout="bhsd")
def alibi_sign_flipped(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, alibi_slopes=None):
    return _alibi(q, k, v, alibi_slopes, causal, softmax_scale, sign=1.0)


@buggy("alibi-slopes", mistake="alibi-heads-reversed", bug="head h gets slope H - 1 - h", convention="sdpa", layout="bhsd")
def alibi_heads_reversed(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, alibi_slopes=None):
    return _alibi(q, k, v, alibi_slopes, causal, softmax_scale, slopes_order=-1)


@buggy("alibi-slopes", mistake="alibi-top-left", bug="the distance is i - j", convention="sdpa", layout="bhsd")
def alibi_top_left(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, alibi_slopes=None):
    return _alibi(q, k, v, alibi_slopes, causal, softmax_scale, offset=0)


@buggy("alibi-slopes", mistake="alibi-ignored", bug="alibi_slopes is accepted and never used", convention="sdpa", layout="bhsd")
def alibi_ignored(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, alibi_slopes=None):
    return _alibi(q, k, v, None, causal, softmax_scale)
