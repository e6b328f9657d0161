"""Serving kernels (the decode convention): correct ones that must conform, and the classic kernel bugs, each
caught by the properties made for it and named by one root (attn_spec.diagnosis.serving)."""
import math
from pathlib import Path

import torch

from attn_spec.targets.loading import load_target
from gallery import buggy, correct

KERNELS = Path(__file__).resolve().parents[2] / "examples" / "serving_kernels.py"


def _decode(q, k_cache, v_cache, k, v, cache_seqlens, *, causal, attended=None, write_at=None, top_left=False):
    """A decode kernel with one thing changeable: the rows attended ([0, end) by default, end = seqlens + S),
    where the new rows are written, and the causal alignment."""
    B, S, H, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        start = int(cache_seqlens[b]) if write_at is None else write_at(int(cache_seqlens[b]))
        if k is not None:
            k_cache[b, start:start + S], v_cache[b, start:start + S] = k[b], v[b]
        end = int(cache_seqlens[b]) + (S if k is not None else 0)
        end = end if attended is None else attended(end, k_cache.shape[1])
        keys, values = k_cache[b, :end].transpose(0, 1), v_cache[b, :end].transpose(0, 1)  # [H, L, D]
        scores = q[b].transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(D)  # [H, S, L]
        if causal:
            offset = 0 if top_left else end - S
            scores = scores.masked_fill(torch.arange(end)[None, :] > torch.arange(S)[:, None] + offset, -math.inf)
        out[b] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)  # [S, H, D]
    return out


correct("decode", name="decode_reference_kernel")(load_target(f"{KERNELS}:decode_kernel"))
correct("decode", name="sdpa_causal_lower_right_decode")(load_target(f"{KERNELS}:sdpa_decode"))


@buggy("decode-equals-full-causal", bug="SDPA's is_causal (top-left) used for decoding", mistake="decode-causal-top-left",
       convention="decode")
def decode_top_left(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    return _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, top_left=True)


@buggy("cache-outside-invariance", "decode-equals-full-causal", bug="attends every cache row (cache_seqlens ignored)",
       mistake="cache-tail-read", convention="decode")
def decode_tail_read(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    return _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, attended=lambda end, size: size)


@buggy("append-writes-exactly", "cache-outside-invariance", "decode-equals-full-causal", bug="appends one row late and attends one row further",
       mistake="cache-append-off-by-one", convention="decode")
def decode_append_off_by_one(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    return _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, write_at=lambda start: start + 1,
                   attended=lambda end, size: end + 1 if k is not None else end)


@buggy("chunked-prefill-equals-one-shot", bug="takes the one-token decode path whenever the cache is not empty: no "
       "causal mask inside a chunk", mistake="decode-chunk-unmasked", convention="decode")
def decode_chunk_unmasked(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        out[b:b + 1] = _decode(q[b:b + 1], k_cache[b:b + 1], v_cache[b:b + 1], None if k is None else k[b:b + 1],
                               None if v is None else v[b:b + 1], cache_seqlens[b:b + 1],
                               causal=causal and int(cache_seqlens[b]) == 0)
    return out


correct("merge", name="merge_state_reference")(load_target(f"{KERNELS}:merge_state"))
correct("merge", name="merge_state_base2")(load_target(f"{KERNELS}:merge_state_base2"))


@buggy("merge-empty-neutral", bug="max-subtraction without a guard: two empty states give NaN (FlashInfer #4051)",
       mistake="merge-empty-nan", convention="merge")
def merge_nan_on_empty(v_a, s_a, v_b, s_b):
    m = torch.maximum(s_a, s_b)  # [T, H]
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)  # NaN where both are -inf
    d = w_a + w_b
    return (w_a[..., None] * v_a + w_b[..., None] * v_b) / d[..., None], m + torch.log(d)


@buggy("merge-equals-union", bug="the merged LSE is the max of the two, the log of the rescaled sum forgotten",
       mistake="merge-lse-max", convention="merge")
def merge_lse_is_max(v_a, s_a, v_b, s_b):
    s = torch.logaddexp(s_a, s_b)
    safe = torch.where(torch.isneginf(s), 0.0, s)
    w_a, w_b = torch.exp(s_a - safe)[..., None], torch.exp(s_b - safe)[..., None]
    return (w_a * v_a + w_b * v_b).to(v_a.dtype), torch.maximum(s_a, s_b)


correct("decode", name="cpu_flash_op_decode")(load_target(f"{KERNELS}:flash_cpu_decode"))


