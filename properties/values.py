"""The values family: the output against the float64 reference, and linearity in V.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import assert_close, assert_within, with_mask
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.failures import because
from attn_spec.properties.informative import require_responsive

F64 = torch.float64


@prop("matches-reference", family="values",
      statement="the output equals the float64 reference within the calibrated tolerance",
      after=("rows-sum-to-one", "scale-sqrt-dk", "causal-mask"), at_scale={"masks": ("none", "padding")},
      # Run first in a check (runner.RUN_FIRST), in the order of how many of the gallery's bugs each catches
      # (of 118: heads 44, masked 42, plain 33, batched 30); a failing one is shrunk (checking.shrink).
      examples=[Case(batch=(2, 3), n_q=3, n_kv=4, d_k=2, d_v=3, mask="random", seed=5, layout="heads"),
                Case(n_q=3, n_kv=3, d_k=4, d_v=2, mask="random", seed=3), Case(n_q=2, n_kv=3, d_k=2, d_v=2),
                Case(batch=(2,), n_q=2, n_kv=2, d_k=3, d_v=3, values="normal", magnitude=3.0, seed=4)],
      # At the default and thorough profiles: scores of about 36 standard deviations, far beyond exp's float32 range
      # (a max subtraction skipped above some length overflows), and judged on rows drawn after the call (rows.py)
      long_examples=[Case(n_q=1531, n_kv=1531, d_k=64, d_v=64, dtype="float32", values="normal", magnitude=6.0,
                          seed=33)],
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
    got = target.attend(*case.tensors())  # [..., Tq, Dv]
    q, k, v, mask = case.tensors()  # drawn again: what the target wrote into its inputs cannot move the reference
    ref = row_reference(q, k, v, mask)  # the float64 reference (on chosen rows at long lengths: checking.rows)
    ref.check(got, what="the output against the float64 reference",
              call="attention(Q, K, V)" if mask is None else "attention(Q, K, V, mask)",
              cause=because("output-differs", target=target, got=got, q=q, k=k, v=v, mask=mask, budget=ref.budget,
                            case=case))



def _second_values(case, like):
    """Another V of the same shape, drawn like the case's own (small integers or normal)."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    if case.values == "integers":
        v = torch.randint(-2, 3, like.shape, generator=gen).double()
    else:
        v = torch.randn(like.shape, generator=gen, dtype=F64)
    return (v * case.magnitude).to(like)


@prop("value-linearity", family="values",
      statement="the output is linear in V and each output row lies in the convex hull of the rows of V",
      after=("rows-sum-to-one",),
      at_scale="an identity of the formula that does not depend on the length: checked at the drawn sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, seed=1),
                Case(batch=(2,), n_q=3, n_kv=3, d_k=2, d_v=3, values="normal", magnitude=3.0, mask="random", seed=2)],
      lesson=Lesson(unicode="attn(Q, K, aV₁ + bV₂) = a·attn(Q, K, V₁) + b·attn(Q, K, V₂),   minⱼ Vⱼ ≤ outᵢ ≤ maxⱼ Vⱼ",
                    latex=r"\mathrm{attn}(Q,K,aV_1+bV_2) = a\,\mathrm{attn}(Q,K,V_1) + b\,\mathrm{attn}(Q,K,V_2),\quad \min_j V_j \le \mathrm{out}_i \le \max_j V_j",
                    check="Calls the target with V₁, V₂ and a·V₁ + b·V₂ and compares; checks each output lies between the "
                          "smallest and largest allowed value.",
                    example="linearity"))
def value_linearity(target, case):
    """attn(Q, K, a V1 + b V2) = a attn(Q, K, V1) + b attn(Q, K, V2), and
    min_j V[j, c] <= out[i, c] <= max_j V[j, c] over the keys j that query i may attend.

    The weights depend on Q and K only; the output is a weighted *average* of value rows.
    Why: the probes that read weights (V = identity, V = ones) are only valid if V enters
    linearly, and a model relies on outputs staying on V's scale. Catches: V normalised
    (QK-norm applied to V too), V divided by its max and never scaled back, an activation
    applied to V, weights that are not a convex combination.
    """
    require_responsive(target, case)
    q, k, v1, mask = case.tensors()
    v2 = _second_values(case, v1)
    a, b = 2.0, -1.0
    exact = a * v1.double() + b * v2.double()  # [..., Tk, Dv]
    v3 = exact.to(v1)
    out1, out2, out3 = (target.attend(q, k, v, mask) for v in (v1, v2, v3))  # [..., Tq, Dv] each
    wide = torch.cat([v1, v2, v3], dim=-1)  # [..., Tk, 3 Dv]: one reference and one budget cover all three
    ref = reference.attention(q, k, wide, mask)[0]
    one = budget(q, k, wide, mask, ref)  # each output's own budget is at most this
    ref1 = ref[..., :case.d_v]  # [..., Tq, Dv]
    allowed = (abs(a) + abs(b) + 1) * one + max_error(v3, exact)
    combined = a * out1.double().cpu() + b * out2.double().cpu()
    assert_close(out3, combined, budget=allowed, call=f"attention(Q, K, {a:g} V1 {b:+g} V2{with_mask(mask)})",
                 labels=(f"the output on {a:g} V1 {b:+g} V2", f"{a:g} (the output on V1) {b:+g} (the output on V2), "
                                                             f"the target's own outputs combined"),
                 what=f"attn(Q, K, {a:g} V1 {b:+g} V2) against {a:g} attn(Q, K, V1) {b:+g} attn(Q, K, V2)",
                 cause=because("values-nonlinear", target=target, q=q, k=k, v1=v1, mask=mask, out1=out1, ref1=ref1,
                               allowed=allowed))
    vals = v1.double().cpu().unsqueeze(-3)  # [..., 1, Tk, Dv]
    keys = torch.tensor(True) if mask is None else mask.cpu().unsqueeze(-1)  # [..., Tq, Tk, 1] allowed keys
    lo = torch.where(keys, vals, math.inf).amin(dim=-2)  # [..., Tq, Dv]
    hi = torch.where(keys, vals, -math.inf).amax(dim=-2)  # [..., Tq, Dv]
    got = out1.double().cpu()
    outside = torch.maximum(lo - got, got - hi).nan_to_num(math.inf).max().item()
    assert_within(outside, one, what="how far an output lies outside the range of the allowed values",
                  call=f"attention(Q, K, V1{with_mask(mask)})", got=got, expected_tensor=ref1,
                  cause=because("not-convex"))
