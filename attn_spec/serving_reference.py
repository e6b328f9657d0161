"""What a correct serving kernel computes, in float64: short loops over ``attn_spec.reference``'s rules.

- decode (``flash_attn_with_kvcache``): batch element b attends its cache rows [leftpad_b, seqlens_b + S_new),
  after k and v are appended at rows [seqlens_b, seqlens_b + S_new); causal is aligned bottom-right, so decoding
  equals the last S_new rows of full causal attention. A paged cache [num_blocks, page, H_kv, D] holds row r of
  element b in page block_table[b, r // page] at offset r % page.
- varlen (``flash_attn_varlen_func``): sequence b's queries attend its own keys only, causal and the window
  aligned bottom-right per sequence (flash-attn's ``construct_local_mask``).
- merge (FlashInfer's ``merge_state``): two partial attentions (out_i, lse_i) over disjoint key sets combine into
  the one over their union, lse = log(exp(lse_a) + exp(lse_b)), out = sum_i exp(lse_i - lse) out_i; the empty set
  (0, -inf) is neutral, and two empty states merge to (0, -inf), not NaN.

Each sequence is plain attention (``reference.scores``' pieces: which keys a query sees, K/V grouping, the LSE); a
row with no key has out 0 and LSE -inf. The calling conventions (arguments, probes) live in attn_spec/targets.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference

F64 = torch.float64


def gather_pages(cache, block_table):
    """A paged cache [num_blocks, page, H_kv, D] as the contiguous one it stands for, [B, max_blocks * page, H_kv, D]:
    row r of element b is page block_table[b, r // page], offset r % page."""
    B, n = block_table.shape
    return cache[block_table.long()].reshape(B, n * cache.shape[1], *cache.shape[2:])  # [B, n * page, H_kv, D]


def scatter_pages(pages, contiguous, block_table):
    """``pages`` (a copy) with every page the block table lists overwritten by its rows of ``contiguous``."""
    pages = pages.clone()
    pages[block_table.long()] = contiguous.reshape(*block_table.shape, *pages.shape[1:]).to(pages.dtype)
    return pages


def decode_reference(q, k_cache, v_cache, cache_seqlens, k=None, v=None, cache_leftpad=None, *, causal=True,
                     scale=None, causal_alignment="bottom-right", block_table=None):
    """What a correct decode kernel computes, in float64: (out [B, S, H, D], lse [B, H, S] in base e, the caches
    after the append). Grouped K/V heads are repeated to the query heads; an empty row has out 0, LSE -inf.
    With ``block_table`` the caches are paged: gathered into contiguous ones, decoded, the pages written back;
    a length past the block table's capacity raises ValueError."""
    if block_table is not None:
        capacity = block_table.shape[1] * k_cache.shape[1]
        ends = torch.as_tensor(cache_seqlens).cpu() + (0 if k is None else k.shape[1])  # [B]
        if bool((ends > capacity).any()):
            raise ValueError(f"lengths {ends.tolist()} exceed the block table's capacity {capacity}")
        out, lse, k_flat, v_flat = decode_reference(
            q, gather_pages(k_cache, block_table), gather_pages(v_cache, block_table), cache_seqlens, k, v,
            cache_leftpad, causal=causal, scale=scale, causal_alignment=causal_alignment)
        k_pages, v_pages = (t.detach().to("cpu", F64) for t in (k_cache, v_cache))
        return out, lse, scatter_pages(k_pages, k_flat, block_table), scatter_pages(v_pages, v_flat, block_table)
    q, k_cache, v_cache = (t.detach().to("cpu", F64) for t in (q, k_cache, v_cache))
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    B, S, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.zeros(B, S, H, v_cache.shape[-1], dtype=F64)  # [B, S, H, Dv]
    lse = torch.full((B, H, S), -math.inf, dtype=F64)  # [B, H, S]
    for b in range(B):
        start, filled = (int(cache_leftpad[b]) if cache_leftpad is not None else 0), int(cache_seqlens[b])
        if k is not None:
            k_cache[b, filled:filled + S] = k[b].to("cpu", F64)  # [S, H_kv, D]
            v_cache[b, filled:filled + S] = v[b].to("cpu", F64)
        end = filled + (S if k is not None else 0)
        keys, values = (reference.repeat_kv(t[b, start:end], H // t.shape[2], dim=1) for t in (k_cache, v_cache))
        scores = scale * torch.einsum("shd,lhd->hsl", q[b], keys)  # [S, H, D] x [L, H, D] -> [H, S, L]
        if causal:
            scores = reference.masked(scores, reference.causal_mask(S, keys.shape[0], alignment=causal_alignment))
        lse[b] = reference.lse(scores)  # [H, S]; -inf for a row with no key
        out[b] = torch.einsum("hsl,lhd->shd", reference.lse_weights(scores, lse[b]), values)  # [S, H, Dv]
    return out, lse, k_cache, v_cache


def segment_mask(n_q: int, n_k: int, *, causal=False, window=None, alignment="bottom-right") -> torch.Tensor:
    """Bool [n_q, n_k]: query i of one sequence may attend key j. Query i sits at key position p = i + n_k - n_q
    (bottom-right; top-left: p = i); flash-attn's window (left, right), -1 unbounded, lets it see
    p - left <= j <= p + right; causal is right = 0."""
    left, right = window if window is not None else (-1, -1)
    right = 0 if causal else right
    positions = torch.arange(n_q) + reference.key_offset(n_q, n_k, alignment)  # [n_q]
    return reference.visible(positions, n_k, window=left + 1 if left >= 0 else None,
                             ahead=right if right >= 0 else None)  # [n_q, n_k]


def varlen_reference(q, k, v, cu_q, cu_k, *, causal=False, window=None, scale=None, softcap=None,
                     alignment="bottom-right", key_shift=0, grouping="blocked"):
    """What a correct varlen kernel computes, in float64: (out [T_q, H, Dv], lse [H, T_q] in base e). Grouped K/V
    heads are repeated to the query heads (query head h reads K/V head h // g); a row with no key has out 0, LSE
    -inf. ``alignment``, ``key_shift`` (segment b's keys read from rows [cu_k[b] + shift, cu_k[b + 1] + shift)) and
    ``grouping="tiled"`` (query head h reads K/V head h % H_kv) model mistakes."""
    q, k, v = (t.detach().to("cpu", F64) for t in (q, k, v))
    T_q, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.zeros(T_q, H, v.shape[-1], dtype=F64)  # [T_q, H, Dv]
    lse = torch.full((H, T_q), -math.inf, dtype=F64)  # [H, T_q]
    cu_q, cu_k = [int(x) for x in cu_q], [int(x) for x in cu_k]
    group = H // k.shape[1]
    repeat = (lambda t: t.repeat(1, group, 1)) if grouping == "tiled" else (lambda t: reference.repeat_kv(t, group, 1))
    for b in range(len(cu_q) - 1):
        rows = slice(cu_q[b], cu_q[b + 1])
        keys = slice(min(cu_k[b] + key_shift, k.shape[0]), min(cu_k[b + 1] + key_shift, k.shape[0]))
        q_b = q[rows].transpose(0, 1)  # [H, n_q, D]
        k_b, v_b = (repeat(t[keys]).transpose(0, 1) for t in (k, v))  # [H, n_k, D]
        scores = reference.softcapped(scale * q_b @ k_b.transpose(1, 2), softcap or None)  # [H, n_q, n_k]
        allowed = segment_mask(q_b.shape[1], k_b.shape[1], causal=causal, window=window, alignment=alignment)
        scores = reference.masked(scores, allowed)
        lse[:, rows] = reference.lse(scores)  # [H, n_q]; -inf for a row with no key
        out[rows] = (reference.lse_weights(scores, lse[:, rows]) @ v_b).transpose(0, 1)  # [n_q, H, Dv]
    return out, lse


def merge_reference(v_a, s_a, v_b, s_b, base: float = math.e):
    """The merge in float64, LSEs in ``base``: (v [T, H, D], s [T, H]); two empty states give (0, -inf)."""
    v_a, s_a, v_b, s_b = (t.detach().to("cpu", F64) for t in (v_a, s_a, v_b, s_b))
    s = torch.logaddexp(s_a * math.log(base), s_b * math.log(base))  # [T, H], natural log
    empty = torch.isneginf(s)
    w_a = torch.where(empty, 0.0, torch.exp(s_a * math.log(base) - s))[..., None]  # [T, H, 1]
    w_b = torch.where(empty, 0.0, torch.exp(s_b * math.log(base) - s))[..., None]
    return w_a * v_a + w_b * v_b, s / math.log(base)
