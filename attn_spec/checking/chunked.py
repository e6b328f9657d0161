"""The float64 reference at the lengths kernels run: query rows in chunks, never the whole score matrix.

    out[b, rows] = softmax(scale * Q[b, rows] K[b]^T + bias[b, rows]) V[b]      for each chunk of rows

``attn_spec.reference.attention`` builds the [..., Tq, Tk] scores and weights in float64: one
head at 32k keys is 8 GB. Here each batch/head element is computed on its own, a chunk of query
rows at a time, each chunk's scores [rows, Tk] taking at most ``chunk_bytes``. A chunk holds
whole rows, so its softmax is the reference's own: the online rescaling a kernel needs when it
splits the *keys* is not needed, and none of its rounding enters. The kit's memory is then
O(chunk x Tk + n x d): the chunk's scores, one element's Q, K, V in float64, and the output.

Same arguments and conventions as ``reference.attention`` (bool mask True = may attend, a float
mask added after scaling, ``causal`` top-left or bottom-right, empty rows give zeros), computed
on the inputs' device (MPS has no float64: there, on the CPU).
"""
from __future__ import annotations

import itertools
import math

import torch

from attn_spec import reference

F64 = torch.float64
CHUNK_BYTES = {"cpu": 2**24, "cuda": 2**28}  # float64 scores per chunk: 16 MiB (cache-sized), 256 MiB on a GPU


def compute_device(t: torch.Tensor) -> torch.device:
    """Where float64 arithmetic on ``t`` runs: its own device, or the CPU for MPS."""
    return torch.device("cpu") if t.device.type == "mps" else t.device


def chunk_bytes_for(device: torch.device) -> int:
    return CHUNK_BYTES.get(device.type, CHUNK_BYTES["cpu"])


def batch_shape(q, k, v, mask=None) -> tuple:
    """The broadcast leading dims of the inputs (matmul broadcasting)."""
    shapes = [t.shape[:-2] for t in (q, k, v, mask) if t is not None]
    rank = max(map(len, shapes))
    return tuple(max(s[i - rank + len(s)] if i - rank + len(s) >= 0 else 1 for s in shapes) for i in range(rank))


def fits(q, k, v, mask=None) -> bool:
    """True when the whole float64 score tensor [..., Tq, Tk] takes at most one chunk's bytes."""
    n = math.prod(batch_shape(q, k, v, mask)) * q.shape[-2] * k.shape[-2]
    return 8 * n <= chunk_bytes_for(compute_device(q))


def element(t, index):
    """Batch element ``index`` of ``t`` (leading dims broadcast: size-1 dims read element 0); no copy."""
    lead = t.dim() - 2
    own = index[len(index) - lead:] if lead else ()
    return t[tuple(i if n > 1 else 0 for i, n in zip(own, t.shape[:lead]))]


def elements(q, k, v, mask=None):
    """(index, q_e [Tq, Dk], k_e [Tk, Dk], v_e [Tk, Dv], mask_e or None) for every batch element."""
    for index in itertools.product(*map(range, batch_shape(q, k, v, mask))):
        yield index, element(q, index), element(k, index), element(v, index), \
            None if mask is None else element(mask, index)


