"""Mistake models of the LSE a serving kernel returns (lse-equals-logsumexp), catalog entries of level decode or
varlen registered after attn_spec.diagnosis.serving's and serving_paged's and found the same way: each is the correct float64 kernel, its output
right, its LSE wrong the way the bug makes it, replayed on every call the failing property made (the record's
``lse``: natural log, decode [B, H, S_new], varlen [H, T_q]). Only bugs the LSE's numbers tell apart are modelled:
an LSE in base 2 where e was expected is a base the header's probe reports, not a mistake.
"""
from __future__ import annotations

import math

import torch

from attn_spec.diagnosis.model import mistake
from attn_spec.diagnosis.serving_correct import correct_decode
from attn_spec.serving_reference import decode_reference, varlen_reference


def lse_mistake(id: str, level: str, **words):
    """A model of the returned LSE: a serving entry of level ``level`` (decode or varlen) caught by
    lse-equals-logsumexp."""
    return mistake(id, level=level, family="serving", caught_by=("lse-equals-logsumexp",), **words)


def _decode_lse(c, **change):
    """The decode reference's LSE [B, H, S] on the recorded call, with ``change`` (causal, scale) made to it."""
    options = {"causal": c["causal"], "scale": c["scale"], **change}
    _, lse, _, _ = decode_reference(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k"], c["v"],
                                    c["cache_leftpad"], **options)
    return lse


def _varlen(c, **change):
    """The varlen reference's (out [T_q, H, Dv], lse [H, T_q]) on the recorded call, with ``change`` made to it."""
    options = {"causal": c["causal"], "window": c["window"], "scale": c["scale"], "softcap": c["softcap"], **change}
    return varlen_reference(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], **options)


@lse_mistake("lse-unscaled", "decode",
             sentence="the LSE is taken over the unscaled scores q . k: the weights are softmax(scale * q . k), the "
                      "log-sum-exp handed back forgets the scale",
             fix="return logsumexp of the scaled scores, the ones the weights come from (flash-attn keeps "
                 "m * scale + log l for exactly this)")
def lse_unscaled(c):
    return {**correct_decode(c), "lse": _decode_lse(c, scale=1.0)}


@lse_mistake("lse-mask-ignored", "decode",
             sentence="the LSE is taken before the causal mask: the output is causal, but new token i's LSE also "
                      "counts the keys after it",
             fix="take the LSE of the masked scores (-inf where the softmax has -inf), as the weights are")
def lse_mask_ignored(c):
    return {**correct_decode(c), "lse": _decode_lse(c, causal=False)}


@lse_mistake("lse-without-max", "decode",
             sentence="the LSE is log(sum(exp(s))) with no row max subtracted: exp overflows to inf once the sum "
                      "passes the largest number of the accumulation dtype (a score of 88.7 in float32)",
             fix="lse = m + log(sum(exp(s - m))) with m the row max (torch.logsumexp does it)")
def lse_without_max(c):
    lse = _decode_lse(c)
    acc = torch.promote_types(c["q"].dtype, torch.float32)  # where a kernel sums the exponentials
    return {**correct_decode(c), "lse": lse.masked_fill(lse > math.log(torch.finfo(acc).max), math.inf)}


@lse_mistake("lse-layout-transposed", "decode",
             sentence="the LSE is returned [B, S_new, H], laid out like q, not [B, H, S_new] as "
                      "flash_attn_with_kvcache returns it",
             fix="return lse.transpose(1, 2) (one row per head), or compute it [B, H, S_new] from the start")
def lse_layout_transposed(c):
    return {**correct_decode(c), "lse": _decode_lse(c).transpose(1, 2)}


@lse_mistake("varlen-lse-mask-ignored", "varlen",
             sentence="the LSE is taken over every key of the query's sequence, before causal and the window are "
                      "applied: the output is masked, the LSE counts the masked keys",
             fix="take the LSE of the masked scores of each sequence (-inf where the softmax has -inf)")
def varlen_lse_mask_ignored(c):
    out, _ = _varlen(c)
    return {"out": out, "lse": _varlen(c, causal=False, window=None)[1]}


@lse_mistake("varlen-lse-reshaped", "varlen",
             sentence="the LSE is computed [T_q, H] and reshaped (a view) to [H, T_q] instead of transposed: the "
                      "shape is right, the values of heads and rows are scrambled",
             fix="return lse.transpose(0, 1) (or .t().contiguous()): reshape keeps the memory order of [T_q, H]")
def varlen_lse_reshaped(c):
    out, lse = _varlen(c)
    return {"out": out, "lse": lse.t().contiguous().reshape(lse.shape)}
