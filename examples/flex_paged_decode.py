"""FlexAttention's paged attention (``torch.nn.attention.experimental._paged_attention.PagedAttention``) as a decode
kernel, in eager mode on the CPU, through the small adapter a serving stack writes:

    attn-spec check examples/flex_paged_decode.py:flex_paged_decode

The adapter copies flash-attn's ``block_table`` into PagedAttention's page table (and its physical-to-logical map),
appends k and v with ``PagedAttention.assign``, and masks with ``convert_logical_block_mask(..., kv_len=...)``:
without ``kv_len`` the unfilled tail of the last page is attended (PyTorch #159247). The pool is flash-attn's
[num_blocks, page, H_kv, D], seen by Flex as one sequence [1, H_kv, num_blocks * page, D] (a view: assign writes
the caller's pool). PagedAttention has no block-table capacity to check, so the adapter raises on a length past
it, as flash-attn does since PR #2711.
"""
import warnings

import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention


def flex_paged_decode(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, softmax_scale=None,
                      causal=False, return_softmax_lse=False):
    """q [B, S, H, D]; a pool k_cache, v_cache [num_blocks, page, H_kv, D] read through block_table [B, max_blocks]
    (without one, a contiguous cache [B, S_c, H_kv, D] is a pool of one page per element)."""
    B, S, H, D = q.shape
    if block_table is None:
        block_table = torch.arange(B, dtype=torch.int32, device=q.device)[:, None]  # [B, 1]
    n_pages, page, H_kv = k_cache.shape[:3]
    width = block_table.shape[1]
    lengths = cache_seqlens.long() + (S if k is not None else 0)  # [B]: keys after the append
    if (lengths > width * page).any():
        raise ValueError(f"cache lengths {lengths.tolist()} exceed the block table's {width} pages of {page} rows")
    paged = PagedAttention(n_pages, page, B, device=q.device.type)
    paged.page_table[:, :width] = block_table
    for b in range(B):
        paged.physical_to_logical[b, block_table[b].long()] = torch.arange(width, device=q.device)
    k_flat, v_flat = (t.view(n_pages * page, H_kv, -1).permute(1, 0, 2).unsqueeze(0)
                      for t in (k_cache, v_cache))  # [1, H_kv, n_pages * page, D], views of the pool
    if k is not None:
        positions = cache_seqlens.long()[:, None] + torch.arange(S, device=q.device)  # [B, S]
        paged.assign(torch.arange(B, device=q.device), positions, k.transpose(1, 2), v.transpose(1, 2), k_flat, v_flat)

    def bottom_right(b, h, q_idx, kv_idx):  # logical positions; kv_len bounds them to the sequence
        return kv_idx <= q_idx + lengths[b] - S if causal else kv_idx >= 0

    logical = create_block_mask(bottom_right, B, None, S, width * page, device=q.device.type, BLOCK_SIZE=(128, page))
    block_mask = paged.convert_logical_block_mask(logical, kv_len=lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile()": eager on purpose
        out, aux = flex_attention(q.transpose(1, 2), k_flat, v_flat, block_mask=block_mask, scale=softmax_scale,
                                  enable_gqa=H != H_kv, return_aux=AuxRequest(lse=True))  # [B, H, S, D]
    out = out.transpose(1, 2)  # [B, S, H, D]
    return (out, aux.lse) if return_softmax_lse else out  # lse [B, H, S], base e