def row_chunks(n_q: int, n_kv: int, chunk_bytes: int):
    """Slices of query rows whose float64 scores [rows, Tk] take at most ``chunk_bytes`` (one row at least)."""
    rows = max(1, chunk_bytes // (8 * max(n_kv, 1)))
    return [slice(start, min(start + rows, n_q)) for start in range(0, n_q, rows)]


def row_mask(mask_e, rows: slice):
    """The rows of one element's mask [Tq, Tk] (a [1, Tk] padding mask serves every row), or None."""
    return None if mask_e is None else mask_e if mask_e.shape[-2] == 1 else mask_e[rows]


def chunk_scores(q_c, k_e, mask_e, rows: slice, n_q: int, *, scale, causal=False, causal_alignment="top-left"):
    """(scores, masked): float64 scale * q_c k_e^T [rows, Tk] plus a float mask, -inf where a key is not
    allowed; ``masked`` says whether any key may be. In place after the matmul: at long lengths each
    pass over a fresh [rows, Tk] buffer costs as much as the matmul itself."""
    scores = q_c @ k_e.transpose(-2, -1)  # [c, Dk] x [Dk, Tk] -> [c, Tk]
    scores.mul_(scale)  # scale * (Q K^T), the reference's order
    allowed = None
    if mask_e is not None:
        m = row_mask(mask_e, rows).to(scores.device)  # [c or 1, Tk]
        if m.dtype == torch.bool:
            allowed = m
        else:
            scores.add_(m.to(F64))
    if causal:
        offset = reference.key_offset(n_q, k_e.shape[-2], causal_alignment)
        positions = torch.arange(rows.start, rows.stop, device=scores.device) + offset  # [c]
        allowed = reference.fold(allowed, reference.visible(positions, k_e.shape[-2]))  # [c, Tk]
    if allowed is not None:
        scores.masked_fill_(~allowed, -math.inf)
    return scores, allowed is not None


def chunk_weights(scores, masked: bool):
    """softmax over the keys of scores [c, Tk]; a row with no allowed key gets zeros (as the reference)."""
    weights = torch.softmax(scores, dim=-1)  # [c, Tk]
    if masked:
        empty = torch.isneginf(scores.amax(dim=-1, keepdim=True))  # [c, 1] rows with no key
        if empty.any():
            weights.masked_fill_(empty, 0.0)
    return weights


def blocks(q, k, v, mask=None, *, scale=None, causal=False, causal_alignment="top-left", chunk_bytes=None):
    """(index, rows, q_c, k_e, v_e, weights) in float64 for every batch element and chunk of query rows.

    q_c [c, Dk], k_e [Tk, Dk], v_e [Tk, Dv], weights [c, Tk]; each element's K and V are
    converted once. The building block of the output and of the chunked reference gradients.
    """
    device = compute_device(q)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    chunks = row_chunks(q.shape[-2], k.shape[-2], chunk_bytes or chunk_bytes_for(device))
    for index, q_e, k_e, v_e, mask_e in elements(q, k, v, mask):
        k64, v64 = (t.detach().to(device, F64) for t in (k_e, v_e))  # [Tk, Dk], [Tk, Dv]
        for rows in chunks:
            q_c = q_e[rows].detach().to(device, F64)  # [c, Dk]
            scores, masked = chunk_scores(q_c, k64, mask_e, rows, q.shape[-2], scale=scale, causal=causal,
                                          causal_alignment=causal_alignment)  # [c, Tk]
            yield index, rows, q_c, k64, v64, chunk_weights(scores, masked)


def attention(q, k, v, mask=None, *, scale=None, causal=False, causal_alignment="top-left", chunk_bytes=None):
    """The reference output [..., Tq, Dv] in float64, chunk by chunk, on ``compute_device(q)``."""
    batch = batch_shape(q, k, v, mask)
    out = torch.zeros(*batch, q.shape[-2], v.shape[-1], dtype=F64, device=compute_device(q))  # [..., Tq, Dv]
    for index, rows, _, _, v64, weights in blocks(q, k, v, mask, scale=scale, causal=causal,
                                                  causal_alignment=causal_alignment, chunk_bytes=chunk_bytes):
        out[index][rows] = weights @ v64  # [c, Tk] x [Tk, Dv] -> [c, Dv]
    return out


def reference_output(q, k, v, mask=None, *, scale=None, causal=False, causal_alignment="top-left"):
    """The float64 reference output at any size: ``reference.attention`` when its scores fit in one
    chunk (small cases, one batched call), this module's chunks otherwise."""
    if fits(q, k, v, mask):
        return reference.attention(q, k, v, mask, scale=scale, causal=causal, causal_alignment=causal_alignment)[0]
    return attention(q, k, v, mask, scale=scale, causal=causal, causal_alignment=causal_alignment)


def row_peaks(q, k, mask=None, *, scale=None):
    """[..., Tq] float64: each row's scaled score of largest magnitude among its allowed keys (signed;
    0 for a row with none), chunk by chunk. Where the scores do not fit in one chunk they are computed
    in float32 (float64 inputs: float64): a peak that sets a gain need not be exact, and float64 costs
    twice as much there."""
    batch = batch_shape(q, k, k, mask)
    peaks = torch.zeros(*batch, q.shape[-2], dtype=F64, device=compute_device(q))  # [..., Tq]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    chunks = row_chunks(q.shape[-2], k.shape[-2], chunk_bytes_for(compute_device(q)))
    dtype = F64 if fits(q, k, k, mask) or q.dtype == F64 else torch.float32
    for index, q_e, k_e, _, mask_e in elements(q, k, k, mask):
        k_c = k_e.to(peaks.device, dtype)  # [Tk, Dk]
        for rows in chunks:
            s, masked = chunk_scores(q_e[rows].to(peaks.device, dtype), k_c, mask_e, rows, q.shape[-2], scale=scale)
            if masked:
                s.masked_fill_(torch.isneginf(s), 0.0)  # [c, Tk], the peak is picked among allowed keys
            low, high = s.aminmax(dim=-1)  # [c] each: one pass, where abs, argmax and gather took three
            peaks[index][rows] = torch.where(high >= -low, high, low)
    return peaks
