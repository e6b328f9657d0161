"""Attention the way fused kernels compute it: blocks of keys and an online softmax (FlashAttention's
recurrence) in plain PyTorch, so no [n_q, n_kv] score matrix is ever held.

- ``attention``: correct. Scores and accumulators in float32 for 16-bit inputs, as kernels keep them.
- ``drops_last_block``: the classic tail bug of a blocked kernel. Its key loop runs n_kv // BLOCK
  times, so the keys of a last, partial block are never read; sequences that fit in one block take
  a single-block path and are right. The default profile passes it (its longest rows, 640 keys, fit
  in one block); a long sequence whose length is not a multiple of BLOCK exposes it:

    attn-spec check examples/blocked_attention.py:drops_last_block --shapes 1,1,1,256,2600,64
"""
import math

import torch

BLOCK = 1024  # keys per block


def _online_softmax(Q, K, V, mask, stop):
    """softmax(Q K^T / sqrt(d_k)) V over keys [0, stop), one block of keys at a time."""
    wide = torch.float32 if Q.element_size() < 4 else Q.dtype
    q = Q.to(wide) / math.sqrt(Q.shape[-1])  # [..., Tq, Dk]
    run_max = run_sum = acc = None
    for start in range(0, stop, BLOCK):
        end = min(start + BLOCK, stop)
        s = q @ K[..., start:end, :].to(wide).transpose(-2, -1)  # [..., Tq, b]
        if mask is not None:
            s = s.masked_fill(~mask[..., start:end], -math.inf)
        new_max = s.amax(dim=-1, keepdim=True) if run_max is None else torch.maximum(run_max, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)  # rows with no key so far
        p = torch.exp(s - safe)  # [..., Tq, b]
        pv = p @ V[..., start:end, :].to(wide)  # [..., Tq, Dv]
        if acc is None:
            acc, run_sum = pv, p.sum(dim=-1, keepdim=True)
        else:
            correction = torch.exp(run_max - safe)  # rescales what was accumulated so far
            acc, run_sum = acc * correction + pv, run_sum * correction + p.sum(dim=-1, keepdim=True)
        run_max = new_max
    out = torch.where(run_sum > 0, acc / run_sum, torch.zeros_like(acc))  # a row with no allowed key: zeros
    return out.to(Q.dtype)  # [..., Tq, Dv]


def attention(Q, K, V, mask=None):
    return _online_softmax(Q, K, V, mask, K.shape[-2])


def drops_last_block(Q, K, V, mask=None):
    n_kv = K.shape[-2]
    return _online_softmax(Q, K, V, mask, n_kv if n_kv <= BLOCK else n_kv - n_kv % BLOCK)
