"""Symbolic derivations (sympy) of the facts that justify five catalog properties.

Each derivation is one function returning its steps, a list of ``(text, sympy expression)``,
and asserting its result symbolically. Each starts from :func:`symbolic_attention`, the
canonical formula written in sympy with the kit's scale (:func:`canonical_scale`), and ends by
checking that ``attn_spec.reference`` (the float64 oracle every property measures against)
agrees with the symbolic formula on a small numeric point: a change to the reference's scale,
softmax axis or head split makes the derivation raise :class:`DerivationError`.

    >>> from attn_spec.properties.derivations import DERIVATIONS
    >>> for text, expr in DERIVATIONS["rows-sum-to-one"](): print(text, expr)
"""
from __future__ import annotations

import math

import sympy as sp
import torch

from attn_spec import reference
from attn_spec.errors import AttnSpecError

Steps = list[tuple[str, sp.Basic]]
F64 = torch.float64


class DerivationError(AttnSpecError, AssertionError):
    """A derivation's symbolic result, or the reference's agreement with it, does not hold."""


def _require(ok: bool, message: str) -> None:
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


def _numbers(rows: int, cols: int, offset: int = 0) -> sp.Matrix:
    """A small matrix of exact rationals with distinct, sign-mixed entries."""
    return sp.Matrix(rows, cols, lambda i, j: sp.Rational((-1) ** (i + j) * (2 * i + 3 * j + offset + 1), 4))


def _tensor(m: sp.Matrix) -> torch.Tensor:
    return torch.tensor([[float(x) for x in m.row(i)] for i in range(m.rows)], dtype=F64)


def _agreement(symbolic: sp.Matrix, numeric: torch.Tensor, what: str, tol: float = 1e-12) -> sp.Basic:
    """Max |symbolic - numeric|, evaluated to 30 digits; raises unless it is below ``tol``."""
    exact = torch.tensor([[float(x.evalf(30)) for x in symbolic.row(i)] for i in range(symbolic.rows)], dtype=F64)
    err = (exact - numeric.to(F64)).abs().max().item()
    _require(err < tol, f"{what}: the float64 reference differs from the symbolic formula by {err:.3g}")
    return sp.Float(err, 3)


def _reference_weights_agree(d_k: int = 2) -> tuple[str, sp.Basic]:
    """The step tying a derivation to the kit: reference.attention's weights equal the symbolic ones."""
    Q, K, V = _numbers(2, d_k), _numbers(3, d_k, 1), _numbers(3, 2, 2)
    out, A, _ = symbolic_attention(Q, K, V)
    ref_out, ref_A = reference.attention(_tensor(Q), _tensor(K), _tensor(V))
    _agreement(A, ref_A, "weights")
    err = _agreement(out, ref_out, "output")
    return (f"the kit's float64 reference gives the same weights and output on a 2x{d_k} example "
            f"(max |difference| {float(err):.1g})", A.evalf(6))


def rows_sum_to_one() -> Steps:
    """Each row of softmax(scale * Q K^T) sums to 1, for any Q and K."""
    Q, K, V = sp.Matrix(2, 2, sp.symbols("q1:3(1:3)", real=True)), sp.Matrix(3, 2, sp.symbols("k1:4(1:3)", real=True)), \
        sp.Matrix(3, 1, sp.symbols("v1:4", real=True))
    tie = _reference_weights_agree()
    _, A, S = symbolic_attention(Q, K, V)
    row = A.row(0)
    total = sp.simplify(sp.together(sum(row)))
    _require(all(sp.simplify(sp.together(sum(A.row(i)))) == 1 for i in range(A.rows)), "a row does not sum to 1")
    return [("scores of query 1 (canonical scale 1/sqrt(d_k), d_k = 2)", S.row(0)),
            ("weights of query 1: a_j = exp(s_j) / sum_l exp(s_l)", row),
            ("their sum", sum(row)),
            ("over one common denominator the numerator equals the denominator: every row sums to 1", total),
            tie]


def key_shift_invariance() -> Steps:
    """Adding c to every key adds the same t = scale * q.c to each score of a row; softmax ignores it."""
    q, K, V = sp.Matrix([sp.symbols("q1:3", real=True)]), sp.Matrix(2, 2, sp.symbols("k1:3(1:3)", real=True)), \
        sp.Matrix(2, 1, sp.symbols("v1:3", real=True))
    c = sp.Matrix([sp.symbols("c1:3", real=True)])
    tie = _reference_weights_agree()
    shifted = K + sp.ones(K.rows, 1) * c  # k_j + c for every key j
    _, A, S = symbolic_attention(q, K, V)
    _, A2, S2 = symbolic_attention(q, shifted, V)
    moves = sp.expand(S2 - S)  # [1, Tk]
    _require(all(sp.expand(x - moves[0]) == 0 for x in moves), "keys shifted by c move the scores unequally")
    s, t = sp.symbols("s1:4", real=True), sp.Symbol("t", real=True)
    diff = sp.simplify(softmax_row([x + t for x in s]) - softmax_row(s))
    _require(diff == sp.zeros(1, 3), "softmax(s + t) != softmax(s)")
    _require(sp.simplify(A2 - A) == sp.zeros(*A.shape), "the weights change when keys are shifted")
    return [("keys shifted by the same vector c: scores move by", moves),
            ("the same t for every key of the row: exp(s_j + t) = e^t exp(s_j), and e^t cancels",
             diff),
            ("so the weights of the shifted keys equal the original ones", sp.simplify(A2 - A)),
            tie]


