"""A flash-style attention forward in Triton: check it with `attn-spec check examples/triton_attention.py:attention`.

One program computes BLOCK_M query rows of one (batch, head): it walks the keys BLOCK_N at a time, keeping the
running maximum m, the running sum l and the unnormalised output acc of the online softmax in float32, and
divides once at the end. Loads are masked, so any n_q, n_kv and head dim work (a head dim is padded to a power
of two of at least 16 in registers, what tl.arange and tl.dot need). ``is_causal`` is aligned bottom-right (query
i sees keys up to i + n_kv - n_q, as flash-attn >= 2.1 and a KV cache); ``attn_mask`` is bool (True = may attend)
or an additive float mask, as in torch's scaled_dot_product_attention, whose signature this follows.

Without a GPU the kit runs it under Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors.
"""
import math

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 16, 16


@triton.jit
def _forward(Q, K, V, Bias, Out, sq, sk, sv, sb, so, H, n_q, n_kv, d_k, d_v, scale,
             HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    # sq, sk, sv, sb, so: each tensor's 4 strides [B, H, n, d], packed in a tuple
    b, h = tl.program_id(1) // H, tl.program_id(1) % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
    dk, dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * sq[0] + h * sq[1] + rows[:, None] * sq[2] + dk[None, :] * sq[3]
    q = tl.load(q_ptrs, mask=(rows[:, None] < n_q) & (dk[None, :] < d_k), other=0.0)  # [BLOCK_M, BLOCK_DK]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the running row maximum of the scores
    l = tl.zeros([BLOCK_M], tl.float32)  # the running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # the running sum of exp(score - m) * v
    offset = n_kv - n_q  # bottom-right: query i sees keys j <= i + offset
    end = tl.minimum(n_kv, (tl.program_id(0) + 1) * BLOCK_M + offset) if CAUSAL else n_kv
    for start in range(0, end, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        k_ptrs = K + b * sk[0] + h * sk[1] + cols[None, :] * sk[2] + dk[:, None] * sk[3]
        k = tl.load(k_ptrs, mask=(cols[None, :] < n_kv) & (dk[:, None] < d_k), other=0.0)  # [BLOCK_DK, BLOCK_N]
        s = tl.dot(q, k, out_dtype=tl.float32) * scale  # [BLOCK_M, BLOCK_N]
        allowed = (rows[:, None] < n_q) & (cols[None, :] < n_kv)
        if CAUSAL:
            allowed &= cols[None, :] <= rows[:, None] + offset
        if HAS_BIAS:
            b_ptrs = Bias + b * sb[0] + h * sb[1] + rows[:, None] * sb[2] + cols[None, :] * sb[3]
            s += tl.load(b_ptrs, mask=allowed, other=0.0)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key allowed yet: exp(-inf) = 0
        p = tl.exp(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        alpha = tl.exp(m - m_safe)  # rescales what was summed under the old maximum
        v_ptrs = V + b * sv[0] + h * sv[1] + cols[:, None] * sv[2] + dv[None, :] * sv[3]
        v = tl.load(v_ptrs, mask=(cols[:, None] < n_kv) & (dv[None, :] < d_v), other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row with no allowed key: acc = 0, zeros
    o_ptrs = Out + b * so[0] + h * so[1] + rows[:, None] * so[2] + dv[None, :] * so[3]
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(rows[:, None] < n_q) & (dv[None, :] < d_v))


def _as_bhnd(x, batch):
    """``x`` [..., n, d] broadcast to the batch dims ``batch`` and seen as [B, H, n, d] (a view up to 4 dims)."""
    x = x.expand(*batch, *x.shape[-2:])
    while x.dim() < 4:
        x = x.unsqueeze(0)
    return x.flatten(0, -4)


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """softmax(Q K^T * scale + mask) V for Q [..., n_q, d_k], K [..., n_kv, d_k], V [..., n_kv, d_v]."""
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32) or key.dtype != query.dtype \
            or value.dtype != query.dtype:
        raise NotImplementedError("float16, bfloat16 and float32 only, the same for Q, K and V")
    n_q, d_k, n_kv, d_v = *query.shape[-2:], *value.shape[-2:]
    batch = torch.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    q, k, v = (_as_bhnd(x, batch) for x in (query, key, value))
    bias = q.new_zeros(())  # [B, H, n_q, n_kv] once expanded: the additive mask, 0 where a key may be attended
    if attn_mask is not None:
        bias = attn_mask.float() if attn_mask.dtype != torch.bool else \
            torch.zeros(attn_mask.shape, device=query.device).masked_fill(~attn_mask, float("-inf"))
    bias = _as_bhnd(bias.expand(*batch, n_q, n_kv), batch)
    out = torch.empty(*q.shape[:2], n_q, d_v, dtype=query.dtype, device=query.device)  # [B, H, n_q, d_v]
    block_dk, block_dv = max(16, triton.next_power_of_2(d_k)), max(16, triton.next_power_of_2(d_v))
    assert block_dk & (block_dk - 1) == 0 and block_dk >= 16, "tl.dot takes power-of-two blocks of at least 16"
    grid = (triton.cdiv(n_q, BLOCK_M), q.shape[0] * q.shape[1])
    _forward[grid](q, k, v, bias, out, q.stride(), k.stride(), v.stride(), bias.stride(), out.stride(),
                   q.shape[1], n_q, n_kv, d_k, d_v, 1 / math.sqrt(d_k) if scale is None else scale,
                   HAS_BIAS=attn_mask is not None, CAUSAL=is_causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                   BLOCK_DK=block_dk, BLOCK_DV=block_dv)
    return out.reshape(*batch, n_q, d_v)
