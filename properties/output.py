"""The output as a whole: its shape in cross-attention, its heads, its values against the reference.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.checking.diagnose import diagnose_mismatch
from attn_spec.checking.tolerance import max_error, multihead_budget
from attn_spec.errors import Failure
from attn_spec.properties.core import cross_or_self
from attn_spec.targets.conventions import MULTIHEAD_CONVENTIONS
from attn_spec.properties.informative import ignored_inputs, require_responsive


@prop("cross-attention-shapes", family="shapes",
      statement="n_q != n_kv and d_v != d_k give output [..., n_q, d_v]", cases={"cross": True},
      at_scale="every property's call checks the output shape at such sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=1), Case(n_q=3, n_kv=1, d_k=1, d_v=2)],
      lesson=Lesson(unicode="Q ∈ ℝ^(n_q×d_k), K ∈ ℝ^(n_kv×d_k), V ∈ ℝ^(n_kv×d_v)  ⇒  attn(Q, K, V) ∈ ℝ^(n_q×d_v)",
                    latex=r"Q \in \mathbb{R}^{n_q\times d_k},\ K \in \mathbb{R}^{n_{kv}\times d_k},\ V \in \mathbb{R}^{n_{kv}\times d_v}"
                          r"\ \Rightarrow\ \mathrm{attn}(Q,K,V) \in \mathbb{R}^{n_q\times d_v}",
                    check="Draws rectangular cases (n_q ≠ n_kv, d_v ≠ d_k); the adapter checks the output shape and the "
                          "property that it is finite.",
                    example="shapes"))
def cross_attention_shapes(target, case):
    """out = softmax(Q K^T / sqrt(d_k)) V has shape [..., n_q, d_v] for any n_kv and d_k.

    Why: cross-attention (decoder queries over encoder keys) has as many outputs as queries
    and as wide as the values. Catches: K used for V, the output built from the key count,
    d_v assumed equal to d_k, a causal mask hard-coded for square shapes.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    out = target.attend(q, k, v, mask)  # shape checked by the adapter: [..., Tq, Dv]
    if not torch.isfinite(out).all():
        fail("NaN or inf", what="the output of a rectangular case", expected="finite values",
             call=f"attention(Q [{case.n_q}, {case.d_k}], K [{case.n_kv}, {case.d_k}], V [{case.n_kv}, {case.d_v}])",
             cause=lambda: _nonfinite_cause(target, case), got=out,
             expected_tensor=reference.attention(q, k, v, mask)[0])


def _nonfinite_cause(target, case) -> str:
    """NaN out of a rectangular case: is it the shape, or does a square case give NaN too?"""
    square = case.replace(n_kv=case.n_q, d_v=case.d_k)
    try:
        out = target.attend(*square.tensors())
    except Failure:
        out = None
    if out is not None and not torch.isfinite(out).all():
        return ("the output has NaN or inf on square inputs too: not a matter of shape (an overflowing exp, a 0/0, "
                "or reads outside the inputs?)")
    return "a square shape (n_q == n_kv or d_v == d_k) is assumed somewhere"


@prop("head-concat-equivalence", family="multi-head",
      statement="multi-head output = concat of per-head single-head attention, times W_O; h=1 is single-head",
      conventions=MULTIHEAD_CONVENTIONS, multihead=True,
      at_scale="the projections and the split into heads do not depend on the length: checked at the drawn sizes",
      examples=[MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2), MhaCase(n_q=2, n_kv=3, d_model=2, n_heads=1)],
      lesson=Lesson(unicode="MHA(x_q, x_kv) = Concat(head₁, …, head_h) W_Oᵀ,   headᵢ = attn(x_q W_Qᵢᵀ, x_kv W_Kᵢᵀ, x_kv W_Vᵢᵀ)",
                    latex=r"\mathrm{MHA}(x_q, x_{kv}) = \mathrm{Concat}(\mathrm{head}_1,\dots,\mathrm{head}_h)\,W_O^\top,\quad "
                          r"\mathrm{head}_i = \mathrm{attn}(x_q W_{Q,i}^\top, x_{kv} W_{K,i}^\top, x_{kv} W_{V,i}^\top)",
                    check="Loads chosen weights into the module (W_Q, W_K, W_V, W_O) and compares its forward with the "
                          "per-head float64 reference, concatenated and projected; h = 1 must be single-head attention.",
                    example="multihead"))
