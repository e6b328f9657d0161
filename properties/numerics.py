"""Numerics: linearity in V, softmax shift invariance, and large scores.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from attn_spec import reference
from attn_spec.checking import chunked
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.assertions import assert_close, assert_within, with_mask
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.properties.masking import push_limit, sink_levels, sunk_inputs
from attn_spec.targets.base import MULTIHEAD_CONVENTIONS
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.errors import Uninformative
from attn_spec.properties.informative import require_responsive

F64 = torch.float64



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

    def cause():
        doubled = target.attend(q, k, (2 * v1.double()).to(v1), mask)
        return ("the output does not scale with V: V is normalised or divided by its max before the weighted sum"
                if max_error(doubled, out1) <= allowed and max_error(doubled, 2 * ref1) > allowed
                else "V passes through a nonlinearity (an activation or normalisation) before the weighted sum")
    assert_close(out3, combined, budget=allowed, call=f"attention(Q, K, {a:g} V1 {b:+g} V2{with_mask(mask)})",
                 labels=(f"the output on {a:g} V1 {b:+g} V2", f"{a:g} (the output on V1) {b:+g} (the output on V2), "
                                                             f"the target's own outputs combined"),
                 what=f"attn(Q, K, {a:g} V1 {b:+g} V2) against {a:g} attn(Q, K, V1) {b:+g} attn(Q, K, V2)", cause=cause)
    vals = v1.double().cpu().unsqueeze(-3)  # [..., 1, Tk, Dv]
    keys = torch.tensor(True) if mask is None else mask.cpu().unsqueeze(-1)  # [..., Tq, Tk, 1] allowed keys
    lo = torch.where(keys, vals, math.inf).amin(dim=-2)  # [..., Tq, Dv]
    hi = torch.where(keys, vals, -math.inf).amax(dim=-2)  # [..., Tq, Dv]
    got = out1.double().cpu()
    outside = torch.maximum(lo - got, got - hi).nan_to_num(math.inf).max().item()
    assert_within(outside, one, what="how far an output lies outside the range of the allowed values",
                  call=f"attention(Q, K, V1{with_mask(mask)})", got=got, expected_tensor=ref1,
                  cause="the output is not a convex combination of the value rows (negative weights, or "
                        "weights that do not sum to 1?)")


def _not_shift_invariant(q, k, v, mask):
    """(description, output) for classic weightings that a key shift changes, in float64."""
    q, k, v = (t.to("cpu", F64) for t in (q, k, v))
    mask = None if mask is None else mask.cpu()

    def scores(keys):
        s = q @ keys.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [..., Tq, Tk]
        return s if mask is None else s.masked_fill(~mask, -math.inf)

    relu = scores(k).relu()
    yield "the weights are relu(scores) normalised by their sum, not a softmax", (relu / relu.sum(-1, keepdim=True)) @ v
    yield "the keys are L2-normalised (cosine similarity), which a shift changes", \
        torch.softmax(scores(F.normalize(k, dim=-1)), dim=-1) @ v
    s = scores(k)
    e = torch.exp(s - s.amax(dim=-2, keepdim=True))  # [..., Tq, Tk]
    yield "the max for a stable softmax is taken over the queries (dim=-2), not the keys", \
        (e / e.sum(-1, keepdim=True)) @ v


@prop("key-shift-invariance", family="softmax",
      statement="adding the same vector to every key leaves the output unchanged (softmax shift invariance)",
      after=("rows-sum-to-one", "scale-sqrt-dk"), cases={"min_n_kv": 2},
      at_scale="an identity of the formula that does not depend on the length: checked at the drawn sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, seed=1),
                Case(n_q=3, n_kv=2, d_k=3, d_v=1, dtype="float32", mask="random", seed=2)],
      lesson=Lesson(unicode="attn(Q, K + 𝟙cᵀ, V) = attn(Q, K, V),   softmax(s + t·𝟙) = softmax(s)",
                    latex=r"\mathrm{attn}(Q, K + \mathbf{1}c^\top, V) = \mathrm{attn}(Q, K, V),\qquad \mathrm{softmax}(s + t\mathbf{1}) = \mathrm{softmax}(s)",
                    check="Adds the same vector c to every key and compares the outputs within the budget.",
                    example="shift"))
def key_shift_invariance(target, case):
    """attn(Q, K + 1 c^T, V) = attn(Q, K, V) for any vector c.

    q_i . (k_j + c) = q_i . k_j + q_i . c: every score of row i moves by the same amount,
    and softmax(s + t) = softmax(s). Why: a softmax is defined up to that shift, which is
    what makes max-subtraction legal; an attention that is not shift invariant is not a
    softmax of the scores. Catches: relu or sum normalisation instead of exp, L2-normalised
    keys, a stabilising max taken over the wrong axis.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    gen = torch.Generator().manual_seed(case.seed + 2)
    sign = torch.randint(0, 2, (case.d_k,), generator=gen) * 2 - 1
    direction = (torch.randint(1, 3, (case.d_k,), generator=gen) * sign).double()  # [Dk], entries +-1 or +-2
    k64, q_sum = k.double(), q.double().abs().sum(dim=-1).max().item()
    room = push_limit(q.dtype) / (2 * max(q_sum, 1.0))  # the shift moves a raw score by at most push_limit
    size = min(2 * max(1.0, k64.abs().max().item()), room)
    shifted = (k64 + size * direction.to(k64.device)).to(k.dtype)  # [..., Tk, Dk]
    moves = (q.double() @ direction.to(q.device)).abs()  # [..., Tq] how far the shift moves each row's scores
    keys = torch.ones(case.n_q, case.n_kv, dtype=torch.bool) if mask is None else mask.cpu()
    if not ((moves.cpu() > 0) & (keys.sum(dim=-1) >= 2)).any():
        raise Uninformative("the shift moves the scores of no query that has two keys to weigh")
    ref, ref_shifted = reference.attention(q, k, v, mask)[0], reference.attention(q, shifted, v, mask)[0]
    allowed = budget(q, k, v, mask, ref) + budget(q, shifted, v, mask, ref_shifted) + max_error(ref_shifted, ref)
    before, after = target.attend(q, k, v, mask), target.attend(q, shifted, v, mask)  # [..., Tq, Dv]
    assert_close(after, before, budget=allowed, call=f"attention(Q, K + c, V{with_mask(mask)})",
                 labels=("the output on K + c", "the target's own output on K, before the shift"),
                 what=f"the output after adding c = {size:.3g} * {direction.tolist()} to every key",
                 cause=lambda: _shift_cause(before, after, q, k, shifted, v, mask, allowed))