def _expectation(poly: sp.Expr, variables) -> sp.Expr:
    """E[poly] for independent zero-mean, unit-variance variables (moments used up to order 2)."""
    moments = {0: 1, 1: 0, 2: 1}
    total = sp.Integer(0)
    for monomial, coeff in sp.Poly(sp.expand(poly), *variables).terms():
        _require(max(monomial) <= 2, "moments above order 2 are not needed here")
        total += coeff * sp.Mul(*(moments[p] for p in monomial))
    return total


def scale_sqrt_dk() -> Steps:
    """Var(q.k) = d_k for independent zero-mean unit-variance entries, so the scale is 1/sqrt(d_k)."""
    d_k, i, c = sp.Symbol("d_k", positive=True, integer=True), sp.Symbol("i", integer=True), sp.Symbol("c", positive=True)
    second_moments = []
    for d in range(1, 7):  # the collapse of the double sum, checked dimension by dimension
        q, k = sp.symbols(f"q1:{d + 1}"), sp.symbols(f"k1:{d + 1}")
        dot = sum(a * b for a, b in zip(q, k))
        _require(_expectation(dot, q + k) == 0, f"E[q.k] != 0 at d_k={d}")
        second_moments.append(_expectation(dot**2, q + k))
        _require(second_moments[-1] == d, f"E[(q.k)^2] != d_k at d_k={d}")
    variance = sp.Sum(1, (i, 1, d_k)).doit()  # sum_i E[q_i^2] E[k_i^2]
    solved = sp.solve(sp.Eq(c**2 * variance, 1), c)
    _require(solved == [canonical_scale(d_k)], f"Var(c q.k) = 1 solves to {solved}, not the canonical scale")
    rows = []
    for d in (4, 16):  # the reference applies that scale: probe with keys 0 and sqrt(d) e_0
        q = torch.zeros(1, d, dtype=F64)
        q[0, 0] = 1
        k = torch.zeros(2, d, dtype=F64)
        k[1, 0] = math.sqrt(d)
        w = reference.attention(q, k, torch.eye(2, dtype=F64))[1]  # [1, 2]
        expected = 1 / (1 + sp.exp(-solved[0].subs(d_k, d) * sp.sqrt(d)))  # sigmoid(c * gap)
        _agreement(sp.Matrix([[1 - expected, expected]]), w, f"scale at d_k={d}")
        rows.append(w[0, 1].item())
    return [("E[q.k] = sum_i E[q_i] E[k_i] = 0 (independence, zero mean)", sp.Integer(0)),
            ("E[(q.k)^2] = sum_i sum_j E[q_i q_j] E[k_i k_j]; only i = j survives, E[q_i^2] E[k_i^2] = 1",
             sp.Eq(sp.Symbol("Var(q.k)"), variance)),
            ("checked term by term by expanding (q.k)^2: E[(q.k)^2] for d_k = 1..6", sp.Tuple(*second_moments)),
            ("the scaled score c q.k has variance c^2 d_k; unit variance needs", sp.Eq(c, solved[0])),
            (f"the kit's reference applies it: weight on the key with raw gap sqrt(d_k) is sigmoid(1) "
             f"({rows[0]:.6f} at d_k=4 and 16)", sp.Eq(sp.Symbol("w"), 1 / (1 + sp.exp(-1))))]