def head_concat_equivalence(target, case):
    """MHA(x_q, x_kv) = Concat(head_1, ..., head_h) W_O^T, head_i = Attention(x_q W_Q_i^T, x_kv W_K_i^T, x_kv W_V_i^T).

    Head i uses columns i*d_head:(i+1)*d_head of each projection, d_head = d_model / h, and
    scales by 1/sqrt(d_head). Why: heads must be independent attentions over their own
    slice; mixing them silently wastes capacity and still trains. Catches: heads split or
    merged with view and no transpose, the scale of the whole width, W_O missing or applied
    per head, heads summed instead of concatenated.
    """
    require_responsive(target, case)
    case = cross_or_self(target, case)
    x_q, x_kv, weights, mask = case.tensors()
    got = target.multihead(x_q, x_kv, weights, case.n_heads, mask)  # [Tq, D]
    expected, _ = reference.multihead(x_q, x_kv, *(weights[n] for n in ("W_Q", "W_K", "W_V", "W_O")),
                                      case.n_heads, mask)  # [Tq, D]
    allowed = multihead_budget(x_q, x_kv, weights, case.n_heads, mask, expected)
    assert_close(got, expected, budget=allowed, what="the output against the concatenation of per-head attentions",
                 call="forward(x_q, x_kv)" if mask is None else "forward(x_q, x_kv, mask)",
                 cause=lambda: _diagnose_heads(got, x_q, x_kv, weights, case, mask, allowed))


def _diagnose_heads(got, x_q, x_kv, weights, case, mask, allowed):
    """Which classic multi-head mistake reproduces the target's output?"""
    W = {n: w.to("cpu", torch.float64) for n, w in weights.items()}
    x_q, x_kv = x_q.to("cpu", torch.float64), x_kv.to("cpu", torch.float64)
    h, d = case.n_heads, case.d_model
    dh = d // h

    def run(split, merge, scale, out_proj=True):
        q, k, v = split(x_q @ W["W_Q"].T), split(x_kv @ W["W_K"].T), split(x_kv @ W["W_V"].T)
        heads, _ = reference.attention(q, k, v, mask, scale=scale)
        concat = merge(heads)
        return concat @ W["W_O"].T if out_proj else concat

    def good_split(t):
        return t.view(t.shape[0], h, dh).transpose(0, 1)

    def good_merge(t):
        return t.transpose(0, 1).reshape(-1, d)

    def view_split(t):
        return t.reshape(h, t.shape[0], dh)

    def view_merge(t):
        return t.reshape(-1, d)

    s = 1 / math.sqrt(dh)
    candidates = [
        ("heads are split with view and no transpose (tokens mixed across heads)", run(view_split, good_merge, s)),
        ("heads are merged with view and no transpose", run(good_split, view_merge, s)),
        ("heads are split and merged with view and no transpose", run(view_split, view_merge, s)),
        ("the scale uses d_model instead of the per-head d_k", run(good_split, good_merge, 1 / math.sqrt(d))),
        ("W_O is not applied to the concatenated heads", run(good_split, good_merge, s, out_proj=False)),
    ]
    for cause, candidate in candidates:
        if max_error(got, candidate) <= max(allowed, 1e-3):
            return cause
    return "the heads are not independent attentions over their own slices"


def _multihead_forms(X, W: dict, h: int):
    """(heads, Concat(heads) W_O^T, sum_i head_i W_O[:, block i]^T) with per-head projections."""
    import sympy as sp

    from attn_spec.symbolic import require, symbolic_attention

    d_head = X.shape[1] // h
    heads, projected = [], []
    for i in range(h):
        rows = slice(i * d_head, (i + 1) * d_head)  # head i's rows of each nn.Linear weight
        per_head = [X * W[n][rows, :].T for n in ("W_Q", "W_K", "W_V")]  # [T, d_head] each
        full = [(X * W[n].T)[:, rows] for n in ("W_Q", "W_K", "W_V")]  # split after projecting
        require(all(sp.expand(a - b) == sp.zeros(*a.shape) for a, b in zip(per_head, full)),
                "per-head projection != column block of the full projection")
        head = symbolic_attention(*per_head)[0]  # [T, d_head], scale 1/sqrt(d_head)
        heads.append(head)
        projected.append(head * W["W_O"][:, rows].T)  # head i through its block of W_O
    concat = sp.Matrix.hstack(*heads) * W["W_O"].T  # [T, d_model]
    return heads, concat, sum(projected, sp.zeros(*concat.shape))


