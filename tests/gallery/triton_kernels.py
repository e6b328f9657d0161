"""Triton kernels for the kit's own tests (tests/test_triton.py): the flash-style forward of
examples/triton_attention.py, and variants that each carry one bug a kernel engineer ships (issue 35).

Each variant is the correct kernel with one switch (``bug=``): a host-side one (the grid, a length, a stride)
or a constexpr of the kernel (``BUG``), so that the diff from the correct kernel is one line. They are not in
the gallery's registries (CORRECT, BUGGY): they need triton, and under its interpreter (no GPU) a check of one
takes a minute; tests/test_triton.py checks each with the few properties that catch it.

==================  ==============================================================================
variant             the bug
==================  ==============================================================================
drops_tail_rows     the grid covers n_q // BLOCK_M row blocks: rows past the last full block never written
self_length         cross-attention reads only the first n_q keys (one length, a self-attention kernel's)
k_with_v_strides    K is read with V's strides
half_partials       float16 partial outputs for float32 inputs (acc rounded to float16 after each key block)
top_left_causal     is_causal aligned top-left (query i sees keys j <= i) where bottom-right is the contract
unmasked_store      the output's store is not masked: the tail block writes past the end of the output
pow2_head_dims      correct, but its host code asserts a head dim that is a power of two >= 16 (an envelope)
==================  ==============================================================================
"""
import math

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N = 16, 16
KERNEL_BUGS = ("top-left", "half-partials", "unmasked-store")  # the others are the host's


@triton.jit
def _forward(Q, K, V, Bias, Out, sq, sk, sv, sb, so, H, n_q, n_kv, d_k, d_v, scale,
             HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, BUG: tl.constexpr = ""):
    # sq, sk, sv, sb, so: each tensor's 4 strides [B, H, n, d], packed in a tuple
    b, h = tl.program_id(1) // H, tl.program_id(1) % H
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query rows
    dk, dv = tl.arange(0, BLOCK_DK), tl.arange(0, BLOCK_DV)
    q_ptrs = Q + b * sq[0] + h * sq[1] + rows[:, None] * sq[2] + dk[None, :] * sq[3]
    q = tl.load(q_ptrs, mask=(rows[:, None] < n_q) & (dk[None, :] < d_k), other=0.0)  # [BLOCK_M, BLOCK_DK]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # the running row maximum of the scores
    l = tl.zeros([BLOCK_M], tl.float32)  # the running sum of exp(score - m)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)  # the running sum of exp(score - m) * v
    offset = 0 if BUG == "top-left" else n_kv - n_q  # bottom-right: query i sees keys j <= i + offset
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
        if BUG == "half-partials":
            acc = acc.to(tl.float16).to(tl.float32)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)[:, None]  # a row with no allowed key: acc = 0, zeros
    o_ptrs = Out + b * so[0] + h * so[1] + rows[:, None] * so[2] + dv[None, :] * so[3]
    if BUG == "unmasked-store":
        tl.store(o_ptrs, out.to(Out.dtype.element_ty))
    else:
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(rows[:, None] < n_q) & (dv[None, :] < d_v))


def _as_bhnd(x, batch):
    """``x`` [..., n, d] broadcast to the batch dims ``batch`` and seen as [B, H, n, d] (a view up to 4 dims)."""
    x = x.expand(*batch, *x.shape[-2:])
    while x.dim() < 4:
        x = x.unsqueeze(0)
    return x.flatten(0, -4)


def flash(query, key, value, attn_mask=None, is_causal=False, scale=None, *, bug=""):
    """softmax(Q K^T * scale + mask) V for Q [..., n_q, d_k], K [..., n_kv, d_k], V [..., n_kv, d_v]; ``bug``: one
    of the variants' (the module's docstring), "" for none."""
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
    grid = (n_q // BLOCK_M if bug == "tail-rows" else triton.cdiv(n_q, BLOCK_M), q.shape[0] * q.shape[1])
    n_keys = min(n_q, n_kv) if bug == "self-length" else n_kv
    k_strides = v.stride() if bug == "v-strides" else k.stride()
    _forward[grid](q, k, v, bias, out, q.stride(), k_strides, v.stride(), bias.stride(), out.stride(),
                   q.shape[1], n_q, n_keys, d_k, d_v, 1 / math.sqrt(d_k) if scale is None else scale,
                   HAS_BIAS=attn_mask is not None, CAUSAL=is_causal, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                   BLOCK_DK=block_dk, BLOCK_DV=block_dv, BUG=bug if bug in KERNEL_BUGS else "")
    return out.reshape(*batch, n_q, d_v)


def attention(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """The correct kernel (examples/triton_attention.py's)."""
    return flash(query, key, value, attn_mask, is_causal, scale)


def drops_tail_rows(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Bug: a grid of n_q // BLOCK_M row blocks; the rows past the last full block are never written."""
    return flash(query, key, value, attn_mask, is_causal, scale, bug="tail-rows")


def self_length(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Bug: one length for queries and keys: cross-attention reads only the first n_q keys."""
    return flash(query, key, value, attn_mask, is_causal, scale, bug="self-length")


def k_with_v_strides(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Bug: K is read with V's strides (right only where K and V are laid out alike)."""
    return flash(query, key, value, attn_mask, is_causal, scale, bug="v-strides")


def half_partials(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Bug: the partial output is kept in float16 between key blocks, whatever the inputs' dtype."""
    return flash(query, key, value, attn_mask, is_causal, scale, bug="half-partials")


def top_left_causal(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Bug where bottom-right is the contract: is_causal lets query i see keys j <= i."""
    return flash(query, key, value, attn_mask, is_causal, scale, bug="top-left")


def unmasked_store(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Bug: the output's store is unmasked; the tail block writes past the end of the output (heap corruption)."""
    return flash(query, key, value, attn_mask, is_causal, scale, bug="unmasked-store")


def pow2_head_dims(query, key, value, attn_mask=None, is_causal=False, scale=None):
    """Correct within its envelope: its host code takes head dims that are powers of two of at least 16."""
    assert query.shape[-1] in (16, 32, 64, 128, 256) and value.shape[-1] == query.shape[-1], "head dims 16-256"
    return flash(query, key, value, attn_mask, is_causal, scale)