def gradients() -> Steps:
    """The Jacobian of a = softmax(s) is diag(a) - a a^T."""
    s = sp.symbols("s1:4", real=True)
    a = softmax_row(s)  # [1, 3]
    J = a.jacobian(s)  # [3, 3]
    closed = sp.diag(*a) - a.T * a
    # The reference's weights as a function of the scores: K = I / scale makes scores = q exactly.
    d, point = 3, [sp.Rational(1, 2), sp.Rational(-1, 3), sp.Rational(3, 4)]
    K = float(1 / canonical_scale(d)) * torch.eye(d, dtype=F64)  # [Tk=3, Dk=3]
    h, cols = 1e-6, []
    for j in range(d):
        e = torch.zeros(1, d, dtype=F64)
        e[0, j] = h
        q = torch.tensor([[float(x) for x in point]], dtype=F64)
        plus, minus = reference.attention(q + e, K, K)[1], reference.attention(q - e, K, K)[1]
        cols.append(((plus - minus) / (2 * h))[0])  # d a / d s_j
    fd = torch.stack(cols, dim=1)  # [3, 3]: J[i, j] = d a_i / d s_j
    err = _agreement(closed.subs(dict(zip(s, point))), fd, "softmax Jacobian", tol=1e-8)
    _require(sp.simplify(J - closed) == sp.zeros(3, 3), "d softmax / ds != diag(a) - a a^T")
    return [("a = softmax(s)", a),
            ("d a_i / d s_j, differentiated by sympy", sp.simplify(J)),
            ("J - (diag(a) - a a^T) simplifies to zero", sp.simplify(J - closed)),
            (f"finite differences of the kit's reference agree (max |difference| {float(err):.1g})",
             closed.subs(dict(zip(s, point))).evalf(6))]


def _multihead_forms(X: sp.Matrix, W: dict, h: int):
    """(heads, Concat(heads) W_O^T, sum_i head_i W_O[:, block i]^T) with per-head projections."""
    d_head = X.shape[1] // h
    heads, projected = [], []
    for i in range(h):
        rows = slice(i * d_head, (i + 1) * d_head)  # head i's rows of each nn.Linear weight
        per_head = [X * W[n][rows, :].T for n in ("W_Q", "W_K", "W_V")]  # [T, d_head] each
        full = [(X * W[n].T)[:, rows] for n in ("W_Q", "W_K", "W_V")]  # split after projecting
        _require(all(sp.expand(a - b) == sp.zeros(*a.shape) for a, b in zip(per_head, full)),
                 "per-head projection != column block of the full projection")
        head = symbolic_attention(*per_head)[0]  # [T, d_head], scale 1/sqrt(d_head)
        heads.append(head)
        projected.append(head * W["W_O"][:, rows].T)  # head i through its block of W_O
    concat = sp.Matrix.hstack(*heads) * W["W_O"].T  # [T, d_model]
    return heads, concat, sum(projected, sp.zeros(*concat.shape))


def head_concat_equivalence() -> Steps:
    """h heads with per-head projections, concatenated and mixed by W_O, equal the seed's split form."""
    names = ("W_Q", "W_K", "W_V", "W_O")
    # Numerically first, at d_head = 2 (where the per-head scale 1/sqrt(d_head) is not 1): the kit's reference.
    Xn = _numbers(3, 4)
    Wn = {n: _numbers(4, 4, i + 1) / 2 for i, n in enumerate(names)}
    ref = reference.multihead(_tensor(Xn), _tensor(Xn), *(_tensor(Wn[n]) for n in names), 2)[0]
    concat_n = _multihead_forms(Xn, Wn, 2)[1]
    err = _agreement(concat_n, ref, "multi-head output")
    # Symbolically at d_model = 2, h = 2.
    d_model, h, T = 2, 2, 2
    X = sp.Matrix(T, d_model, sp.symbols(f"x1:{T + 1}(1:{d_model + 1})", real=True))
    W = {n: sp.Matrix(d_model, d_model, sp.symbols(f"{n.lower()}1:{d_model + 1}(1:{d_model + 1})", real=True))
         for n in names}
    heads, concat, summed = _multihead_forms(X, W, h)
    _require(sp.expand(concat - summed) == sp.zeros(T, d_model), "Concat(heads) W_O^T != sum_i head_i W_O,i^T")
    return [("head i projects with rows i*d_head:(i+1)*d_head of W_Q, W_K, W_V (= that column block of x W^T)",
             X * W["W_Q"][0:1, :].T),
            ("head 1 = attention(x W_Q1^T, x W_K1^T, x W_V1^T), scale 1/sqrt(d_head)", heads[0]),
            ("Concat(head_1, head_2) W_O^T - sum_i head_i W_O[:, block i]^T", sp.expand(concat - summed)),
            (f"the kit's reference.multihead agrees with the per-head form at d_model = 4, h = 2 "
             f"(max |difference| {float(err):.1g})", concat_n.evalf(6))]


DERIVATIONS = {
    "rows-sum-to-one": rows_sum_to_one,
    "key-shift-invariance": key_shift_invariance,
    "scale-sqrt-dk": scale_sqrt_dk,
    "gradients": gradients,
    "head-concat-equivalence": head_concat_equivalence,
}

__all__ = ["DERIVATIONS", "DerivationError", "canonical_scale", "softmax_row", "symbolic_attention"] + \
    [f.__name__ for f in DERIVATIONS.values()]
