"""Kernels wrong only in some rows: what a check at scale that judges chosen rows must still catch.

Each is torch's SDPA with one mistake confined to a few query rows (a tiled kernel's tail path, one
tile boundary, one head, one batch element, rows past 2^k), the mistakes long kernels make and
drawn small cases cannot show. They are not in ``BUGGY`` (the drawn profiles' gallery): they are
checked at fixed shapes by tests/test_rows.py, where each must fail ``matches-reference`` at every
rung, and ``SDPA_ROWS``, the same call without a mistake, must pass.

``ROW_BUGS``: name -> (attention, the rows it gets wrong, as a function of n_q).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TILE = 64


def sdpa_rows(Q, K, V, mask=None):
    """The correct kernel the others break: torch's SDPA, bool mask True = may attend."""
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


def _rows_of(mask, rows):
    """The mask rows a few query rows see ([..., 1, Tk] padding serves every row)."""
    return None if mask is None else mask if mask.shape[-2] == 1 else mask[..., rows, :]


def wrong_last_partial_tile(Q, K, V, mask=None):
    """The tail tile (the n_q % 64 rows past the last full tile) takes a path without the 1/sqrt(d) scale."""
    out = sdpa_rows(Q, K, V, mask)  # [..., Tq, Dv]
    start = Q.shape[-2] // TILE * TILE
    if start < Q.shape[-2]:
        tail = slice(start, None)
        out[..., tail, :] = F.scaled_dot_product_attention(Q[..., tail, :], K, V, attn_mask=_rows_of(mask, tail),
                                                           scale=1.0)
    return out


def wrong_at_one_tile_boundary(Q, K, V, mask=None):
    """The first row of the middle 128-row tile gets the previous row's output (an off-by-one tile start)."""
    out = sdpa_rows(Q, K, V, mask)
    row = Q.shape[-2] // 128 // 2 * 128
    out[..., row, :] = out[..., row - 1, :]
    return out


def wrong_in_one_head(Q, K, V, mask=None):
    """The last head reads the scale of a head twice as wide (1/sqrt(2 d))."""
    out = sdpa_rows(Q, K, V, mask)
    last = Q[..., -1:, :, :]
    out[..., -1:, :, :] = F.scaled_dot_product_attention(last, K[..., -1:, :, :], V[..., -1:, :, :],
                                                         attn_mask=None if mask is None or mask.dim() < 3
                                                         else mask[..., -1:, :, :],
                                                         scale=1 / math.sqrt(2 * Q.shape[-1]))
    return out


def wrong_in_one_batch_element(Q, K, V, mask=None):
    """The last batch element reads the keys of the first (a batch stride of 0 for K)."""
    out = sdpa_rows(Q, K, V, mask)
    if Q.shape[0] > 1:
        m = None if mask is None or mask.dim() < 4 else mask[-1:]
        out[-1:] = F.scaled_dot_product_attention(Q[-1:], K[:1], V[-1:], attn_mask=m)
    return out


def wrong_past_2_10(Q, K, V, mask=None):
    """Rows past 2^10 see only the first 2^10 keys (a 10-bit row counter in the key loop's bound)."""
    out = sdpa_rows(Q, K, V, mask)
    if Q.shape[-2] > 1024:
        late = slice(1024, None)
        m = _rows_of(mask, late)
        out[..., late, :] = F.scaled_dot_product_attention(Q[..., late, :], K[..., :1024, :], V[..., :1024, :],
                                                           attn_mask=None if m is None else m[..., :1024])
    return out


ROW_BUGS = {
    "wrong_last_partial_tile": (wrong_last_partial_tile, lambda n: range(n // TILE * TILE, n)),
    "wrong_at_one_tile_boundary": (wrong_at_one_tile_boundary, lambda n: [n // 128 // 2 * 128]),
    "wrong_in_one_head": (wrong_in_one_head, lambda n: range(n)),
    "wrong_in_one_batch_element": (wrong_in_one_batch_element, lambda n: range(n)),
    "wrong_past_2_10": (wrong_past_2_10, lambda n: range(1024, n)),
}
