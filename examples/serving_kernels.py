"""Serving kernels on the CPU, checked by ``attn-spec check`` with no flags (the decode convention is detected
from flash-attn's parameter names):

    attn-spec check examples/serving_kernels.py:decode_kernel
    attn-spec check examples/serving_kernels.py:sdpa_decode
    attn-spec check examples/serving_kernels.py:paged_decode_kernel
    attn-spec check examples/serving_kernels.py:varlen_kernel
    attn-spec check examples/serving_kernels.py:nested_sdpa_varlen
    attn-spec check examples/serving_kernels.py:flex_varlen

``decode_kernel`` is a reference KV-cache decode kernel written plainly in torch; ``sdpa_decode`` is PyTorch's
SDPA used as one, through the small adapter a serving stack writes: it appends k and v to the cache, slices
the rows a sequence attends, and masks with ``causal_lower_right`` (SDPA's ``is_causal`` is aligned top-left,
which is wrong for decoding). ``paged_decode_kernel`` takes flash-attn's ``block_table`` too: its caches are then a
pool of pages [num_blocks, page, H_kv, D], element b's row r in page ``block_table[b, r // page]``.
which is wrong for decoding). ``varlen_kernel`` is a reference packed-batch kernel with flash_attn_varlen_func's
signature; ``nested_sdpa_varlen`` is SDPA on nested (jagged) tensors used as one, non-causal (SDPA takes no
causal nested tensors); ``flex_varlen`` is FlexAttention in eager mode with a document mask, causal per sequence,
returning its LSE.
"""
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


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


def varlen_kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
                  window_size=(-1, -1), softcap=0.0, return_attn_probs=False):
    """flash_attn_varlen_func's contract, one sequence at a time: q [T_q, H, D], k, v [T_k, H_kv, D]; causal and the
    window (left, right) are aligned bottom-right per sequence; with return_attn_probs, (out, lse [H, T_q], None)."""
    T_q, H, D = q.shape
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)  # half-precision inputs accumulate in float32
    left, right = window_size[0], 0 if causal else window_size[1]
    out = q.new_zeros(T_q, H, v.shape[-1])  # [T_q, H, Dv]
    lse = torch.full((H, T_q), -math.inf, dtype=torch.float32)  # [H, T_q]
    for b in range(len(cu_seqlens_q) - 1):
        rows, keys = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])), slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        group = H // k.shape[1]
        k_b, v_b = (t[keys].repeat_interleave(group, 1).to(acc) for t in (k, v))  # [n_k, H, D]
        scores = torch.einsum("shd,lhd->hsl", q[rows].to(acc), k_b) * scale  # [H, n_q, n_k]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        n_q, n_k = scores.shape[1:]
        pos, j = torch.arange(n_q)[:, None] + (n_k - n_q), torch.arange(n_k)[None, :]  # query i sits at key pos
        blocked = ((j > pos + right) if right >= 0 else False) | ((j < pos - left) if left >= 0 else False)
        scores = scores.masked_fill(torch.as_tensor(blocked), -math.inf)
        lse[:, rows] = torch.logsumexp(scores, dim=-1).float()  # [H, n_q]; -inf for a row with no key
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # [H, n_q, n_k]; a row with no key gives 0
        out[rows] = torch.einsum("hsl,lhd->shd", weights, v_b).to(q.dtype)  # [n_q, H, Dv]
    return (out, lse, None) if return_attn_probs else out


