"""The sympy building blocks of the derivations that justify catalog properties.

A derivation lives beside its property (``@derivation`` in ``attn_spec.checking.catalog``) and
imports this module inside the function, so that importing the catalog never imports sympy
(0.8 s). Each derivation returns its steps, a list of ``(text, sympy expression)``, and asserts
its result symbolically. Each starts from :func:`symbolic_attention`, the canonical formula
written in sympy with the kit's scale (:func:`canonical_scale`), and ends by checking that
``attn_spec.reference`` (the float64 oracle every property measures against) agrees with the
symbolic formula on a small numeric point: a change to the reference's scale, softmax axis or
head split makes the derivation raise :class:`DerivationError`.

    >>> from attn_spec.properties import catalog
    >>> for text, expr in catalog()["rows-sum-to-one"].derivation(): print(text, expr)
"""
from __future__ import annotations

import sympy as sp
import torch

from attn_spec import reference
from attn_spec.errors import AttnSpecError

Steps = list[tuple[str, sp.Basic]]
F64 = torch.float64


class DerivationError(AttnSpecError, AssertionError):
    """A derivation's symbolic result, or the reference's agreement with it, does not hold."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise DerivationError(message)


def canonical_scale(d_k):
    """The canonical score scale 1/sqrt(d_k), as sympy (exact for an int, symbolic for a Symbol)."""
    return 1 / sp.sqrt(d_k)


def softmax_row(s) -> sp.Matrix:
    """softmax of one row of scores, as a 1 x n sympy Matrix."""
    e = [sp.exp(x) for x in s]
    total = sum(e)
    return sp.Matrix([[x / total for x in e]])


def symbolic_attention(Q: sp.Matrix, K: sp.Matrix, V: sp.Matrix, scale=None):
    """(out, weights, scores) of softmax(scale * Q K^T) V; scale defaults to the canonical 1/sqrt(d_k)."""
    scale = canonical_scale(Q.shape[1]) if scale is None else scale
    S = scale * Q * K.T  # [Tq, Tk]
    A = sp.Matrix.vstack(*(softmax_row(S.row(i)) for i in range(S.rows)))  # [Tq, Tk]
    return A * V, A, S


def numbers(rows: int, cols: int, offset: int = 0) -> sp.Matrix:
    """A small matrix of exact rationals with distinct, sign-mixed entries."""
    return sp.Matrix(rows, cols, lambda i, j: sp.Rational((-1) ** (i + j) * (2 * i + 3 * j + offset + 1), 4))


def as_tensor(m: sp.Matrix) -> torch.Tensor:
    return torch.tensor([[float(x) for x in m.row(i)] for i in range(m.rows)], dtype=F64)


def agreement(symbolic: sp.Matrix, numeric: torch.Tensor, what: str, tol: float = 1e-12) -> sp.Basic:
    """Max |symbolic - numeric|, evaluated to 30 digits; raises unless it is below ``tol``."""
    exact = torch.tensor([[float(x.evalf(30)) for x in symbolic.row(i)] for i in range(symbolic.rows)], dtype=F64)
    err = (exact - numeric.to(F64)).abs().max().item()
    require(err < tol, f"{what}: the float64 reference differs from the symbolic formula by {err:.3g}")
    return sp.Float(err, 3)


def reference_weights_agree(d_k: int = 2) -> tuple[str, sp.Basic]:
    """The step tying a derivation to the kit: reference.attention's weights equal the symbolic ones."""
    Q, K, V = numbers(2, d_k), numbers(3, d_k, 1), numbers(3, 2, 2)
    out, A, _ = symbolic_attention(Q, K, V)
    ref_out, ref_A = reference.attention(as_tensor(Q), as_tensor(K), as_tensor(V))
    agreement(A, ref_A, "weights")
    err = agreement(out, ref_out, "output")
    return (f"the kit's float64 reference gives the same weights and output on a 2x{d_k} example "
            f"(max |difference| {float(err):.1g})", A.evalf(6))


def expectation(poly: sp.Expr, variables) -> sp.Expr:
    """E[poly] for independent zero-mean, unit-variance variables (moments used up to order 2)."""
    moments = {0: 1, 1: 0, 2: 1}
    total = sp.Integer(0)
    for monomial, coeff in sp.Poly(sp.expand(poly), *variables).terms():
        require(max(monomial) <= 2, "moments above order 2 are not needed here")
        total += coeff * sp.Mul(*(moments[p] for p in monomial))
    return total
