"""Stand-ins for the kernels engineers ship, in plain torch: a blocked flash-style forward (rows in blocks of 64, keys
in blocks of 64, an online softmax with float32 partials) whose host code declares its envelope as real Triton and
CUDA kernels do: ``assert D in (16, 32, 64, 128)``, float16/bfloat16 only, d_v == d_k, n_q == n_kv, raised from its
own code before any arithmetic on the inputs. Each bug variant below is one bug engineers have shipped.

All take ``attention(q, k, v, is_causal=False, scale=None)`` on [B, H, N, D] tensors (the sdpa convention)."""
import math

import torch

BLOCK = 64


def _declare(q, k, v, *, dtypes=(torch.float16, torch.bfloat16), square=True):
    """The host code's checks, before any arithmetic."""
    if q.dtype not in dtypes:
        raise TypeError(f"dtype {q.dtype} not supported: {', '.join(map(str, dtypes))} only")
    assert q.shape[-1] in (16, 32, 64, 128), f"head dim {q.shape[-1]}: 16, 32, 64 or 128 only"
    assert k.shape[-1] == q.shape[-1] and v.shape[-1] == q.shape[-1], "d_v must equal d_k"
    if square:
        assert q.shape[-2] == k.shape[-2], "self-attention only: n_q == n_kv"


def _forward(q, k, v, causal, sm_scale, *, rows=None, keys=None, partial=torch.float32, top_left=True):
    """The blocked forward: each block of query rows (``rows``: how many rows are computed, default all) over
    ``keys`` keys (default all) in blocks, partials kept in ``partial``; causal top-left or bottom-right."""
    n_q, n_kv, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale
    rows = n_q if rows is None else rows
    keys = n_kv if keys is None else keys
    offset = 0 if top_left else n_kv - n_q
    out = torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)  # [B, H, Nq, Dv]
    for start in range(0, rows, BLOCK):
        qb = q[..., start:start + BLOCK, :].float()  # [B, H, r, D]
        r = qb.shape[-2]
        m = torch.full((*qb.shape[:-1], 1), -math.inf)  # [B, H, r, 1] running max
        total = torch.zeros(*qb.shape[:-1], 1, dtype=partial)  # [B, H, r, 1] running sum
        acc = torch.zeros(*qb.shape[:-1], v.shape[-1], dtype=partial)  # [B, H, r, Dv]
        for kstart in range(0, keys, BLOCK):
            kb, vb = k[..., kstart:min(kstart + BLOCK, keys), :].float(), v[..., kstart:min(kstart + BLOCK, keys), :].float()
            s = qb @ kb.transpose(-2, -1) * scale  # [B, H, r, c]
            if causal:
                i = torch.arange(start, start + r)[:, None] + offset
                j = torch.arange(kstart, kstart + kb.shape[-2])[None, :]
                s = s.masked_fill(j > i, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))  # [B, H, r, 1]
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = torch.exp(s - safe)  # [B, H, r, c]
            alpha = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf), m - safe))
            total = (total.float() * alpha + p.sum(dim=-1, keepdim=True)).to(partial)
            acc = (acc.float() * alpha + p @ vb).to(partial)
            m = m_new
        out[..., start:start + r, :] = (acc.float() / total.float().clamp_min(1e-30)).to(q.dtype)
    return out


def flash(q, k, v, is_causal=False, scale=None):
    """Correct: float16/bfloat16, head dims 16/32/64/128, d_v == d_k, self-attention only."""
    _declare(q, k, v)
    return _forward(q, k, v, is_causal, scale)


def flash_cross(q, k, v, is_causal=False, scale=None):
    """Correct, taking cross-attention (n_q != n_kv) and float32, causal aligned bottom-right (the KV-cache contract)."""
    _declare(q, k, v, dtypes=(torch.float16, torch.bfloat16, torch.float32), square=False)
    return _forward(q, k, v, is_causal, scale, top_left=False)


def drops_tail_rows(q, k, v, is_causal=False, scale=None):
    """Bug: the grid covers only the full blocks of 64 query rows; rows past the last full block stay zero."""
    _declare(q, k, v)
    return _forward(q, k, v, is_causal, scale, rows=q.shape[-2] // BLOCK * BLOCK)


def reads_nq_keys(q, k, v, is_causal=False, scale=None):
    """Bug: cross-attention's key loop runs to n_q, not n_kv: the keys past the first n_q are never read."""
    _declare(q, k, v, dtypes=(torch.float16, torch.bfloat16, torch.float32), square=False)
    return _forward(q, k, v, is_causal, scale, keys=min(q.shape[-2], k.shape[-2]), top_left=False)


def half_partials(q, k, v, is_causal=False, scale=None):
    """Bug: float32 inputs, but the partial sums and outputs kept in float16 (a split-kv kernel's scratch buffer)."""
    _declare(q, k, v, dtypes=(torch.float16, torch.bfloat16, torch.float32), square=False)
    return _forward(q, k, v, is_causal, scale, partial=torch.float16, top_left=False)


def k_with_v_strides(q, k, v, is_causal=False, scale=None):
    """Bug: K is read with V's strides (one stride argument passed for both): right while they share a layout."""
    _declare(q, k, v, dtypes=(torch.float16, torch.bfloat16, torch.float32), square=False)
    k = torch.as_strided(k, k.shape, v.stride(), k.storage_offset()) if k.shape == v.shape else k
    return _forward(q, k, v, is_causal, scale, top_left=False)


def top_left(q, k, v, is_causal=False, scale=None):
    """Correct but for the contract: causal aligned top-left where the serving contract is bottom-right."""
    _declare(q, k, v, dtypes=(torch.float16, torch.bfloat16, torch.float32), square=False)
    return _forward(q, k, v, is_causal, scale, top_left=True)
