"""The numerics family: large scores stay finite and right.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import chunked
from attn_spec.checking.assertions import assert_close, with_mask
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.tolerance import budget
from attn_spec.failures import because
from attn_spec.targets.base import MULTIHEAD_CONVENTIONS
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import push_limit, sink_levels, sunk_inputs




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
    stays representable. Then inputs whose every score is the same very negative number (-256 / sqrt(d_k);
    float16: -181 / sqrt(d_k)): each row's output is the mean of its allowed V.

    The second part catches exp underflowing to 0/0 on such rows (exp without the max, in float32 and
    float16); a finite fill that replaces masked scores is mask-semantics' to judge, which reads the
    weights down to the edge of the scores attention reaches (-65504, inputs.SCORE_RANGE).

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
    ref.check(got, call=f"attention(Q', K, V{with_mask(mask)}), Q' = Q with some rows scaled",
              inputs={"Q'": loud, "K": k, "V": v, "mask": mask},
              what=f"the output with scores up to {beyond_exp(q.dtype):.3g} in some rows against the float64 "
                   f"reference", cause=because("large-scores", got=got, q=loud, k=k, v=v, mask=mask))
    if chunked.fits(q, k, v, mask):  # a second call of the same size; at fixed large shapes, the first alone
        _check_sunk_rows(target, q, k, v, mask)


def _check_sunk_rows(target, q, k, v, mask):
    """Rows whose every score is the same very negative number (the lower of sink_levels): each row's output is
    the mean of its allowed values."""
    runs = []
    # The lower level only: at -65504 a correct exp(s - logsumexp(s)) in float32 holds log(n_kv) beside s to a few
    # ulps of s only (mask-semantics reads the masked weights there, which stay exactly 0).
    for level in sink_levels(q.dtype, target.convention in MULTIHEAD_CONVENTIONS)[1:]:
        q2, k2 = sunk_inputs(q, k, level)
        runs.append((level, q2, k2, target.attend(q2, k2, v, mask)))  # [..., Tq, Dv]
    for level, q2, k2, got in runs:
        expected = reference.attention(q2, k2, v, mask)[0]
        allowed = budget(q2, k2, v, mask, expected)
        assert_close(got, expected, budget=allowed, call=f"attention(Q', K', V{with_mask(mask)}), q_i = a e_0, k_j = -a e_0",
                     inputs={"Q'": q2, "K'": k2, "V": v, "mask": mask},
                     what=f"the output when every score is {-level / math.sqrt(q.shape[-1]):.3g} against the float64 "
                          f"reference", cause=because("sunk-rows", got=got, q=q2, k=k2, v=v, mask=mask,
                                                      allowed=allowed))
