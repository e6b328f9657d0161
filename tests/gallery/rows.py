"""Kernels wrong only in some rows: what a check at scale that judges chosen rows must still catch.

Each is torch's SDPA with one mistake confined to a few query rows (a tiled kernel's tail path, one
tile boundary, one head, one batch element, rows past 2^k), the mistakes long kernels make and
drawn small cases cannot show. They are not in ``BUGGY`` (the drawn profiles' gallery): they are
checked at fixed shapes by tests/test_rows.py, where each must fail ``matches-reference`` at every
rung, and ``SDPA_ROWS``, the same call without a mistake, must pass.

``ROW_BUGS``: name -> (attention, the rows it gets wrong, as a function of n_q).

``GRAD_ROW_BUGS``: the same for the backward: SDPA's forward, and SDPA's backward with one mistake confined
to some rows or keys (the tail tile's dQ, the last key tile's dK and dV, the query rows past 2^10, one
head, one batch element), each of which ``gradients`` must catch at every rung; ``backward_correct`` is the
same custom autograd.Function without a mistake.
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


class _SpoiltBackward(torch.autograd.Function):
    """SDPA forward; its backward is SDPA's own, then ``spoil(dq, dk, dv, q, g)`` breaks some rows of it."""

    @staticmethod
    def forward(ctx, q, k, v, mask, spoil):
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.spoil = mask, spoil
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*leaves, attn_mask=ctx.mask)
            dq, dk, dv = torch.autograd.grad(out, leaves, g)
        return (*ctx.spoil(dq, dk, dv, leaves, ctx.mask, g), None, None)


def _with_backward(spoil, doc):
    def attention(Q, K, V, mask=None):
        return _SpoiltBackward.apply(Q, K, V, mask, spoil)
    attention.__doc__ = doc
    return attention


def _tail_dq_unscaled(dq, dk, dv, leaves, mask, g):
    start = dq.shape[-2] // TILE * TILE
    dq[..., start:, :] *= math.sqrt(dq.shape[-1])
    return dq, dk, dv


def _last_key_tile_dropped(dq, dk, dv, leaves, mask, g):
    start = dk.shape[-2] // TILE * TILE
    dk[..., start:, :] = 0
    dv[..., start:, :] = 0
    return dq, dk, dv


def _rows_past_2_10_lost(dq, dk, dv, leaves, mask, g):
    early = g.clone()
    early[..., 1024:, :] = 0  # dK and dV summed over the first 2^10 query rows only
    with torch.enable_grad():
        out = F.scaled_dot_product_attention(*leaves, attn_mask=mask)
        _, dk, dv = torch.autograd.grad(out, leaves, early)
    return dq, dk, dv


def _one_head_dv_doubled(dq, dk, dv, leaves, mask, g):
    dv[..., -1, :, :] *= 2
    return dq, dk, dv


def _one_batch_element_dq_unscaled(dq, dk, dv, leaves, mask, g):
    dq[-1] *= math.sqrt(dq.shape[-1])
    return dq, dk, dv


backward_correct = _with_backward(lambda dq, dk, dv, *_: (dq, dk, dv),
                                  "SDPA through a custom autograd.Function whose backward is SDPA's own: conforms.")

# name -> (attention, the query rows whose dQ it gets wrong as a function of n_q, or None where dK or dV are wrong)
GRAD_ROW_BUGS = {
    "backward_tail_tile_dq_unscaled": (_with_backward(_tail_dq_unscaled, "dQ of the last partial tile of 64 query "
                                                      "rows misses the 1/sqrt(d) factor"),
                                       lambda n: range(n // TILE * TILE, n)),
    "backward_last_key_tile_dropped": (_with_backward(_last_key_tile_dropped, "dK and dV of the last partial key "
                                                      "tile are never written (zero)"), None),
    "backward_rows_past_2_10_lost": (_with_backward(_rows_past_2_10_lost, "dK and dV sum over the first 2^10 query "
                                                    "rows only (a 10-bit row counter in the backward's loop)"), None),
    "backward_one_head_dv_doubled": (_with_backward(_one_head_dv_doubled, "the last head's dV is accumulated twice"),
                                     None),
    "backward_one_batch_element_dq_unscaled": (_with_backward(_one_batch_element_dq_unscaled, "the last batch "
                                                              "element's dQ misses the 1/sqrt(d) factor"),
                                               lambda n: range(n)),
}