def _shift_cause(before, after, q, k, shifted, v, mask, allowed) -> str:
    """The classic weighting that reproduces the target's outputs before and after the shift."""
    def reproduces(got, out):  # NaN where the mistake gives NaN counts as reproduced
        limit = max(allowed, 1e-3 * max(1.0, out.nan_to_num(0.0).abs().max().item()))
        return max_error(got.nan_to_num(0.0), out.nan_to_num(0.0)) <= limit

    for (cause, out), (_, out_shifted) in zip(_not_shift_invariant(q, k, v, mask),
                                              _not_shift_invariant(q, shifted, v, mask)):
        if reproduces(before, out) and reproduces(after, out_shifted):
            return cause
    if torch.isfinite(before).all() and not torch.isfinite(after).all():
        return "shifted scores overflow exp: subtract each row's max before exp"
    return "the weights are not a softmax of the scores (a shift of every score in a row changes them)"


@derivation("key-shift-invariance")
def derive_key_shift_invariance():
    """Adding c to every key adds the same t = scale * q.c to each score of a row; softmax ignores it."""
    import sympy as sp

    from attn_spec.symbolic import reference_weights_agree, require, softmax_row, symbolic_attention

    q, K, V = sp.Matrix([sp.symbols("q1:3", real=True)]), sp.Matrix(2, 2, sp.symbols("k1:3(1:3)", real=True)), \
        sp.Matrix(2, 1, sp.symbols("v1:3", real=True))
    c = sp.Matrix([sp.symbols("c1:3", real=True)])
    tie = reference_weights_agree()
    shifted = K + sp.ones(K.rows, 1) * c  # k_j + c for every key j
    _, A, S = symbolic_attention(q, K, V)
    _, A2, S2 = symbolic_attention(q, shifted, V)
    moves = sp.expand(S2 - S)  # [1, Tk]
    require(all(sp.expand(x - moves[0]) == 0 for x in moves), "keys shifted by c move the scores unequally")
    s, t = sp.symbols("s1:4", real=True), sp.Symbol("t", real=True)
    diff = sp.simplify(softmax_row([x + t for x in s]) - softmax_row(s))
    require(diff == sp.zeros(1, 3), "softmax(s + t) != softmax(s)")
    require(sp.simplify(A2 - A) == sp.zeros(*A.shape), "the weights change when keys are shifted")
    return [("keys shifted by the same vector c: scores move by", moves),
            ("the same t for every key of the row: exp(s_j + t) = e^t exp(s_j), and e^t cancels",
             diff),
            ("so the weights of the shifted keys equal the original ones", sp.simplify(A2 - A)),
            tie]


