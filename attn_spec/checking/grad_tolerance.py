"""Reference gradients and their error budgets, earned by measurement like ``attn_spec.checking.tolerance``.

The float64 reference gradients of L = <attention(Q, K, V), G> come in closed form, the
backward pass FlashAttention computes:

    S = scale * Q K^T (+ mask),   A = softmax(S),   O = A V,   G = dL/dO
    dV = A^T G                                  [..., Tk, Dv]
    dA = G V^T                                  [..., Tq, Tk]
    dS = A * (dA - rowsum(A * dA))              the softmax backward; rowsum(A * dA) = rowsum(G * O)
    dQ = scale * dS K,    dK = scale * dS^T Q   [..., Tq, Dk], [..., Tk, Dk]

A masked key has A = 0, hence dS = 0: no gradient reaches it, and none leaves a fully masked row.

A target's gradient dX may err by what an ordinary same-dtype implementation (autograd through
the two naive forms of ``attn_spec.checking.tolerance``) shows on the same inputs, times GRAD_FACTOR,
plus a floor:

    |dX - dX64|_max  <=  GRAD_FACTOR * |dX_naive - dX64|_max  +  FLOOR_ULPS * grad_floor_unit

    grad_floor_unit = eps(dtype) * (sqrt(Tq + Tk + Dv) + max|Q| max|K| d_k scale) * max|dX|_terms

where |dX|_terms is the same closed form over absolute values (|G|, |V|, |K|, |Q|): rounding in
a sum scales with the size of its terms, not with its result, and gradients cancel a lot (all
V rows equal gives dQ = 0 exactly, yet every implementation rounds). The score term is the
bound on |scaled score| of ``tolerance.floor_unit``: a score s carries a rounding error of
about eps * |s| into A (ties broken by rounding in a saturated softmax need the full bound).

FlashAttention's tests allow gradients a larger factor than outputs (3 against 2); PyTorch's
SDPA tests use fudge factors of 2 to 8 for gradients; GRAD_FACTOR = 2 * FACTOR. Calibrated on
the 19 differentiable correct variants of ``tests/gallery`` (every dtype, 100 thorough cases
each): the worst one uses 12% of its budget, and its error is at most 0.46 floor units, so the
floor alone (FLOOR_ULPS = 2) covers each of them four times over; the factor covers a target
that rounds worse than the naive formula.

At lengths where the whole score matrix does not fit in one chunk (``chunked.fits``), both the
closed form runs a chunk of query rows at a time: dQ row by row, dK and dV summed over the chunks,
so the kit's memory stays O(chunk x n_kv + n x d); the gradients and their absolute terms come from
one pass over each chunk's weights. There the same-dtype sample is torch's fused attention's
backward (one kernel) instead of autograd through the naive forms a chunk at a time (20 to 40 times
its price); the floor, which covers every calibrated variant four times over, is unchanged.

On a case judged on chosen rows (``rows.sampled``), the upstream gradient is zero except on the rows of
``rows.choose`` (:func:`judged_backward`). A query row whose G is zero has dS = A * (0 - 0) = 0: its dQ
is exactly zero and it adds nothing to dK and dV. So the target's gradients, on every row and every
key, are those of the sub-problem of the chosen rows, attention(Q[R], K, V, mask[R]) with upstream
G[R]; its float64 closed form costs O(k n d) for k rows, not O(n^2 d), and is exact, not sampled. Its
budget is earned on the same sub-problem, by the two naive forms and the fused attention, the floor's
sums counted over all n_q rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_spec import reference
from attn_spec.checking import chunked, rows
from attn_spec.checking.tolerance import FACTOR, earned, eps, max_error, naive_attention, seed_attention

GRAD_FACTOR = 2 * FACTOR
F64 = torch.float64
NAMES = ("dQ", "dK", "dV")


def _scale(q, scale):
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def reference_grads(q, k, v, mask, grad_out, *, scale=None, absolute=False):
    """(dQ, dK, dV) of <attention(q, k, v, mask), grad_out> in float64 on the CPU, in closed form.

    Q, K, V share their leading dims. ``absolute=True`` evaluates the same sums over the
    absolute values of their terms: the magnitudes the rounding of any implementation scales with.
    """
    s = _scale(q, scale)
    if not chunked.fits(q, k, v, mask):
        return _chunked_reference_grads(q, k, v, mask, grad_out, scale=s, absolute=absolute)
    weights = reference.attention(q, k, v, mask, scale=s)[1]  # [..., Tq, Tk]
    return _closed_form(weights, *(t.detach().to("cpu", F64) for t in (q, k, v, grad_out)), s, absolute)


def _closed_form(weights, q, k, v, g, scale, absolute):
    """(dQ, dK, dV) from the float64 weights [..., Tq, Tk] and Q, K, V, G in float64 (``absolute``: over the
    absolute values of the terms). On a chunk of query rows: dQ of those rows, their share of dK and dV."""
    if absolute:
        q, k, v, g = q.abs(), k.abs(), v.abs(), g.abs()
    d_weights = g @ v.transpose(-2, -1)  # [..., Tq, Dv] x [..., Dv, Tk] -> [..., Tq, Tk]
    row = (weights * d_weights).sum(dim=-1, keepdim=True)  # [..., Tq, 1]
    d_scores = weights * (d_weights + row if absolute else d_weights - row)  # [..., Tq, Tk]
    dq = scale * (d_scores @ k)  # [..., Tq, Tk] x [..., Tk, Dk] -> [..., Tq, Dk]
    dk = scale * (d_scores.transpose(-2, -1) @ q)  # [..., Tk, Tq] x [..., Tq, Dk] -> [..., Tk, Dk]
    dv = weights.transpose(-2, -1) @ g  # [..., Tk, Tq] x [..., Tq, Dv] -> [..., Tk, Dv]
    return dq, dk, dv


def _chunked_reference_grads(q, k, v, mask, grad_out, *, scale, absolute, both=False):
    """The same closed form a chunk of query rows at a time: dQ per chunk, dK and dV summed. ``both``: the
    gradients and their absolute terms from one pass over the weights, (plain, absolute)."""
    device = chunked.compute_device(q)
    batch = chunked.batch_shape(q, k, v, mask)
    kinds = (False, True) if both else (absolute,)
    out = {kind: [torch.zeros(*batch, *shape, dtype=F64, device=device)
                  for shape in (q.shape[-2:], k.shape[-2:], v.shape[-2:])] for kind in kinds}
    for index, rows, q_c, k64, v64, weights in chunked.blocks(q, k, v, mask, scale=scale):  # weights [c, Tk]
        g = chunked.element(grad_out, index)[rows].detach().to(device, F64)  # [c, Dv]
        for kind in kinds:
            dq, dk, dv = out[kind]
            dq_c, dk_c, dv_c = _closed_form(weights, q_c, k64, v64, g, scale, kind)  # [c, Dk], [Tk, Dk], [Tk, Dv]
            dq[index][rows] = dq_c
            dk[index] += dk_c
            dv[index] += dv_c
    return (tuple(out[False]), tuple(out[True])) if both else tuple(out[absolute])


def reference_grads_and_terms(q, k, v, mask, grad_out):
    """(the reference gradients, their absolute terms) as :func:`reference_grads` gives each, from one pass over
    the float64 weights (each chunk's softmax computed once for both)."""
    s = _scale(q, None)
    if chunked.fits(q, k, v, mask):
        weights = reference.attention(q, k, v, mask, scale=s)[1]  # [..., Tq, Tk]
        x = [t.detach().to("cpu", F64) for t in (q, k, v, grad_out)]
        return _closed_form(weights, *x, s, False), _closed_form(weights, *x, s, True)
    return _chunked_reference_grads(q, k, v, mask, grad_out, scale=s, absolute=False, both=True)


def naive_grads(impl, q, k, v, mask, grad_out):
    """(dQ, dK, dV) from autograd through ``impl(q, k, v, mask)`` in the inputs' dtype and device;
    a chunk of query rows at a time when the whole score matrix does not fit in one."""
    if not chunked.fits(q, k, v, mask) and impl is not fused_attention:
        return _chunked_naive_grads(impl, q, k, v, mask, grad_out)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = impl(*leaves, mask)
        return torch.autograd.grad((out * grad_out).sum(), leaves)  # <out, grad_out>: see Target.vjp


def _chunked_naive_grads(impl, q, k, v, mask, grad_out):
    """Autograd through ``impl`` per chunk of query rows; dK and dV summed over chunks in the dtype."""
    batch = chunked.batch_shape(q, k, v, mask)
    dq, dk, dv = (torch.zeros(*batch, *t.shape[-2:], dtype=t.dtype, device=t.device) for t in (q, k, v))
    # autograd keeps about four [rows, Tk] buffers per chunk: a quarter of the chunk's bytes each
    chunks = chunked.row_chunks(q.shape[-2], k.shape[-2], chunked.chunk_bytes_for(q.device) // 4)
    for index, q_e, k_e, v_e, mask_e in chunked.elements(q, k, v, mask):
        for rows in chunks:
            leaves = [t.detach().clone().requires_grad_(True) for t in (q_e[rows], k_e, v_e)]
            with torch.enable_grad():
                out = impl(*leaves, chunked.row_mask(mask_e, rows))  # [c, Dv]
                g_q, g_k, g_v = torch.autograd.grad((out * chunked.element(grad_out, index)[rows]).sum(), leaves)
            dq[index][rows] = g_q
            dk[index] += g_k
            dv[index] += g_v
    return dq, dk, dv


def fused_attention(q, k, v, mask=None):
    """torch's fused attention in the inputs' dtype and device (one kernel, forward and backward): at long
    lengths the ordinary same-dtype sample of the gradients' rounding, for the price of one call."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def grad_budgets(q, k, v, mask, grad_out, ref_grads, terms=None, *, samples=None,
                 n_q=None) -> tuple[float, float, float]:
    """The largest error a correct implementation may show in dQ, dK and dV on these inputs.

    At lengths where the scores do not fit in one chunk, the same-dtype sample is torch's fused attention
    (autograd through the two naive forms, a chunk of rows at a time, costs 20 to 40 calls of it there).
    ``terms``: the absolute terms of the closed form, when already computed (reference_grads_and_terms);
    ``samples``: the same-dtype implementations to sample rounding with, instead of that choice; ``n_q``: the
    case's query rows where ``q`` holds only the judged ones (the floor's sums run over the target's)."""
    naive = [0.0, 0.0, 0.0]
    long = not chunked.fits(q, k, v, mask) and (mask is None or mask.dtype == torch.bool)
    for impl in samples or ((fused_attention,) if long else (naive_attention, seed_attention)):  # one can be lucky
        for i, (got, ref) in enumerate(zip(naive_grads(impl, q, k, v, mask, grad_out), ref_grads)):
            err = max_error(got, ref)
            naive[i] = max(naive[i], err if math.isfinite(err) else 0.0)  # overflowed: the floor judges
    terms = terms or reference_grads(q, k, v, mask, grad_out, absolute=True)
    score = q.detach().abs().amax().item() * k.detach().abs().amax().item() * q.shape[-1] * _scale(q, None) \
        if q.numel() and k.numel() else 0.0  # the bound on |scaled score| that tolerance.floor_unit uses
    length = math.sqrt((n_q or q.shape[-2]) + k.shape[-2] + v.shape[-1]) + min(score, 1e6)
    units = [eps(q.dtype) * length * (t.max().item() if t.numel() else 0.0) for t in terms]
    return tuple(earned(n, u, factor=GRAD_FACTOR) for n, u in zip(naive, units))


@dataclass
class Backward:
    """The backward problem a case's gradients are judged on: the whole case, or on a long case the
    sub-problem of its chosen query rows (``why``: {row: reason}, as ``rows.choose`` gives)."""
    q: torch.Tensor  # [..., Tq or k, Dk]: the query rows the float64 reference is computed on
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None  # the mask of those rows
    grad_out: torch.Tensor  # [..., Tq or k, Dv]: their upstream gradient
    upstream: torch.Tensor  # [..., Tq, Dv]: the G the target is given (zero off the chosen rows)
    why: dict[int, str] | None = None
    index: torch.Tensor | None = None
    n_q: int = 0

    def expand(self, dq):
        """dQ of the judged rows [..., k, Dk] as the whole case's [..., Tq, Dk] (zero on the other rows)."""
        if self.why is None:
            return dq
        whole = torch.zeros(*dq.shape[:-2], self.n_q, dq.shape[-1], dtype=dq.dtype, device=dq.device)
        return whole.index_copy_(-2, self.index.to(dq.device), dq)

    def reference(self, *, mask=True):
        """(dQ, dK, dV) of the float64 closed form on the whole case's shapes (``mask=False``: unmasked)."""
        dq, dk, dv = reference_grads(self.q, self.k, self.v, self.mask if mask else None, self.grad_out)
        return self.expand(dq), dk, dv

    def reference_and_budgets(self):
        """((dQ, dK, dV) of the float64 closed form, their budgets), on the problem judged."""
        (dq, dk, dv), terms = reference_grads_and_terms(self.q, self.k, self.v, self.mask, self.grad_out)
        samples = None if self.why is None else (naive_attention, seed_attention) + (
            (fused_attention,) if self.mask is None or self.mask.dtype == torch.bool else ())
        allowed = grad_budgets(self.q, self.k, self.v, self.mask, self.grad_out, (dq, dk, dv), terms,
                               samples=samples, n_q=self.n_q)
        return (self.expand(dq), dk, dv), allowed


def judged_backward(q, k, v, mask, grad_out) -> Backward:
    """The whole case, or on a long one (``rows.sampled``) G zeroed off the chosen rows and their sub-problem."""
    if not rows.sampled(q, k, v, mask):
        return Backward(q, k, v, mask, grad_out, grad_out, n_q=q.shape[-2])
    why = rows.choose(q.shape[-2], k.shape[-2])
    index = torch.tensor(list(why), dtype=torch.long, device=q.device)
    g_rows = grad_out.index_select(-2, index.to(grad_out.device))  # [..., k, Dv]
    upstream = torch.zeros_like(grad_out).index_copy_(-2, index.to(grad_out.device), g_rows)  # [..., Tq, Dv]
    m_rows = None if mask is None else mask if mask.shape[-2] == 1 else mask.index_select(-2, index.to(mask.device))
    return Backward(q.index_select(-2, index), k, v, m_rows, g_rows, upstream, why, index, q.shape[-2])
