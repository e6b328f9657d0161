"""An exact oracle for tiny inputs: attention computed with sympy, checked against the float64 reference.

Every float64 entry is converted to the rational number it represents exactly
(``Rational(*x.as_integer_ratio())``), so

    s_ij = c * sum_d Q_id K_jd (+ B_ij for an additive float mask),    c = 1/sqrt(d_k) exactly
    w_ij = exp(s_ij) / sum_{j' allowed} exp(s_ij')                     (0 where j is masked out)
    O_ic = sum_j w_ij V_jc

Scores are exact and each output entry stays a symbolic expression, evaluated once to
``digits`` significant digits (sympy's evalf raises its working precision to get them even
through cancellation, and an entry that is exactly 0 comes out 0), then rounded to float64.
With the default 50 digits the result is the correctly rounded float64 of the true value for
all practical purposes. Same conventions as ``attn_spec.reference``: bool mask True = may
attend, a float mask is added to the scaled scores (-inf = masked out), a row with no
allowed key gives a zero output row, leading dims broadcast. Cost grows like
batch * n_q * n_kv * (d_k + d_v) symbolic operations: keep inputs tiny.
"""
from __future__ import annotations

import itertools
import math

import sympy
import torch


def _rational(x: float) -> sympy.Rational:
    """The exact value of a float (nsimplify would guess a "nice" nearby number instead)."""
    return sympy.Rational(*float(x).as_integer_ratio())


def _matrix(t: torch.Tensor) -> list[list[sympy.Rational]]:
    return [[_rational(x) for x in row] for row in t.tolist()]


def _row(q_i, K, V, allowed, bias, c, digits) -> list[float]:
    """One output row: the exact expression sum_j exp(s_ij) V_j / sum_j exp(s_ij), evaluated to ``digits`` digits."""
    keys = [j for j in range(len(K)) if allowed[j]]
    if not keys:
        return [0.0] * len(V[0])
    e = {j: sympy.exp(c * sum(a * b for a, b in zip(q_i, K[j])) + bias[j]) for j in keys}  # exp(s_ij), symbolic
    total = sum(e.values())
    return [float((sum(e[j] * V[j][col] for j in keys) / total).evalf(digits)) for col in range(len(V[0]))]


def exact_attention(q, k, v, mask=None, *, scale=None, digits=50) -> torch.Tensor:
    """softmax(scale * Q K^T + bias) V evaluated exactly to ``digits`` digits; float64 [..., Tq, Dv].

    q [..., Tq, Dk], k [..., Tk, Dk], v [..., Tk, Dv]; mask bool (True = may attend) or float
    (added), broadcastable to [..., Tq, Tk]; ``scale`` defaults to 1/sqrt(d_k) (exact).
    """
    q, k, v = (t.detach().to("cpu", torch.float64) for t in (q, k, v))
    n_q, d_k, n_kv, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
    full = torch.broadcast_shapes(q.shape[:-2] + (n_q, n_kv), k.shape[:-2] + (n_q, n_kv),
                                  v.shape[:-2] + (n_q, n_kv), () if mask is None else mask.shape)
    batch = full[:-2]
    if mask is None:
        mask = torch.ones(full, dtype=torch.bool)
    mask = mask.detach().cpu().expand(full)  # [..., Tq, Tk]
    c = 1 / sympy.sqrt(d_k) if scale is None else _rational(scale)
    out = torch.zeros(batch + (n_q, d_v), dtype=torch.float64)  # [..., Tq, Dv]
    for index in itertools.product(*(range(n) for n in batch)):
        Q, K, V = (_matrix(t.expand(batch + t.shape[-2:])[index]) for t in (q, k, v))
        m = mask[index].tolist()  # [Tq][Tk]
        for i in range(n_q):
            if mask.dtype == torch.bool:
                allowed, bias = m[i], [0] * n_kv
            else:
                if any(math.isnan(b) or b == math.inf for b in m[i]):
                    raise ValueError("an additive mask may hold finite values or -inf only")
                allowed = [b != -math.inf for b in m[i]]
                bias = [_rational(b) if ok else 0 for b, ok in zip(m[i], allowed)]
            out[index + (i,)] = torch.tensor(_row(Q[i], K, V, allowed, bias, c, digits), dtype=torch.float64)
    return out
