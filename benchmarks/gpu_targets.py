"""Targets for ``bench_scale.py --gpu-conformance``: SDPA pinned to one backend, and FlexAttention.

Each takes SDPA's signature (the ``sdpa`` convention). A backend that has no kernel for an input
(a mask its flash kernel does not take, say) raises NotImplementedError: the kit then checks the
inputs it does support, as for any target that declares an input unsupported.
"""
import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def _pinned(backend):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        try:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                                      is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        except RuntimeError as exc:
            if "No available kernel" in str(exc) or "No viable backend" in str(exc):
                raise NotImplementedError(f"{backend.name}: {str(exc).splitlines()[0]}") from None
            raise
    return sdpa


sdpa_math = _pinned(SDPBackend.MATH)
sdpa_flash = _pinned(SDPBackend.FLASH_ATTENTION)
sdpa_efficient = _pinned(SDPBackend.EFFICIENT_ATTENTION)
sdpa_cudnn = _pinned(SDPBackend.CUDNN_ATTENTION)


@functools.cache
def _compiled():
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention)


def flex(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """FlexAttention, compiled: a mask [..., Tq or 1, Tk] (bool, or SDPA's additive float) and is_causal become
    a score_mod."""
    n_q, n_kv = query.shape[-2], key.shape[-2]
    mask = attn_mask
    if mask is not None:
        mask = mask.expand(*query.shape[:-2], mask.shape[-2], n_kv)  # [B, H, Tq or 1, Tk]

    def score_mod(score, b, h, i, j):
        if mask is not None:
            m = mask[b, h, i if mask.shape[-2] == n_q else 0, j]
            score = torch.where(m, score, -math.inf) if mask.dtype == torch.bool else score + m
        if is_causal:
            score = torch.where(j <= i, score, -math.inf)
        return score

    plain = mask is None and not is_causal
    return _compiled()(query, key, value, score_mod=None if plain else score_mod, scale=scale, enable_gqa=enable_gqa)
