"""Name the likely bug behind one mismatch (a property's own cause, before any replay) by testing which
classic mistake reproduces the output: each computed by the reference formula with the mistake's options.

A convention's own misreadings come first (a [B, S, H, D] kernel that reads its inputs as [B, H, S, D]);
the report's roots come from the catalog's models replayed on the failure's calls (attn_spec.diagnosis.run)."""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import chunked, probes
from attn_spec.checking.tolerance import max_error, naive_attention
from attn_spec.targets.layouts import Heads

F64 = torch.float64


def _softmax_attention(q, k, v, mask, *, scale, dim=-1):
    """The reference at ``scale``; ``dim=-2``: its softmax over the queries instead (the keys' attention to
    the queries, transposed back)."""
    if dim == -1:
        return reference.attention(q, k, v, mask, scale=scale)[0]  # [..., Tq, Dv]
    m = None if mask is None else mask.transpose(-2, -1)
    weights = reference.attention(k, q, q, m, scale=scale)[1].transpose(-2, -1)  # [..., Tq, Tk], columns sum to 1
    return weights @ v.to("cpu", F64)  # [..., Tq, Dv]


def transposed_reading(q, k, v, mask):
    """(description, float64 output) of a [B, S, H, D] kernel that attends over the heads instead of the
    sequence (it reads [B, S, H, D] as [B, H, S, D]); None where those shapes cannot occur."""
    h = Heads(q, k, v, mask)
    if mask is not None or h.q.shape[-2] != h.k.shape[-2] or h.heads != h.kv_heads:
        return None
    out, _ = reference.attention(h.q.transpose(1, 2), h.k.transpose(1, 2), h.v.transpose(1, 2))  # [B, Sq, H, Dv]
    return ("the kernel reads its [B, S, H, D] inputs as [B, H, S, D]: it attends over the heads instead of "
            "the sequence (heads and sequence transposed)", h.restore(out.transpose(1, 2)))


def explain(target, got, q, k, v, mask, allowed) -> str:
    """The cause of ``got`` != the reference: the target convention's own misreadings first, then the
    classic mistakes (:func:`diagnose_mismatch`), or ''."""
    got64 = got.detach().cpu().double()
    if getattr(target, "layout", "bhsd") == "bshd":
        found = transposed_reading(q, k, v, mask)
        if found and max_error(got64, found[1]) <= allowed:
            return found[0]
    return diagnose_mismatch(got64, q, k, v, mask, allowed)


def mistakes(q, k, v, mask, *, all_rows=True):
    """(description, output) for each classic mistake, computed in float64.

    ``all_rows=False``: q holds some of the queries only (a long case), so mistakes that mix the
    queries (a softmax over them) cannot be reproduced and are left out."""
    d_k = q.shape[-1]
    s = 1 / math.sqrt(d_k)
    yield "scores are not scaled (missing 1/sqrt(d_k))", _softmax_attention(q, k, v, mask, scale=1.0)
    yield "scores are scaled by 1/d_k instead of 1/sqrt(d_k)", _softmax_attention(q, k, v, mask, scale=1 / d_k)
    yield "scores are multiplied by sqrt(d_k) instead of divided", _softmax_attention(q, k, v, mask, scale=math.sqrt(d_k))
    yield "the scale is applied twice (1/d_k^1.5)", _softmax_attention(q, k, v, mask, scale=s / d_k)
    if v.shape[-1] != d_k:
        yield "the scale uses d_v instead of d_k", _softmax_attention(q, k, v, mask, scale=1 / math.sqrt(v.shape[-1]))
    if q.shape[-2] > 1 and all_rows:
        yield "the softmax runs over the query axis (dim=-2) instead of the keys", \
            _softmax_attention(q, k, v, mask, scale=s, dim=-2)
    if mask is not None and not bool(mask.all()):
        yield "the mask is ignored", _softmax_attention(q, k, v, None, scale=s)
        if bool((~mask).any(dim=-1).all()):  # inverting leaves every row some key
            yield "the mask is applied with inverted polarity (True taken as 'ignore')", \
                _softmax_attention(q, k, v, ~mask, scale=s)
    yield from _dropped_tail(q, k, v, mask, s)


def _dropped_tail(q, k, v, mask, s):
    """Keys beyond the last full block of a blocked kernel ignored: a loop over n_kv // block blocks."""
    n_kv = k.shape[-2]
    for block in (16, 32, 64, 128, 256, 512, 1024):
        kept = n_kv - n_kv % block
        if 0 < kept < n_kv:
            m = None if mask is None else mask[..., :kept]
            yield (f"the last {n_kv - kept} keys are ignored: the loop over key blocks of {block} drops the "
                   f"partial block at the end (n_kv = {n_kv} is not a multiple of {block})",
                   _softmax_attention(q, k[..., :kept, :], v[..., :kept, :], m, scale=s))


def trivial_outputs(q, k, v):
    """(description, output) for outputs that are no attention at all, in float64."""
    q, k, v = (t.to("cpu", F64) for t in (q, k, v))
    shape = torch.broadcast_shapes(q.shape[:-1], v.shape[:-2] + (1,)) + v.shape[-1:]  # [..., Tq, Dv]
    yield "the output is all zeros: no attention is computed", torch.zeros(shape, dtype=F64)
    if v.shape[-2] == q.shape[-2]:
        yield "the output is V itself: the values are returned without attention over the keys", v.expand(shape)
    if q.shape[-1] == v.shape[-1]:
        yield "the output is Q itself: the queries are returned as they are", q.expand(shape)
    yield ("the output is the mean of V over the keys: the weights are uniform, Q, K and the mask are ignored "
           "(scores multiplied by 0?)", v.mean(dim=-2, keepdim=True).expand(shape))


def diagnose_mismatch(got, q, k, v, mask, budget: float) -> str:
    """One sentence naming the mistake that reproduces ``got``, or '' if none does.

    At long lengths (the scores do not fit in one chunk) the mistakes are reproduced on a few
    query rows only (probes.sample_rows), each at the cost of [rows, n_kv] scores."""
    if not torch.isfinite(got).all():
        return "the output has NaN or inf where the reference is finite"
    for description, output in trivial_outputs(q, k, v):
        if output.shape == got.shape and max_error(got, output) <= budget:
            return description
    if got.numel() > 1 and bool((got == got.flatten()[0]).all()):
        return f"the output is the constant {got.flatten()[0].item():.4g} everywhere: it ignores its inputs"
    all_rows = chunked.fits(q, k, v, mask)
    if not all_rows:
        rows = probes.sample_rows(q.shape[-2])
        q, got = q[..., rows.to(q.device), :], got[..., rows.to(got.device), :]
        if mask is not None and mask.shape[-2] > 1:
            mask = mask[..., rows.to(mask.device), :]
    for description, output in mistakes(q, k, v, mask, all_rows=all_rows):
        if max_error(got, output) <= max(budget, 1e-3 * max(1.0, output.abs().max().item())):
            return description
    if q.dtype == F64:  # a float64 target that secretly computes in float32
        ref = reference.attention(q, k, v, mask)[0]
        err = max_error(got, ref)
        err32 = max_error(naive_attention(q.float(), k.float(), v.float(), mask), ref)
        floor32 = torch.finfo(torch.float32).eps * max(1.0, ref.abs().max().item())
        if err > floor32 / 16 and err <= 4 * err32 + 8 * floor32:
            return f"float64 inputs computed at float32 precision: error {err:.1g}, budget {budget:.1g}"
    return ""