def _unstable_softmaxes(q, k, v, mask):
    """(description, output) for the classic unstable softmaxes, in the inputs' dtype."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [..., Tq, Tk]
    s = s if mask is None else s.masked_fill(~mask, -math.inf)
    for description, shift in (("exp overflows or underflows to 0/0 on large scores: subtract each row's max "
                                "before exp", 0.0),
                               ("the max is taken over more than the row (x.max() without dim=-1?): rows with "
                                "smaller scores underflow to 0/0", s.max())):
        e = torch.exp(s - shift)
        yield description, (e / e.sum(dim=-1, keepdim=True)) @ v


def beyond_exp(dtype: torch.dtype) -> float:
    """A score 4x beyond where exp overflows in ``dtype`` (log of its largest value)."""
    return 4 * math.log(torch.finfo(dtype).max)


@prop("numerical-stability", family="numerics",
      statement="large-magnitude scores (far beyond exp's range in the dtype) and rows of very different "
                "magnitude give finite outputs that match the reference",
      after=("rows-sum-to-one", "scale-sqrt-dk", "causal-mask", "mask-semantics", "matches-reference"),
      at_scale={"masks": ("none",)},
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, dtype="float32", seed=0),
                Case(n_q=2, n_kv=3, d_k=2, d_v=2, dtype="float16", seed=1),
                Case(n_q=3, n_kv=2, d_k=2, d_v=1, seed=2),
                Case(n_q=3, n_kv=3, d_k=2, d_v=2, dtype="float16", mask="causal", seed=3)],
      lesson=Lesson(unicode="softmax(s)ⱼ = exp(sⱼ − maxₖ sₖ) / Σₗ exp(sₗ − maxₖ sₖ)   finite for |s| ≫ log(finfo.max)",
                    latex=r"\mathrm{softmax}(s)_j = \frac{e^{s_j - \max_k s_k}}{\sum_l e^{s_l - \max_k s_k}}\ \text{finite for}\ |s| \gg \log(\mathrm{finfo.max})",
                    check="Scales some query rows so their largest score is far beyond exp's range in the dtype and compares "
                          "with the float64 reference, which subtracts the row max.",
                    example="stability"))
def numerical_stability(target, case):
    """With even query rows scaled (or negated) so that their largest allowed score is
    +4 log(finfo.max) (44 in float16, 355 in float32, 2839 in float64) and odd rows left as
    they are, attn matches the float64 reference within budget, with no NaN or inf. Q K^T
    stays representable. Then inputs whose every score is the same very negative number (-1e6 / sqrt(d_k);
    float16: -181 / sqrt(d_k)): each row's output is the mean of its allowed V.

    The second part catches a mask that *replaces* masked scores by a finite fill (-1e4 in older
    Hugging Face models) in float32: allowed scores below the fill hand the weight to the masked keys
    (mask-semantics reads those weights in every dtype, down to -1e8).

    softmax(s) = exp(s - max_j s_j) / sum_j exp(s_j - max_j s_j) is exact in any range; exp(s)
    alone overflows past log(finfo.max). Why: trained models do produce such scores (large
    activations, long contexts, float16), and one NaN spreads to the whole batch through the
    backward pass. Catches: exp without subtracting the row max, a max over the whole
    tensor (x.max() without dim), scores clamped "for safety".
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    row_peak = chunked.row_peaks(q, k, mask).to(q.device)  # [..., Tq] signed, among allowed keys
    cap = push_limit(q.dtype) / q.double().abs().amax(dim=-1).clamp_min(1.0)  # keeps Q representable
    gain = (beyond_exp(q.dtype) / row_peak).clamp(-cap, cap)  # the peak becomes +4 log(finfo.max)
    even = (torch.arange(case.n_q, device=q.device) % 2 == 0).expand(row_peak.shape)  # [..., Tq]
    gain = torch.where(even & (row_peak != 0), gain, torch.ones_like(gain))  # [..., Tq]
    loud = (q.double() * gain.unsqueeze(-1)).to(q.dtype)  # [..., Tq, Dk]
    got = target.attend(loud, k, v, mask)  # [..., Tq, Dv]
    ref = row_reference(loud, k, v, mask)  # on chosen rows at long lengths (checking.rows)

    def cause():
        bad = ~torch.isfinite(got).all(dim=-1)  # [..., Tq] rows with NaN or inf
        unstable = _unstable_softmaxes(loud, k, v, mask) if chunked.fits(q, k, v, mask) else ()  # [Tq, Tk] each
        return next((d for d, out in unstable
                     if bad.any() and torch.equal(~torch.isfinite(out).all(dim=-1), bad)),
                    "large scores are clipped or lose precision (a clamp on the scores, or a narrower type inside?)"
                    if not bad.any() else "NaN or inf in rows with large scores")
    ref.check(got, call=f"attention(Q', K, V{with_mask(mask)}), Q' = Q with some rows scaled",
              inputs={"Q'": loud, "K": k, "V": v, "mask": mask},
              what=f"the output with scores up to {beyond_exp(q.dtype):.3g} in some rows against the float64 "
                   f"reference", cause=cause)
    if chunked.fits(q, k, v, mask):  # a second call of the same size; at fixed large shapes, the first alone
        _check_sunk_rows(target, q, k, v, mask)


