"""The scale family: scores scaled by 1/sqrt(d_k), and a ``scale`` argument honoured (the sdpa convention).

A target that does not take the argument skips ``scale-argument`` with that reason. Each function's
docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import probes
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.cases import DTYPES, Case, MhaCase
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.checking.tolerance import budget
from attn_spec.failures import because
from attn_spec.properties.informative import require_responsive


_SCALE_EXAMPLES = [MhaCase(n_q=1, n_kv=2, d_model=16, n_heads=2), Case(n_q=1, n_kv=2, d_k=16, d_v=1)]


@prop("scale-sqrt-dk", family="scale",
      statement="scores are scaled by exactly 1/sqrt(d_k)",
      cases={"dtypes": ("float64", "float32")}, multihead="module", examples=_SCALE_EXAMPLES,
      at_scale={"masks": ("none",)}, projections="identity",
      lesson=Lesson(unicode="scores = Q Kᵀ · 1/√d_k",
                    latex=r"S = \frac{QK^\top}{\sqrt{d_k}}",
                    check="One query e₀ and two keys 0 and √d_k·e₀: raw score gap √d_k, so the weight on the second key "
                          "is σ(s·√d_k); V = [[0], [1]] reads it and s = logit(w)/√d_k is the scale applied.",
                    example="scale"))
def scale_sqrt_dk(target, case):
    """softmax(Q K^T / sqrt(d_k)): the scale recovered from two keys with a known score gap.

    Why: with unit-variance entries, q . k has variance d_k; dividing by sqrt(d_k) keeps the
    softmax out of saturation at every width, so gradients do not vanish. Catches: a missing
    scale, 1/d_k, sqrt(d_model) for a per-head d_k, a scale applied twice, a hard-coded d_k.
    """
    require_responsive(target, case)
    dtype, tol = (torch.float64, 1e-6) if case.dtype == "float64" else (torch.float32, 1e-3) \
        if case.dtype == "float32" else (DTYPES[case.dtype], 16 * torch.finfo(DTYPES[case.dtype]).eps)  # its own dtype
    if isinstance(case, MhaCase):
        d_k, n_heads = case.d_model // case.n_heads, case.n_heads
        found = probes.scale_module(target, d_k, n_heads, dtype, case.device)

        def at(width):  # the scale of the first head, at another head width
            return probes.scale_module(target, width, n_heads, dtype, case.device)[0]
    else:
        d_k, n_heads = case.d_k, 1
        found = [probes.scale_function(target, d_k, dtype, case.device)]

        def at(width):
            return probes.scale_function(target, width, dtype, case.device)
    expected = 1 / math.sqrt(d_k)
    for s in found:
        if not math.isclose(s, expected, rel_tol=tol):
            other = 4 * d_k if d_k <= 64 else d_k // 4  # a second width reveals the law c * d_k^p
            law = {d_k: s, other: at(other)}
            name = probes.name_scale(law, n_heads)
            gap = math.sqrt(d_k)  # raw score gap between the probe's two keys
            got, want = torch.sigmoid(torch.tensor(s * gap, dtype=torch.float64)), torch.sigmoid(torch.tensor(1.0))
            fail(f"{s:.4g} at d_k={d_k} and {law[other]:.4g} at d_k={other}: {name}",
                 what="the recovered scale (read from the weights shown)",
                 expected=f"{expected:.4g} = 1/sqrt(d_k) at d_k={d_k}", budget=f"relative {tol:g}",
                 call="forward(x, x), x = [(1 - sqrt(d_k)) e_0, e_0] in each head, identity projections; token 1 read"
                 if isinstance(case, MhaCase) else "attention(Q = [e_0, e_0], K = [0, sqrt(d_k) e_0], V = [[0], [1]]); "
                                                   "query 1 read",
                 cause=because("scale-named", name=name),
                 got=torch.stack([1 - got, got])[None], expected_tensor=torch.stack([1 - want, want])[None],
                 labels=(f"the probe's weights on its two keys at d_k={d_k}", "the weights at scale 1/sqrt(d_k)"),
                 inputs={"x": probes.scale_module_input(d_k, n_heads, dtype)} if isinstance(case, MhaCase) else
                 dict(zip(("q", "K", "V"), probes.scale_function_inputs(d_k, dtype))))


@derivation("scale-sqrt-dk")
def derive_scale_sqrt_dk():
    """Var(q.k) = d_k for independent zero-mean unit-variance entries, so the scale is 1/sqrt(d_k)."""
    import sympy as sp

    from attn_spec.symbolic import agreement, canonical_scale, expectation, require

    d_k, i, c = sp.Symbol("d_k", positive=True, integer=True), sp.Symbol("i", integer=True), sp.Symbol("c", positive=True)
    second_moments = []
    for d in range(1, 7):  # the collapse of the double sum, checked dimension by dimension
        q, k = sp.symbols(f"q1:{d + 1}"), sp.symbols(f"k1:{d + 1}")
        dot = sum(a * b for a, b in zip(q, k))
        require(expectation(dot, q + k) == 0, f"E[q.k] != 0 at d_k={d}")
        second_moments.append(expectation(dot**2, q + k))
        require(second_moments[-1] == d, f"E[(q.k)^2] != d_k at d_k={d}")
    variance = sp.Sum(1, (i, 1, d_k)).doit()  # sum_i E[q_i^2] E[k_i^2]
    solved = sp.solve(sp.Eq(c**2 * variance, 1), c)
    require(solved == [canonical_scale(d_k)], f"Var(c q.k) = 1 solves to {solved}, not the canonical scale")
    rows = []
    for d in (4, 16):  # the reference applies that scale: probe with keys 0 and sqrt(d) e_0
        q = torch.zeros(1, d, dtype=torch.float64)
        q[0, 0] = 1
        k = torch.zeros(2, d, dtype=torch.float64)
        k[1, 0] = math.sqrt(d)
        w = reference.attention(q, k, torch.eye(2, dtype=torch.float64))[1]  # [1, 2]
        expected = 1 / (1 + sp.exp(-solved[0].subs(d_k, d) * sp.sqrt(d)))  # sigmoid(c * gap)
        agreement(sp.Matrix([[1 - expected, expected]]), w, f"scale at d_k={d}")
        rows.append(w[0, 1].item())
    return [("E[q.k] = sum_i E[q_i] E[k_i] = 0 (independence, zero mean)", sp.Integer(0)),
            ("E[(q.k)^2] = sum_i sum_j E[q_i q_j] E[k_i k_j]; only i = j survives, E[q_i^2] E[k_i^2] = 1",
             sp.Eq(sp.Symbol("Var(q.k)"), variance)),
            ("checked term by term by expanding (q.k)^2: E[(q.k)^2] for d_k = 1..6", sp.Tuple(*second_moments)),
            ("the scaled score c q.k has variance c^2 d_k; unit variance needs", sp.Eq(c, solved[0])),
            (f"the kit's reference applies it: weight on the key with raw gap sqrt(d_k) is sigmoid(1) "
             f"({rows[0]:.6f} at d_k=4 and 16)", sp.Eq(sp.Symbol("w"), 1 / (1 + sp.exp(-1))))]


SCALES = (0.5, -0.7, 2.0, None)  # None stands for 1/d_k: the "l1" scale PyTorch's tests use


@prop("scale-argument", family="scale",
      statement="an explicit scale s gives softmax(s * Q K^T) V, for any float s including negative ones",
      cases={"masks": ("none", "random")}, after=("matches-reference",),
      at_scale="how a scale argument is applied does not depend on the length: checked at the drawn sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=4, d_v=2, seed=1), Case(n_q=2, n_kv=2, d_k=2, d_v=2, seed=2)],
      lesson=Lesson(unicode="attn(Q, K, V, scale=s) = softmax(s · Q Kᵀ) V",
                    latex=r"\mathrm{attn}(Q,K,V,\mathrm{scale}=s) = \mathrm{softmax}(s\,QK^\top)\,V",
                    check="Passes explicit scales (including negative ones) and compares with the reference at that scale.",
                    example="scale-arg"))
def scale_argument(target, case):
    """attn(Q, K, V, scale=s) = softmax(s Q K^T) V; the default 1/sqrt(d_k) applies only when s is None.

    Why: models with their own scaling (muP, scaled-by-layer GPT-2, MLA) pass ``scale``, and
    a kernel that ignores it trains a different model without any error. Catches: the
    argument ignored, scale applied on top of the default, sqrt(s) split between Q and K
    (NaN for s < 0), a scale of 0 or None taken literally.
    """
    q, k, v, mask = case.tensors()
    s = SCALES[case.seed % len(SCALES)] or 1.0 / case.d_k
    got = target.attend(q, k, v, mask, scale=s)  # [..., Tq, Dv]
    require_responsive(target, case)
    expected, _ = reference.attention(q, k, v, mask, scale=s)  # [..., Tq, Dv]
    allowed = budget(q, k, v, mask, expected, scale=s)

    assert_close(got, expected, budget=allowed, what=f"the output with scale={s:.4g} against the float64 reference",
                 call=f"attention(Q, K, V{', mask' if mask is not None else ''}, scale={s:.4g})",
                 cause=because("scale-argument", got=got, q=q, k=k, v=v, mask=mask, scale=s, allowed=allowed))