@derivation("head-concat-equivalence")
def derive_head_concat_equivalence():
    """h heads with per-head projections, concatenated and mixed by W_O, equal the seed's split form."""
    import sympy as sp

    from attn_spec.symbolic import agreement, as_tensor, numbers, require

    names = ("W_Q", "W_K", "W_V", "W_O")
    # Numerically first, at d_head = 2 (where the per-head scale 1/sqrt(d_head) is not 1): the kit's reference.
    Xn = numbers(3, 4)
    Wn = {n: numbers(4, 4, i + 1) / 2 for i, n in enumerate(names)}
    ref = reference.multihead(as_tensor(Xn), as_tensor(Xn), *(as_tensor(Wn[n]) for n in names), 2)[0]
    concat_n = _multihead_forms(Xn, Wn, 2)[1]
    err = agreement(concat_n, ref, "multi-head output")
    # Symbolically at d_model = 2, h = 2.
    d_model, h, T = 2, 2, 2
    X = sp.Matrix(T, d_model, sp.symbols(f"x1:{T + 1}(1:{d_model + 1})", real=True))
    W = {n: sp.Matrix(d_model, d_model, sp.symbols(f"{n.lower()}1:{d_model + 1}(1:{d_model + 1})", real=True))
         for n in names}
    heads, concat, summed = _multihead_forms(X, W, h)
    require(sp.expand(concat - summed) == sp.zeros(T, d_model), "Concat(heads) W_O^T != sum_i head_i W_O,i^T")
    return [("head i projects with rows i*d_head:(i+1)*d_head of W_Q, W_K, W_V (= that column block of x W^T)",
             X * W["W_Q"][0:1, :].T),
            ("head 1 = attention(x W_Q1^T, x W_K1^T, x W_V1^T), scale 1/sqrt(d_head)", heads[0]),
            ("Concat(head_1, head_2) W_O^T - sum_i head_i W_O[:, block i]^T", sp.expand(concat - summed)),
            (f"the kit's reference.multihead agrees with the per-head form at d_model = 4, h = 2 "
             f"(max |difference| {float(err):.1g})", concat_n.evalf(6))]


@prop("matches-reference", family="values",
      statement="the output equals the float64 reference within the calibrated tolerance",
      after=("rows-sum-to-one", "scale-sqrt-dk", "causal-mask"), at_scale={"masks": ("none", "padding")},
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2), Case(n_q=3, n_kv=3, d_k=4, d_v=2, mask="random", seed=3),
                Case(batch=(2,), n_q=2, n_kv=2, d_k=3, d_v=3, values="normal", magnitude=3.0, seed=4),
                Case(batch=(2, 3), n_q=3, n_kv=4, d_k=2, d_v=3, mask="random", seed=5, layout="heads")],
      lesson=Lesson(unicode="|attn(Q, K, V) − ref₆₄(Q, K, V)| ≤ k·|naive − ref₆₄| + floor",
                    latex=r"\left|\mathrm{attn}(Q,K,V) - \mathrm{ref}_{64}(Q,K,V)\right| \le k\,\left|\mathrm{naive} - \mathrm{ref}_{64}\right| + \mathrm{floor}",
                    check="Compares the output with the float64 reference, elementwise, within a budget calibrated from "
                          "the error of two naive implementations in the same dtype (attn_spec.checking.tolerance).",
                    example="output"))
def matches_reference(target, case):
    """|attn(Q, K, V) - ref64(Q, K, V)| <= k * |naive - ref64| + floor, elementwise maximum.

    ref64 is the canonical formula in float64; naive is the same formula in the inputs'
    dtype (see attn_spec.checking.tolerance). Why: the structural properties can all hold while the
    values are still wrong. Catches: a wrong scale, wrong softmax axis, a mask ignored or
    inverted, float64 inputs computed in float32, precision lost in fp16 overflow.
    """
    q, k, v, mask = case.tensors()
    got = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    ref = row_reference(q, k, v, mask)  # the float64 reference (on chosen rows at long lengths: checking.rows)
    ref.check(got, what="the output against the float64 reference",
              call="attention(Q, K, V)" if mask is None else "attention(Q, K, V, mask)",
              cause=lambda: _mismatch(target, got, q, k, v, mask, ref.budget) or ignored_inputs(target, case))


def _mismatch(target, got, q, k, v, mask, allowed) -> str:
    """The convention's own misreadings first (a [B, S, H, D] kernel read transposed), then the classic mistakes."""
    got64 = got.detach().cpu().double()
    own = next((text for text, out in target.mistakes(q, k, v, mask) if max_error(got64, out) <= allowed), "")
    return own or diagnose_mismatch(got64, q, k, v, mask, allowed)
