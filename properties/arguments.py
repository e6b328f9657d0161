"""Properties of the keyword arguments some attentions take: ``scale`` and ``is_causal`` (the sdpa convention).

A target that does not take an argument skips the property with that reason.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.properties.informative import require_responsive
from attn_spec.targets.behaviours import behaviour

F64 = torch.float64

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

    def cause():
        default, _ = reference.attention(q, k, v, mask)
        both, _ = reference.attention(q, k, v, mask, scale=s / math.sqrt(case.d_k))
        return ("the scale argument is ignored (the default 1/sqrt(d_k) is used)"
                if max_error(got, default) <= allowed
                else "the default 1/sqrt(d_k) is applied on top of the given scale"
                if max_error(got, both) <= allowed
                else "a negative scale breaks the computation (sqrt(scale) split between Q and K?)"
                if s < 0 else "the given scale is not applied to Q K^T as a single factor")
    assert_close(got, expected, budget=allowed, what=f"the output with scale={s:.4g} against the float64 reference",
                 call=f"attention(Q, K, V{', mask' if mask is not None else ''}, scale={s:.4g})", cause=cause)


@prop("is-causal", family="masking",
      statement="is_causal=True equals a causal mask (top-left or bottom-right aligned, reported when n_q != n_kv)",
      cases={"masks": ("none",)}, after=("causal-mask", "matches-reference"), at_scale={"masks": ("none",)},
      examples=[Case(n_q=3, n_kv=3, d_k=2, d_v=2), Case(n_q=2, n_kv=4, d_k=2, d_v=1, seed=1),
                Case(n_q=4, n_kv=1, d_k=2, d_v=2, seed=2), Case(n_q=5, n_kv=3, d_k=2, d_v=1, seed=3),
                # FlashAttention's own tests force rows without keys (bottom-right): (seqlen_q, seqlen_k) =
                # (239, 1) and (799, 3)
                Case(n_q=239, n_kv=1, d_k=2, d_v=2, seed=4), Case(n_q=799, n_kv=3, d_k=3, d_v=2, seed=5)],
      lesson=Lesson(unicode="attn(Q, K, V, is_causal=True) = attn(Q, K, V, mask = [j ≤ i + offset])",
                    latex=r"\mathrm{attn}(Q,K,V,\mathrm{is\_causal}) = \mathrm{attn}(Q,K,V,\mathrm{mask}=[j \le i + \mathrm{offset}])",
                    why="A flag is how fused kernels are told to be causal without a mask tensor; if it is ignored or "
                        "built for square shapes only, a decoder silently sees the future.",
                    check="Calls the target with is_causal=True and compares with an explicit top-left and bottom-right "
                          "causal mask; which one matches is reported as a convention.",
                    example="causal"))
def is_causal(target, case):
    """attn(Q, K, V, is_causal=True) = attn(Q, K, V, mask = [j <= i + offset]).

    offset = 0 (top-left, PyTorch's ``is_causal``) or n_kv - n_q (bottom-right, FlashAttention
    >= 2.1, KV-cache decoding); for square inputs both are the usual lower triangle. Which one
    a target uses is a convention, reported in the header; either passes here. Bottom-right with
    n_q > n_kv leaves the first n_q - n_kv queries without any key: those are fully masked rows,
    judged by the target's probed ``fully-masked`` behaviour (NaN, zeros or the mean of V, as
    with a mask; any of the three where it could not be probed), not by the reference's zeros.
    Catches: the flag ignored, an off-by-one triangle (the diagonal masked: rows that should
    see keys come out empty), a triangle built for square shapes only.
    """
    q, k, v, _ = case.tensors()
    got = target.attend(q, k, v, None, is_causal=True)  # [..., Tq, Dv]
    require_responsive(target, case)
    accepted = _empty_row_values(target, case)
    candidates = {}  # alignment -> (error on the rows with keys, what the rows without keys are if off, budget, reference)
    for alignment in ("top-left", "bottom-right"):
        if case.n_q == case.n_kv and candidates:  # square: the same triangle
            candidates[alignment] = candidates["top-left"]
            continue
        ref = row_reference(q, k, v, causal=True, causal_alignment=alignment)  # no [Tq, Tk] mask
        empty = ~reference.causal_mask(case.n_q, case.n_kv, alignment=alignment).any(dim=-1)  # [Tq] rows without keys
        odd = _odd_empty_rows(got, v, empty, accepted)
        seen = got if odd is not None or not empty.any() else got.masked_fill(  # conventional empty rows: the
            empty.to(got.device)[:, None], 0.0)  # reference's zeros, so only the rows with keys are judged
        candidates[alignment] = (ref, seen, odd)
    if any(ref.holds(seen) for ref, seen, _ in candidates.values()):
        return
    ref, seen, _ = candidates["top-left"]
    right, right_seen, odd = candidates["bottom-right"]
    cause = ("is_causal is ignored" if row_reference(q, k, v).error(got) <= ref.budget
             else f"the rows without keys (bottom-right: the first {case.n_q - case.n_kv} queries) give {odd}, "
                  f"where the target's fully masked rows give {' or '.join(accepted)} (fully-masked)"
             if odd is not None and right.holds(got.masked_fill(
                 (~reference.causal_mask(case.n_q, case.n_kv, alignment="bottom-right").any(dim=-1)).to(got.device)[:, None],
                 0.0))
             else "the causal triangle is off by one or misaligned")
    if ref.why is not None:  # a long case: the top-left triangle's own judgement, which names the row
        ref.check(got, what="the output against the float64 reference under a top-left causal mask (the "
                  "bottom-right one does not match either)", call="attention(Q, K, V, is_causal=True)", cause=cause)
    worst = {"top-left": ref.error(seen), "bottom-right": math.inf if odd is not None else right.error(right_seen)}
    fail(f"max error {worst['top-left']:.3g} (top-left) and {worst['bottom-right']:.3g} (bottom-right)",
         what="the output against the reference under either causal alignment", budget=ref.budget,
         call="attention(Q, K, V, is_causal=True)", cause=cause, got=got, expected_tensor=ref.exact)


def _empty_row_values(target, case) -> tuple[str, ...]:
    """What a row without keys may be for this target: its probed ``fully-masked`` behaviour, or any
    of the three conventions where the probe could not tell (``n/a``, ``other``, ``raises``)."""
    found = behaviour(target, "fully-masked", case.dtype, case.device)
    return (found,) if found in ("nan", "zeros", "uniform") else ("nan", "zeros", "uniform")


def _odd_empty_rows(got, v, empty, accepted) -> str | None:
    """None when every row in ``empty`` [Tq] of ``got`` [..., Tq, Dv] is one of ``accepted``; else what they are."""
    if not empty.any():
        return None
    rows = got.detach().to("cpu", F64)[..., empty, :]  # [..., E, Dv]
    mean = v.detach().to("cpu", F64).mean(dim=-2, keepdim=True)  # [..., 1, Dv] uniform weights over every key
    tests = {"nan": torch.isnan(rows).all(dim=-1), "zeros": (rows == 0).all(dim=-1),
             "uniform": torch.isclose(rows, mean.expand_as(rows), rtol=1e-2, atol=1e-2).all(dim=-1)}
    if any(tests[name].all() for name in accepted):
        return None
    return next((name for name, ok in tests.items() if ok.all()), "other values")
