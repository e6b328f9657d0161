"""The canonical attention: the float64 oracle every property is measured against.

    Attention(Q, K, V) = softmax(scale * Q K^T + bias) V,        scale = 1 / sqrt(d_k)

Two options of real models: logit soft-capping replaces each scaled score s by cap * tanh(s / cap)
before the mask and the softmax (Gemma 2, Grok); a sliding window of w keys lets query i see key j
only when i - w < j <= i (Mistral, Gemma 2; causal, aligned like ``causal``).

Shapes use one vocabulary: ``...`` leading batch/head dims, ``Tq`` queries, ``Tk`` keys,
``Dk`` query/key width, ``Dv`` value width, ``D`` model width, ``H`` heads.

Conventions pinned here (a target's own choices are probed and reported, not assumed):
- bool mask: True = may attend; a float mask is added to the scaled scores (it is not scaled);
- causal: query i sees key j when j <= i (top-left), or j <= i + Tk - Tq (bottom-right);
- a row with no allowed key gets all-zero weights, hence a zero output row, and LSE -inf.

The rules of attention the rest of the kit calls rather than restates are here, once: which keys a query may
attend (``key_offset``, ``visible``, ``causal_mask``), folding a mask with that pattern (``fold``), grouped K/V
heads (``repeat_kv``: query head h reads K/V head h // g), the LSE (``lse``, ``lse_weights``). The serving
kernels' references loop over them (attn_spec.serving_reference); the error budget is checking.tolerance.earned.

It is differentiable (in float64, on the CPU; gradients flow back to the inputs' dtype and
device), so the reference is itself a conforming target, ``gradients`` included.
"""
from __future__ import annotations

import math

import torch

F64 = torch.float64


def key_offset(n_q: int, n_kv: int, alignment: str = "top-left") -> int:
    """Where query row i sits among the keys: at key position p = i + offset, offset = 0 aligned top-left (PyTorch's
    ``is_causal``) or n_kv - n_q bottom-right (flash-attn: the last query sees the last key). Varlen and decode
    take it per sequence, with that sequence's n_q and n_kv."""
    return 0 if alignment == "top-left" else n_kv - n_q


def visible(positions: torch.Tensor, n_kv: int, *, window=None, ahead=0) -> torch.Tensor:
    """Bool [len(positions), Tk]: the query at key position p may attend key j when

        j <= p + ahead   (causal: ahead = 0; None: no bound)   and   p - w < j   (a window of w keys; None: no bound)

    flash-attn's window_size (left, right) is w = left + 1, ahead = right. On the device of ``positions``."""
    p = positions[:, None]  # [Tq, 1]
    j = torch.arange(n_kv, device=positions.device)[None, :]  # [1, Tk]
    allowed = torch.ones(len(positions), n_kv, dtype=torch.bool, device=positions.device) if ahead is None \
        else j <= p + ahead  # [Tq, Tk]
    return allowed if window is None else allowed & (j > p - window)


def causal_mask(n_q: int, n_kv: int, *, alignment: str = "top-left", device=None, window=None) -> torch.Tensor:
    """Bool mask [Tq, Tk], True where query i may attend key j: j <= i + offset (and, with a window of w keys,
    i + offset - w < j)."""
    return visible(torch.arange(n_q, device=device) + key_offset(n_q, n_kv, alignment), n_kv, window=window)


def keyless_rows(n_q: int, n_kv: int, *, alignment: str = "top-left") -> torch.Tensor:
    """Bool [Tq]: the rows of ``causal_mask`` without an allowed key (bottom-right with n_q > n_kv: the first
    n_q - n_kv), in O(n) rather than from the [Tq, Tk] mask."""
    return (torch.arange(n_q) + key_offset(n_q, n_kv, alignment) < 0) | (n_kv == 0)  # row i's last key is i + offset


def fold(mask, allowed: torch.Tensor):
    """``mask`` (bool, float or None) restricted to the keys ``allowed`` (bool) lets each query see: a bool mask is
    and-ed with it, a float mask gets -inf where a key is not allowed. On ``allowed``'s device."""
    if mask is None:
        return allowed
    mask = mask.to(allowed.device)
    return allowed & mask if mask.dtype == torch.bool else mask.masked_fill(~allowed, -math.inf)


def fold_causal(mask, n_q: int, n_kv: int, window=None):
    """``mask`` with the causal pattern (top-left; within a window of w keys, if any) folded in: a call's
    ``is_causal``/``window`` written as its mask."""
    return fold(mask, causal_mask(n_q, n_kv, window=window, device=None if mask is None else mask.device))


def repeat_kv(t: torch.Tensor, group: int, dim: int = -3) -> torch.Tensor:
    """Grouped K/V heads read by the query heads: each of the H_kv heads along ``dim`` repeated g = H / H_kv times,
    so query head h reads K/V head h // g (Llama's repeat_kv, SDPA's enable_gqa, flash-attn)."""
    return t.repeat_interleave(group, dim=dim)


def lse(scores: torch.Tensor) -> torch.Tensor:
    """log sum_j exp(s_j) over the keys, [..., Tq] from [..., Tq, Tk]: -inf for a row with no allowed key (the empty
    set's value, neutral in a merge: logaddexp(x, -inf) = x)."""
    return torch.logsumexp(scores, dim=-1)


def lse_weights(scores: torch.Tensor, row_lse: torch.Tensor) -> torch.Tensor:
    """The softmax weights exp(s_j - lse) [..., Tq, Tk] from a row's LSE; a row with no allowed key gets zeros."""
    return torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)


