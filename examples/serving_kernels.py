"""Serving kernels on the CPU, checked by ``attn-spec check`` with no flags (the decode convention is detected
from flash-attn's parameter names):

    attn-spec check examples/serving_kernels.py:decode_kernel
    attn-spec check examples/serving_kernels.py:sdpa_decode
    attn-spec check examples/serving_kernels.py:paged_decode_kernel

``decode_kernel`` is a reference KV-cache decode kernel written plainly in torch; ``sdpa_decode`` is PyTorch's
SDPA used as one, through the small adapter a serving stack writes: it appends k and v to the cache, slices
the rows a sequence attends, and masks with ``causal_lower_right`` (SDPA's ``is_causal`` is aligned top-left,
which is wrong for decoding). ``paged_decode_kernel`` takes flash-attn's ``block_table`` too: its caches are then a
pool of pages [num_blocks, page, H_kv, D], element b's row r in page ``block_table[b, r // page]``.
"""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def _append(k_cache, v_cache, k, v, cache_seqlens):
    """Write k, v [B, S, H_kv, D] in place at rows [cache_seqlens_b, cache_seqlens_b + S); the new lengths [B]."""
    if k is None:
        return cache_seqlens
    S = k.shape[1]
    for b, start in enumerate(cache_seqlens.tolist()):
        k_cache[b, start:start + S] = k[b]  # [S, H_kv, D]
        v_cache[b, start:start + S] = v[b]
    return cache_seqlens + S


def decode_kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, cache_leftpad=None, softmax_scale=None,
                  causal=False, return_softmax_lse=False):
    """flash_attn_with_kvcache's contract, one batch element at a time: q [B, S, H, D], caches [B, S_c, H_kv, D]."""
    B, S, H, D = q.shape
    lengths = _append(k_cache, v_cache, k, v, cache_seqlens)  # [B]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)  # half-precision inputs accumulate in float32
    out = q.new_zeros(B, S, H, v_cache.shape[-1])  # [B, S, H, Dv]
    lse = torch.full((B, H, S), -math.inf, dtype=torch.float32)  # [B, H, S]
    for b in range(B):
        start = 0 if cache_leftpad is None else int(cache_leftpad[b])
        keys, values = k_cache[b, start:int(lengths[b])], v_cache[b, start:int(lengths[b])]  # [L, H_kv, D]
        group = H // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [L, H, D]
        scores = torch.einsum("shd,lhd->hsl", q[b].to(acc), keys.to(acc)) * scale  # [H, S, L]
        if causal:  # bottom-right: new token i is token L - S + i
            L = keys.shape[0]
            future = torch.arange(L)[None, :] > torch.arange(S)[:, None] + (L - S)  # [S, L]
            scores = scores.masked_fill(future, -math.inf)
        lse[b] = torch.logsumexp(scores, dim=-1).float()  # [H, S]
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [H, S, L]; a row with no key gives 0
        out[b] = torch.einsum("hsl,lhd->shd", weights, values.to(acc)).to(q.dtype)  # [S, H, Dv]
    return (out, lse) if return_softmax_lse else out