def nested_sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None):
    """SDPA on nested (jagged) tensors as a varlen kernel: the packed sequences seen as [B, j, H, D] through their
    offsets; non-causal only (SDPA has no causal path for nested tensors). A sequence with no queries or no keys
    is left out of the call, its rows 0: in torch 2.13 SDPA on nested tensors raises on a sequence with queries
    and no keys ("setStorage: ... out of bounds", or "to_padded_tensor: at least one constituent tensor should
    have non-zero numel")."""
    n_q, n_k = cu_seqlens_q.diff(), cu_seqlens_k.diff()  # [B]
    kept = ((n_q > 0) & (n_k > 0)).nonzero().flatten().tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # [T_q, H, Dv]
    if not kept:
        return out
    rows = torch.cat([torch.arange(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])) for b in kept])  # [T_q']
    keys = torch.cat([torch.arange(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])) for b in kept])  # [T_k']
    offsets = [torch.cat([n.new_zeros(1), n[kept].cumsum(0)]) for n in (n_q, n_k)]  # [B' + 1] each
    nested = [torch.nested.nested_tensor_from_jagged(t, cu, max_seqlen=n).transpose(1, 2)
              for t, cu, n in ((q[rows], offsets[0], max_seqlen_q), (k[keys], offsets[1], max_seqlen_k),
                               (v[keys], offsets[1], max_seqlen_k))]  # [B', H, j, D]
    found = F.scaled_dot_product_attention(*nested, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    out[rows] = found.transpose(1, 2).values()  # [T_q', H, Dv]
    return out


def flex_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None, causal=False,
                window_size=(-1, -1), return_softmax_lse=False):
    """FlexAttention (eager) as a varlen kernel: one [1, H, T, D] call whose mask_mod keeps each query inside its
    own sequence (a document mask from cu_seqlens), causal and the window aligned bottom-right per sequence; the
    LSE returned [H, T_q]. An empty batch is answered without a call (Flex takes no zero-length sequence)."""
    T_q, H, D = q.shape
    T_k = k.shape[0]
    if T_q == 0 or T_k == 0:
        out, lse = q.new_zeros(T_q, H, v.shape[-1]), torch.full((H, T_q), -math.inf)  # [T_q, H, Dv], [H, T_q]
        return (out, lse) if return_softmax_lse else out
    cu_q, cu_k = cu_seqlens_q.long(), cu_seqlens_k.long()
    doc_q = torch.searchsorted(cu_q, torch.arange(T_q), right=True) - 1  # [T_q]: the sequence of each query
    doc_k = torch.searchsorted(cu_k, torch.arange(T_k), right=True) - 1  # [T_k]
    shift = cu_k.diff() - cu_q.diff()  # [B]: n_k - n_q, where query 0 of each sequence sits
    left, right = window_size[0], 0 if causal else window_size[1]

    def mask_mod(b, h, q_idx, kv_idx):  # same sequence, and key j of it within the window around pos
        d = doc_q[q_idx]
        pos = q_idx - cu_q[d] + shift[d]
        j = kv_idx - cu_k[doc_k[kv_idx]]
        ok = d == doc_k[kv_idx]
        if right >= 0:
            ok = ok & (j <= pos + right)
        if left >= 0:
            ok = ok & (j >= pos - left)
        return ok
    block = create_block_mask(mask_mod, 1, 1, T_q, T_k, device=q.device)  # Flex's own sparsity, from the mask
    out, lse = flex_attention(*(t.transpose(0, 1)[None] for t in (q, k, v)), block_mask=block, scale=softmax_scale,
                              enable_gqa=H != k.shape[1], return_lse=True)
    out = out[0].transpose(0, 1)  # [T_q, H, Dv]
    return (out, lse[0]) if return_softmax_lse else out


def split_decode_kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, softmax_scale=None, causal=False,
                        num_splits=0):
    """flash-decoding: each element's keys in ``num_splits`` chunks (0: one per 64 keys), each chunk attended on its
    own, the partial results merged by their log-sum-exp."""
    B, S, H, D = q.shape
    lengths = _append(k_cache, v_cache, k, v, cache_seqlens)  # [B]
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    acc = torch.promote_types(q.dtype, torch.float32)  # half-precision inputs accumulate in float32
    out = q.new_zeros(B, S, H, v_cache.shape[-1])  # [B, S, H, Dv]
    for b in range(B):
        L = int(lengths[b])
        group = H // k_cache.shape[2]
        keys = k_cache[b, :L].repeat_interleave(group, 1).to(acc)  # [L, H, D]
        values = v_cache[b, :L].repeat_interleave(group, 1).to(acc)
        scores = torch.einsum("shd,lhd->hsl", q[b].to(acc), keys) * scale  # [H, S, L]
        if causal:
            scores = scores.masked_fill(torch.arange(L)[None, :] > torch.arange(S)[:, None] + (L - S), -math.inf)
        size = max(1, math.ceil(L / (num_splits or max(1, math.ceil(L / 64)))))
        parts = [(torch.logsumexp(scores[..., c:c + size], dim=-1),  # [H, S]
                  torch.einsum("hsl,lhd->hsd", torch.softmax(scores[..., c:c + size], dim=-1).nan_to_num(0.0),
                               values[c:c + size])) for c in range(0, L, size)]
        lse = torch.logsumexp(torch.stack([p[0] for p in parts]), dim=0)  # [H, S]
        merged = sum(torch.exp(p[0] - lse).nan_to_num(0.0)[..., None] * p[1] for p in parts)  # [H, S, Dv]
        out[b] = merged.transpose(0, 1).to(q.dtype)
    return out