def masked(scores, mask, fill=-math.inf):
    """``scores`` [..., Tq, Tk] with ``mask``: a bool mask sets the disallowed keys' scores to ``fill``, a float
    mask is added (not scaled)."""
    if mask is None:
        return scores
    mask = mask.detach().to(scores.device)
    return scores.masked_fill(~mask, fill) if mask.dtype == torch.bool else scores + mask


def softcapped(scores, cap):
    """cap * tanh(scores / cap): every score in (-cap, cap); ``cap`` None leaves them as they are."""
    return scores if cap is None else cap * torch.tanh(scores / cap)


def scores(q, k, mask=None, *, causal=False, scale=None, causal_alignment="top-left", window=None, softcap=None,
           dtype=F64):
    """The scores the softmax takes, [..., Tq, Tk]: scale * Q K^T, soft-capped, then masked (and causal or
    windowed), on the CPU in ``dtype`` (None: the inputs' own dtype, as a mistake model replayed exactly)."""
    q, k = (t.cpu() if dtype is None else t.to("cpu", dtype) for t in (q, k))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    s = softcapped(scale * (q @ k.transpose(-2, -1)), softcap)  # [..., Tq, Dk] x [..., Dk, Tk] -> [..., Tq, Tk]
    s = masked(s, mask)
    if causal or window is not None:
        s = masked(s, causal_mask(*s.shape[-2:], alignment=causal_alignment, window=window))
    return s


def softmax_keys(scores):
    """softmax over the keys, [..., Tq, Tk]; a row with no allowed key gets all-zero weights (not softmax(-inf, ...,
    -inf) = NaN: its gradient would be NaN too)."""
    empty = torch.isneginf(scores).all(dim=-1, keepdim=True)  # [..., Tq, 1] rows with no key
    return torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def attention(q, k, v, mask=None, *, causal=False, scale=None, causal_alignment="top-left", window=None,
              softcap=None, dtype=F64, softmax=softmax_keys):
    """Scaled dot-product attention in float64 on the CPU; returns ``(out, weights)``.

    q [..., Tq, Dk], k [..., Tk, Dk], v [..., Tk, Dv]; mask bool or float, broadcastable
    to [..., Tq, Tk]. Leading dims broadcast like matmul. ``window``: w keys (implies causal);
    ``softcap``: the cap of cap * tanh(scores / cap). ``dtype`` None computes in the inputs' own dtype;
    ``softmax`` maps the scores to the weights (a mistake model's hook: see attn_spec.diagnosis.model).
    """
    weights = softmax(scores(q, k, mask, causal=causal, scale=scale, causal_alignment=causal_alignment,
                             window=window, softcap=softcap, dtype=dtype))  # [..., Tq, Tk]
    out = weights @ (v.cpu() if dtype is None else v.to("cpu", dtype))  # [..., Tq, Tk] x [..., Tk, Dv] -> [..., Tq, Dv]
    return out, weights


def multihead(x_q, x_kv, W_Q, W_K, W_V, W_O, n_heads, mask=None):
    """Multi-head attention in the seed's form, in float64; returns ``(out, weights)``.

    x_q [Tq, D], x_kv [Tk, D]; each W is an ``nn.Linear`` weight [D, D] (y = x W^T);
    mask broadcastable to [H, Tq, Tk]. Head h uses columns h*Dh:(h+1)*Dh, Dh = D / H.
    """
    x_q, x_kv, W_Q, W_K, W_V, W_O = (t.to("cpu", F64) for t in (x_q, x_kv, W_Q, W_K, W_V, W_O))
    d_model = x_q.shape[-1]
    d_head = d_model // n_heads

    def split(t):  # [T, D] -> [H, T, Dh]
        return t.view(t.shape[0], n_heads, d_head).transpose(0, 1)

    heads, weights = attention(split(x_q @ W_Q.T), split(x_kv @ W_K.T), split(x_kv @ W_V.T), mask)  # [H, Tq, Dh]
    concat = heads.transpose(0, 1).reshape(x_q.shape[0], d_model)  # [Tq, H * Dh] = [Tq, D]
    return concat @ W_O.T, weights  # [Tq, D], [H, Tq, Tk]


class MultiHeadAttention(torch.nn.Module):
    """The seed's multi-head module: ``W_Q``, ``W_K``, ``W_V``, ``W_O`` and ``forward(x_q, x_kv, mask)``.

    It is itself a valid target of the ``module`` convention, and computes in float64.
    """

    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.W_Q = torch.nn.Linear(d_model, d_model, bias=False, dtype=F64)
        self.W_K = torch.nn.Linear(d_model, d_model, bias=False, dtype=F64)
        self.W_V = torch.nn.Linear(d_model, d_model, bias=False, dtype=F64)
        self.W_O = torch.nn.Linear(d_model, d_model, bias=False, dtype=F64)  # mixes the concatenated heads

    def forward(self, x_q, x_kv, mask=None):
        W = (self.W_Q.weight, self.W_K.weight, self.W_V.weight, self.W_O.weight)
        out, _ = multihead(x_q, x_kv, *W, self.n_heads, mask)
        return out.to(device=x_q.device, dtype=x_q.dtype)  # [Tq, D]


def reference_attention(Q, K, V, mask=None):
    """The reference in the ``function`` convention: returns only the output, in the inputs' dtype."""
    out, _ = attention(Q, K, V, mask)
    return out.to(device=Q.device, dtype=Q.dtype)  # [..., Tq, Dv]