def _paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, *, causal, read=None, order=None, write_page=None,
           table_row=None):
    """A paged decode kernel (a contiguous cache is a pool of one page per element) with one thing changeable: how
    many rows it reads, the order of the pages read, the page a new row is written to, the table row it uses."""
    B, S, H, D = q.shape
    table = torch.arange(B, dtype=torch.int32)[:, None] if block_table is None else block_table  # [B, max_blocks]
    P, out = k_cache.shape[1], torch.zeros_like(q)
    for b in range(B):
        start = int(cache_seqlens[b])
        end = start + (S if k is not None else 0)
        row = table[b] if table_row is None else table_row(table, b, -(-end // P))  # [pages]
        for t in range(S if k is not None else 0):
            page = int(row[(start + t) // P]) if write_page is None else write_page(row, start, P)
            k_cache[page, (start + t) % P], v_cache[page, (start + t) % P] = k[b, t], v[b, t]
        n = end if read is None else read(end, P)
        rows = torch.arange(n)  # [n]
        pages = (row if order is None else order(row[:-(-n // P)]))[rows // P].long()  # [n]
        keys, values = k_cache[pages, rows % P].transpose(0, 1), v_cache[pages, rows % P].transpose(0, 1)  # [H, n, D]
        scores = q[b].transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(D)  # [H, S, n]
        if causal:
            scores = scores.masked_fill(torch.arange(n)[None, :] > torch.arange(S)[:, None] + n - S, -math.inf)
        out[b] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)  # [S, H, D]
    return out


correct("decode", name="paged_decode_reference_kernel")(load_target(f"{KERNELS}:paged_decode_kernel"))


@buggy("paged-outside-invariance", "paged-equals-contiguous", "cache-outside-invariance",
       bug="reads the last page whole: its unfilled tail is attended (PyTorch #159247)", mistake="page-tail-read",
       convention="decode")
def paged_tail_read(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
    return _paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal,
                  read=lambda end, page: -(-end // page) * page)


@buggy("paged-outside-invariance", bug="over a paged cache, multiplies every pool slot's value by its weight (0 "
       "outside the sequence), as FlexAttention's eager path does: NaN in a free page gives NaN; a contiguous cache is "
       "read right, so the header's probe finds NaN ignored", mistake="masked-slots-times-zero", convention="decode")
def paged_free_slots_times_zero(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
    out = _paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal)  # [B, S, H, D]
    if block_table is None:
        return out
    group = q.shape[2] // v_cache.shape[2]
    return out + 0 * v_cache.sum((0, 1)).repeat_interleave(group, 0)  # [H, D]: 0 * every slot, NaN where any is NaN


@buggy("paged-equals-contiguous", bug="gathers each element's pages in physical order (sorted), not the table's",
       mistake="paged-physical-order", convention="decode")
def paged_physical_order(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
    return _paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal,
                  order=lambda pages: pages.sort().values)


@buggy("paged-append-writes-exactly", bug="writes every new row into the page of the first new row",
       mistake="paged-append-first-page", convention="decode")
def paged_append_first_page(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
    return _paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal,
                  write_page=lambda row, start, page: int(row[start // page]))


@buggy("paged-capacity-contract", bug="no bounds check: reads the block table as one flat array (flash-attn #2709)",
       mistake="block-table-overrun", convention="decode")
def paged_block_table_overrun(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                              causal=False):
    return _paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal,
                  table_row=lambda table, b, pages: table.flatten()[b * table.shape[1]:b * table.shape[1] + pages])
def _varlen(q, k, v, cu_q, cu_k, *, causal, top_left=False, key_shift=0, ignore_segments=False, nan_empty=False,
            softcap=0.0, tiled=False):
    """A varlen kernel with one thing changeable: the causal alignment, the key offsets, whether cu_seqlens is read
    at all, whether a row with no key is guarded, the softcap; grouped K/V heads repeat_interleaved to the query
    heads, or tiled."""
    if k.shape[1] != q.shape[1]:  # grouped heads
        g = q.shape[1] // k.shape[1]
        k, v = ((t.repeat(1, g, 1) if tiled else t.repeat_interleave(g, 1)) for t in (k, v))  # [T_k, H, D]
    if ignore_segments:  # the whole packed batch as one sequence, causal over packed positions
        cu_q, cu_k, top_left = [0, q.shape[0]], [0, k.shape[0]], True
    out = torch.zeros_like(q)  # [T_q, H, D]
    for b in range(len(cu_q) - 1):
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        keys = slice(min(int(cu_k[b]) + key_shift, k.shape[0]), min(int(cu_k[b + 1]) + key_shift, k.shape[0]))
        scores = q[rows].transpose(0, 1) @ k[keys].permute(1, 2, 0) / math.sqrt(q.shape[-1])  # [H, n_q, n_k]
        scores = softcap * torch.tanh(scores / softcap) if softcap else scores
        n_q, n_k = scores.shape[1:]
        if causal:
            offset = 0 if top_left else n_k - n_q
            scores = scores.masked_fill(torch.arange(n_k)[None, :] > torch.arange(n_q)[:, None] + offset, -math.inf)
        weights = torch.softmax(scores, dim=-1)  # NaN for a row with no key
        weights = weights if nan_empty else weights.nan_to_num(0.0)
        out[rows] = (weights @ v[keys].transpose(0, 1)).transpose(0, 1) if n_k else (math.nan if nan_empty else 0.0)
    return out


correct("varlen", name="varlen_reference_kernel")(load_target(f"{KERNELS}:varlen_kernel"))
correct("varlen", name="nested_tensor_sdpa_varlen")(load_target(f"{KERNELS}:nested_sdpa_varlen"))


def varlen_attn_names(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                      window_size=(-1, -1)):
    """PyTorch's varlen_attn signature (causal is window_size=(-1, 0)), the LSE returned [T_q, H] as its docstring
    says: the reference kernel underneath."""
    kernel = load_target(f"{KERNELS}:varlen_kernel")
    found = kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, softmax_scale=scale, window_size=window_size,
                   return_attn_probs=bool(return_aux is not None and return_aux.lse))
    return (found[0], found[1].t()) if isinstance(found, tuple) else found


correct("varlen", name="varlen_attn_signature")(varlen_attn_names)


@buggy("segment-isolation", "varlen-equals-per-sequence", bug="cu_seqlens ignored: one attention over the packed batch "
       "(HunyuanVideo PR #310)", mistake="varlen-segments-ignored", convention="varlen")
def varlen_segments_ignored(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, ignore_segments=True)


@buggy("varlen-equals-per-sequence", bug="causal aligned top-left in each sequence", mistake="varlen-causal-top-left",
       convention="varlen")
def varlen_top_left(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, top_left=True)


@buggy("varlen-equals-per-sequence", "segment-isolation", bug="key offsets read one row late (cu_seqlens_k + 1)",
       mistake="varlen-cu-seqlens-off-by-one", convention="varlen")
def varlen_keys_off_by_one(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, key_shift=1)


@buggy("varlen-degenerate-lengths", bug="a row with no key gets NaN (softmax of an empty row unguarded)",
       mistake="varlen-empty-row-nan", convention="varlen")
def varlen_nan_on_empty(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, nan_empty=True)


correct("decode", name="split_kv_decode_kernel")(load_target(f"{KERNELS}:split_decode_kernel"))


@buggy("split-kv-agree", bug="the partial outputs of the key chunks are averaged, not weighted by their LSE",
       mistake="split-kv-unweighted-merge", convention="decode")
def split_kv_unweighted_merge(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False, num_splits=0):
    B, S, H, D = q.shape
    out = _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal)
    if num_splits <= 1:
        return out
    for b in range(B):
        L = int(cache_seqlens[b]) + (S if k is not None else 0)
        size = max(1, math.ceil(L / num_splits))
        keys, values = k_cache[b, :L].transpose(0, 1), v_cache[b, :L].transpose(0, 1)  # [H, L, D]
        scores = q[b].transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(D)  # [H, S, L]
        if causal:
            scores = scores.masked_fill(torch.arange(L)[None, :] > torch.arange(S)[:, None] + (L - S), -math.inf)
        parts = [torch.softmax(scores[..., c:c + size], dim=-1).nan_to_num(0.0) @ values[:, c:c + size]
                 for c in range(0, L, size)]  # [H, S, D] each
        out[b] = (sum(parts) / len(parts)).transpose(0, 1)
    return out


# ---------------------------------------------------------------- the returned LSE (lse-equals-logsumexp)

def _lse_decode(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse, lse_of):
    """A decode kernel with grouped K/V heads that returns its LSE [B, H, S], right but for ``lse_of(raw, scale,
    allowed)``, which turns a row's unscaled scores q . k [H, S, L] and its allowed keys [S, L] into the LSE."""
    B, S, H, D = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    out, lse = torch.zeros_like(q), torch.empty(B, H, S, dtype=torch.float32)
    for b in range(B):
        start = int(cache_seqlens[b])
        if k is not None:
            k_cache[b, start:start + S], v_cache[b, start:start + S] = k[b], v[b]
        L = start + (S if k is not None else 0)
        keys, values = (t[b, :L].repeat_interleave(H // t.shape[2], 1).transpose(0, 1).to(acc)
                        for t in (k_cache, v_cache))  # [H, L, D]
        raw = q[b].transpose(0, 1).to(acc) @ keys.transpose(1, 2)  # [H, S, L]
        allowed = torch.arange(L)[None, :] <= torch.arange(S)[:, None] + (L - S) if causal else \
            torch.ones(S, L, dtype=torch.bool)  # [S, L], bottom-right
        weights = torch.softmax((raw / math.sqrt(D)).masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
        out[b] = (weights @ values).transpose(0, 1).to(q.dtype)  # [S, H, D]
        lse[b] = lse_of(raw, 1 / math.sqrt(D), allowed)  # [H, S]
    return (out, lse) if return_softmax_lse else out


def _masked_lse(raw, scale, allowed):
    return torch.logsumexp((raw * scale).masked_fill(~allowed, -math.inf), dim=-1)


@buggy("lse-equals-logsumexp", bug="the LSE is taken over the unscaled scores q . k", mistake="lse-unscaled",
       convention="decode")
def decode_lse_unscaled(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
                        return_softmax_lse=False):
    return _lse_decode(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse,
                       lambda raw, scale, allowed: _masked_lse(raw, 1.0, allowed))


@buggy("lse-equals-logsumexp", bug="the LSE is taken before the causal mask", mistake="lse-mask-ignored",
       convention="decode")
def decode_lse_before_mask(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
                           return_softmax_lse=False):
    return _lse_decode(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse,
                       lambda raw, scale, allowed: _masked_lse(raw, scale, torch.ones_like(allowed)))


@buggy("lse-equals-logsumexp", bug="the LSE is log(sum(exp(s))), no max subtracted: inf past a score of 88.7",
       mistake="lse-without-max", convention="decode")
def decode_lse_without_max(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
                           return_softmax_lse=False):
    return _lse_decode(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse,
                       lambda raw, scale, allowed: torch.log(torch.exp(raw * scale).masked_fill(~allowed, 0.0).sum(-1)))


@buggy("lse-equals-logsumexp", bug="the LSE is returned [B, S_new, H], laid out like q", mistake="lse-layout-transposed",
       convention="decode")
def decode_lse_transposed(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
                          return_softmax_lse=False):
    found = _lse_decode(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse, _masked_lse)
    return (found[0], found[1].transpose(1, 2)) if return_softmax_lse else found


def _lse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
                return_attn_probs, *, masked_lse=True, reshaped=False):
    """The reference varlen kernel, its LSE [H, T_q] taken over every key of the sequence (``masked_lse=False``) or
    computed [T_q, H] and reshaped to [H, T_q] (``reshaped``)."""
    kernel = load_target(f"{KERNELS}:varlen_kernel")
    out, lse, _ = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=causal,
                         window_size=window_size, return_attn_probs=True)
    if not masked_lse:  # the LSE of a second, unmasked pass over each sequence
        _, lse, _ = kernel(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_attn_probs=True)
    if reshaped:
        lse = lse.t().contiguous().reshape(lse.shape)  # [T_q, H] memory read as [H, T_q]
    return (out, lse, None) if return_attn_probs else out


@buggy("lse-equals-logsumexp", bug="the LSE is taken over every key of the sequence, before causal and the window",
       mistake="varlen-lse-mask-ignored", convention="varlen")
def varlen_lse_before_mask(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           window_size=(-1, -1), return_attn_probs=False):
    return _lse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
                       return_attn_probs, masked_lse=False)


@buggy("lse-equals-logsumexp", bug="the LSE is computed [T_q, H] and reshaped to [H, T_q], not transposed",
       mistake="varlen-lse-reshaped", convention="varlen")
def varlen_lse_reshaped(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                        window_size=(-1, -1), return_attn_probs=False):
    return _lse_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, window_size,
                       return_attn_probs, reshaped=True)


@buggy("varlen-equals-per-sequence", bug="the softcap argument is accepted and ignored",
       mistake="varlen-softcap-ignored", convention="varlen")
def varlen_softcap_ignored(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softcap=0.0):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal)


@buggy("varlen-equals-per-sequence", bug="grouped K/V heads tiled (h % H_kv) instead of grouped (h // g)",
       mistake="varlen-kv-heads-tiled", convention="varlen")
def varlen_kv_heads_tiled(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False, softcap=0.0):
    return _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softcap=softcap, tiled=True)