def _check_sunk_rows(target, q, k, v, mask):
    """Rows whose every score is the same very negative number (the lower of sink_levels): each row's output is
    the mean of its allowed values."""
    runs = []
    # The lower level only: at -1e8 a correct exp(s - logsumexp(s)) in float32 cannot hold log(n_kv) beside s
    # (mask-semantics reads the masked weights there, which stay exactly 0).
    for level in sink_levels(q.dtype, target.convention in MULTIHEAD_CONVENTIONS)[1:]:
        q2, k2 = sunk_inputs(q, k, level)
        runs.append((level, q2, k2, target.attend(q2, k2, v, mask)))  # [..., Tq, Dv]
    for level, q2, k2, got in runs:
        expected = reference.attention(q2, k2, v, mask)[0]
        allowed = budget(q2, k2, v, mask, expected)

        def cause(got=got, q2=q2, k2=k2, allowed=allowed):
            if not torch.isfinite(got).all():
                return "exp underflows to 0/0 on very negative scores: subtract each row's max before exp"
            if mask is not None and max_error(got, reference.attention(q2, k2, v, ~mask)[0]) <= max(allowed, 1e-3):
                return ("masked scores are replaced by a finite fill (masked_fill(~mask, -1e4) or -1e9) that lies "
                        "above the allowed scores: the masked keys take the weight (fill with -inf or finfo(dtype).min)")
            return "very negative scores lose the row's weights (a clamp on the scores, or a finite fill above them?)"
        assert_close(got, expected, budget=allowed, call=f"attention(Q', K', V{with_mask(mask)}), q_i = a e_0, k_j = -a e_0",
                     inputs={"Q'": q2, "K'": k2, "V": v, "mask": mask},
                     what=f"the output when every score is {-level / math.sqrt(q.shape[-1]):.3g} against the float64 "
                          f"reference", cause=cause)