def paged_decode_kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, softmax_scale=None,
                        causal=False, return_softmax_lse=False):
    """decode_kernel over a paged cache: append through the block table, gather each element's rows in the table's
    order, decode. A length the block table cannot hold raises (flash-attn #2709 read past it silently)."""
    if block_table is None:
        return decode_kernel(q, k_cache, v_cache, k, v, cache_seqlens, None, softmax_scale, causal, return_softmax_lse)
    page, S = k_cache.shape[1], q.shape[1]
    lengths = cache_seqlens + (S if k is not None else 0)  # [B]
    if (lengths > block_table.shape[1] * page).any():
        raise ValueError(f"cache lengths {lengths.tolist()} exceed the block table's {block_table.shape[1]} pages "
                         f"of {page} rows")
    keys, values = [], []
    for b, length in enumerate(lengths.tolist()):
        rows = torch.arange(length)  # [L]
        pages, offsets = block_table[b, rows // page].long(), rows % page  # [L] each: where row r lives
        if k is not None:
            new = rows[int(cache_seqlens[b]):]  # [S]: the appended rows
            k_cache[pages[new], offsets[new]], v_cache[pages[new], offsets[new]] = k[b], v[b]  # [S, H_kv, D]
        keys.append(k_cache[pages, offsets])  # [L, H_kv, D]
        values.append(v_cache[pages, offsets])
    width = max(lengths.tolist())
    pad = lambda t: F.pad(t, (0, 0, 0, 0, 0, width - t.shape[0]))  # noqa: E731 - [width, H_kv, D]
    k_rows, v_rows = torch.stack([pad(t) for t in keys]), torch.stack([pad(t) for t in values])  # [B, width, H_kv, D]
    return decode_kernel(q, k_rows, v_rows, None, None, lengths, None, softmax_scale, causal, return_softmax_lse)


def sdpa_decode(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False):
    """SDPA as a decode kernel: append, then one SDPA call per sequence on its rows, causal_lower_right."""
    S = q.shape[1]
    lengths = _append(k_cache, v_cache, k, v, cache_seqlens)  # [B]
    rows = []
    for b, length in enumerate(lengths.tolist()):
        q_b = q[b:b + 1].transpose(1, 2)  # [1, H, S, D]
        k_b, v_b = (t[b:b + 1, :length].transpose(1, 2) for t in (k_cache, v_cache))  # [1, H_kv, L, D]
        mask = causal_lower_right(S, length) if causal else None
        rows.append(F.scaled_dot_product_attention(q_b, k_b, v_b, attn_mask=mask, scale=softmax_scale,
                                                   enable_gqa=q_b.shape[1] != k_b.shape[1]))  # [1, H, S, D]
    return torch.cat(rows).transpose(1, 2)  # [B, S, H, D]


def merge_state(v_a, s_a, v_b, s_b):
    """Two partial attentions v [T, H, D] with natural-log LSEs s [T, H], merged; two empty states give (0, -inf)."""
    s = torch.logaddexp(s_a, s_b)  # [T, H]; -inf only where both are empty
    safe = torch.where(torch.isneginf(s), 0.0, s)  # no -inf - (-inf)
    w_a, w_b = torch.exp(s_a - safe)[..., None], torch.exp(s_b - safe)[..., None]  # [T, H, 1]; 0 for an empty side
    v = w_a * v_a.to(w_a.dtype) + w_b * v_b.to(w_b.dtype)
    return v.to(v_a.dtype), s


def merge_state_base2(v_a, s_a, v_b, s_b):
    """FlashInfer's form: LSEs in base 2 (m + log2(d)); the header reports the base it was found to use."""
    s = torch.logaddexp2(s_a, s_b)  # [T, H]
    safe = torch.where(torch.isneginf(s), 0.0, s)
    w_a, w_b = torch.exp2(s_a - safe)[..., None], torch.exp2(s_b - safe)[..., None]  # [T, H, 1]
    return (w_a * v_a.to(w_a.dtype) + w_b * v_b.to(w_b.dtype)).to(v_a.dtype), s


def flash_cpu_decode(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False,
                     return_softmax_lse=False):
    """PyTorch's CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``, which returns the LSE) as a
    decode kernel, one sequence at a time on its own rows (the op is top-left causal, so causal is a bottom-right
    float mask of our own). The op dies on zero keys: a sequence with none gets one row, masked; the op then
    returns LSE 0 for it, which the header reports."""
    B, S, H, D = q.shape
    lengths = _append(k_cache, v_cache, k, v, cache_seqlens)  # [B]
    group = H // k_cache.shape[2]
    outs, lses = [], []
    for b, length in enumerate(lengths.tolist()):
        keys, values = (t[b:b + 1, :max(length, 1)].repeat_interleave(group, 2).transpose(1, 2)
                        for t in (k_cache, v_cache))  # [1, H, L, D]
        rows = torch.arange(keys.shape[2])[None, :]  # [1, L]
        blocked = (rows >= length) | ((rows > torch.arange(S)[:, None] + (length - S)) if causal else False)  # [S, L]
        mask = torch.zeros(1, 1, S, keys.shape[2], dtype=q.dtype).masked_fill(blocked, -math.inf)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q[b:b + 1].transpose(1, 2), keys, values, 0.0, False, attn_mask=mask, scale=softmax_scale)[:2]
        outs.append(out.transpose(1, 2))  # [1, S, H, D]
        lses.append(lse)  # [1, H, S]
    out, lse = torch.cat(outs), torch.cat(lses)
    return (out, lse) if return_softmax_lse else out
