"""Error budgets earned by measurement, not guessed.

A target's output is compared with the float64 reference. The error it may have is what an
ordinary, correct implementation in the *same dtype* shows on the *same inputs*, times a
small factor, plus a floor of a few units in the last place of the output (the rounding any
arithmetic on the result would add):

    |target - ref64|_max  <=  FACTOR * |naive - ref64|_max  +  FLOOR_ULPS * eps(dtype) * max|V|

This is how FlashAttention and PyTorch's SDPA tests judge kernels; see
``shared/anchors/attention-test-suites.md``. The factor and floor were calibrated on the
correct variants in ``tests/gallery.py`` (einsum, online softmax, float64 inside, SDPA,
logsumexp, chunked keys) over thousands of cases: see ``tests/test_tolerance.py``.
"""
from __future__ import annotations

import math

import torch

FACTOR = 4.0
FLOOR_ULPS = 8.0


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def naive_attention(q, k, v, mask=None, *, scale=None):
    """The seed's formula in the inputs' dtype and device, with the scale applied to Q first.

    Reordering the operations (FlashAttention's ``reorder_ops``) makes its rounding differ
    from the float64 reference even when the inputs are float64.
    """
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q * scale) @ k.transpose(-2, -1)  # [..., Tq, Dk] x [..., Dk, Tk] -> [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))  # [..., Tq, Tk]
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights @ v  # [..., Tq, Tk] x [..., Tk, Dv] -> [..., Tq, Dv]


def max_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """max |got - ref| in float64; NaN or inf anywhere counts as an infinite error."""
    diff = (got.detach().to("cpu", torch.float64) - ref.to(torch.float64)).abs()
    if diff.numel() == 0:
        return 0.0
    if not torch.isfinite(diff).all():
        return math.inf
    return diff.max().item()


def budget(q, k, v, mask, ref_out, *, scale=None) -> float:
    """The largest error a correct implementation may show on these inputs."""
    naive = naive_attention(q, k, v, mask, scale=scale)
    naive_err = max_error(naive, ref_out)
    if not math.isfinite(naive_err):  # the naive formula itself overflowed: judge by the floor alone
        naive_err = 0.0
    v_scale = max(1.0, v.detach().abs().max().item()) if v.numel() else 1.0
    return FACTOR * naive_err + FLOOR_ULPS * eps(q.dtype) * v_scale


def naive_multihead(x_q, x_kv, weights, n_heads, mask=None):
    """The seed's multi-head module, in the inputs' dtype: the noise floor for multi-head outputs."""
    d_model = x_q.shape[-1]

    def split(t):  # [T, D] -> [H, T, Dh]
        return t.view(t.shape[0], n_heads, d_model // n_heads).transpose(0, 1)

    W = weights
    heads = naive_attention(split(x_q @ W["W_Q"].T), split(x_kv @ W["W_K"].T), split(x_kv @ W["W_V"].T), mask)
    return heads.transpose(0, 1).reshape(x_q.shape[0], d_model) @ W["W_O"].T  # [Tq, D]


def multihead_budget(x_q, x_kv, weights, n_heads, mask, ref_out) -> float:
    """The largest error a correct multi-head module may show on these inputs."""
    naive_err = max_error(naive_multihead(x_q, x_kv, weights, n_heads, mask), ref_out)
    naive_err = naive_err if math.isfinite(naive_err) else 0.0
    scale = max(1.0, ref_out.abs().max().item()) if ref_out.numel() else 1.0
    return FACTOR * naive_err + FLOOR_ULPS * eps(x_q.dtype) * scale
