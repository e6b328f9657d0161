"""The scores family: logit soft-capping, cap * tanh(scores / cap), where a target takes ``softcap``.

It runs where a target takes it (the hf convention, FlexAttention, an sdpa-style target with a
``softcap`` parameter); elsewhere it is a skip with the reason. Each function's docstring states the
math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

from attn_spec import reference
from attn_spec.checking.assertions import fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.probes import WEIGHT_LABELS, weights
from attn_spec.checking.tolerance import max_error, softcap_budget
from attn_spec.failures import because

CAPS = (1.0, 5.0, 20.0, 50.0)  # picked by the case's seed; 50 is Gemma 2's attention cap


@prop("softcap", family="scores",
      statement="logit soft-capping: each scaled score s becomes cap * tanh(s / cap) before the mask and the softmax",
      cases={"masks": ("none", "random", "causal")}, after=("matches-reference",),
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, values="normal", magnitude=3.0, seed=1),
                # cap 1 under a causal mask: capping after the mask gives masked keys a score of -1, plain to see
                Case(n_q=3, n_kv=3, d_k=2, d_v=2, mask="causal", magnitude=3.0, seed=4)],
      lesson=Lesson(unicode="A = softmax(mask(c · tanh(s / c))),   s = Q Kᵀ/√d_k,   −c < c · tanh(s / c) < c",
                    latex=r"A = \mathrm{softmax}\!\left(\mathrm{mask}\!\left(c \tanh\frac{s}{c}\right)\right),\qquad s = \frac{QK^\top}{\sqrt{d_k}}",
                    check="Calls the target with softcap = c (1, 5, 20 or 50) on scores large enough to saturate the tanh, "
                          "and compares with the capped float64 reference within a budget from two capped same-dtype "
                          "implementations; a failure is matched against the classic mistakes.",
                    example="softcap"))
def softcap(target, case):
    """attn_c(Q, K, V) = softmax(mask(c tanh(s / c))) V, s = Q K^T / sqrt(d_k): capped scores lie in (-c, c).

    The cap applies to the scaled scores and comes before the mask, so masked keys still get
    weight 0. Why: Gemma 2 and Grok cap attention logits to keep them from growing without
    bound; without the cap factor the scores are squashed into (-1, 1) and attention turns
    nearly uniform. Catches: the cap ignored, tanh(s / c) without the factor c, c tanh(s) without
    dividing, the cap applied after the mask (masked scores become -c: masked keys get weight).
    """
    q, k, v, mask = case.tensors()
    cap = CAPS[case.seed % len(CAPS)]
    got = target.attend(q, k, v, mask, softcap=cap)  # [..., Tq, Dv]
    expected = reference.attention(q, k, v, mask, softcap=cap)[0]
    allowed = softcap_budget(q, k, v, mask, expected, cap)
    err = max_error(got, expected)
    if err <= allowed:
        return
    fail(f"max error {err:.3g}", what=f"the output with softcap = {cap:g} against the float64 reference (weights shown)",
         budget=allowed, call=f"attention(Q, K, V{', mask' if mask is not None else ''}, softcap={cap:g})",
         cause=because("softcap", got=got, q=q, k=k, v=v, mask=mask, cap=cap, allowed=allowed),
         got=weights(target, q, k, mask, softcap=cap), expected_tensor=reference.attention(q, k, v, mask, softcap=cap)[1],
         labels=WEIGHT_LABELS)
