"""The scores family: logit soft-capping, cap * tanh(scores / cap), where a target takes ``softcap``.

It runs where a target takes it (the hf convention, FlexAttention, an sdpa-style target with a
``softcap`` parameter); elsewhere it is a skip with the reason. Each function's docstring states the
math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.probes import WEIGHT_LABELS, weights
from attn_spec.checking.tolerance import max_error, softcap_budget
from attn_spec.properties.inputs import near

F64 = torch.float64


CAPS = (1.0, 5.0, 20.0, 50.0)  # picked by the case's seed; 50 is Gemma 2's attention cap


def _scores_attention(q, k, v, mask, scores_fn):
    """Attention in float64 whose scores are ``scores_fn(scaled scores, allowed)``: the candidates of a diagnosis."""
    q, k, v = (t.detach().to("cpu", F64) for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [..., Tq, Tk]
    allowed = torch.ones_like(s, dtype=torch.bool) if mask is None or mask.dtype != torch.bool \
        else mask.cpu().expand(s.shape)
    bias = mask.cpu().to(F64) if mask is not None and mask.dtype != torch.bool else 0.0
    w = torch.softmax(scores_fn(s + bias, allowed), dim=-1).nan_to_num(0.0)
    return w @ v  # [..., Tq, Dv]


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

    def masked(s, keep):
        return s.masked_fill(~keep, -math.inf)
    candidates = [
        ("the softcap argument is ignored: scores are not capped", lambda s, keep: masked(s, keep)),
        ("tanh without the cap factor: tanh(s / cap) squashes every score into (-1, 1); multiply by cap",
         lambda s, keep: masked(torch.tanh(s / cap), keep)),
        ("the scores are not divided by the cap: cap * tanh(s) instead of cap * tanh(s / cap)",
         lambda s, keep: masked(cap * torch.tanh(s), keep)),
        ("softcap applied after the mask: masked scores become -cap instead of -inf, so masked keys keep weight",
         lambda s, keep: cap * torch.tanh(masked(s, keep) / cap)),
        ("the cap is applied before the scale: cap * tanh(Q K^T / cap) / sqrt(d_k)",
         lambda s, keep: masked(cap * torch.tanh(s * math.sqrt(case.d_k) / cap) / math.sqrt(case.d_k), keep))]
    cause = next((text for text, fn in candidates
                  if near(got, _scores_attention(q, k, v, mask, fn), allowed)),
                 "the scores are not capped as cap * tanh(s / cap) before the mask")
    fail(f"max error {err:.3g}", what=f"the output with softcap = {cap:g} against the float64 reference (weights shown)",
         budget=allowed, call=f"attention(Q, K, V{', mask' if mask is not None else ''}, softcap={cap:g})", cause=cause,
         got=weights(target, q, k, mask, softcap=cap), expected_tensor=reference.attention(q, k, v, mask, softcap=cap)[1],
         labels=WEIGHT_LABELS)
