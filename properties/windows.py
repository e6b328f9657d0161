"""Two options of real models: a sliding window over the keys, and logit soft-capping.

They run where a target takes them (the hf convention, FlexAttention, an sdpa-style target with a
``sliding_window``/``window_size`` or ``softcap`` parameter); elsewhere they are skips with the reason.
Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget, max_error, softcap_budget
from attn_spec.checking.assertions import fail
from attn_spec.checking.probes import WEIGHT_LABELS, weights

F64 = torch.float64


def _near(got, candidate, allowed) -> bool:
    """Does a candidate mistake reproduce the output (within the budget, or 0.1% where the budget is tiny)?"""
    return max_error(got, candidate) <= max(allowed, 1e-3 * max(1.0, candidate.abs().max().item()))


def _window_of(case) -> int:
    """1 .. n - 1 keys, from the case's seed: every such window leaves some earlier key out."""
    return 1 + case.seed % (case.n_kv - 1)


@prop("sliding-window", family="masking",
      statement="with a sliding window of w keys, query i attends exactly the keys i - w < j <= i (its own included)",
      cases={"cross": False, "masks": ("none", "random")}, after=("causal-mask", "matches-reference"),
      examples=[Case(n_q=4, n_kv=4, d_k=2, d_v=2, seed=1), Case(n_q=5, n_kv=5, d_k=2, d_v=2, mask="random", seed=2)],
      lesson=Lesson(unicode="outᵢ = Σ_{i−w < j ≤ i} softmaxⱼ(sᵢⱼ) Vⱼ,   s = Q Kᵀ/√d_k",
                    latex=r"\mathrm{out}_i = \sum_{i-w < j \le i} \mathrm{softmax}_j(s_{ij})\,V_j,\qquad s = \frac{QK^\top}{\sqrt{d_k}}",
                    check="Calls the target with a window of w keys (1 ≤ w < n, from the case's seed; hf: the windowed mask"
                          " HF builds plus sliding_window=w, flash-attn: window_size=(w − 1, 0)) and compares with the "
                          "windowed float64 reference; on failure it reads the weights with V = I and names the window it "
                          "did apply.",
                    example="window"))
def sliding_window(target, case):
    """attn_w(Q, K, V)_i = sum over i - w < j <= i of softmax_j(s_ij) V_j, s = Q K^T / sqrt(d_k).

    The window is causal and counts w keys including the query's own (Mistral's and Hugging Face's
    convention; flash-attn's window_size=(w - 1, 0)); any caller's mask applies on top. Why: local
    attention layers (Mistral, Gemma 2, Longformer) see only the last w tokens, and a model trained
    with one window and served with another silently loses or gains context. Catches: a window of
    w + 1 or w - 1 keys (<= for <), the window ignored, a window that is not causal.
    """
    if case.n_kv < 2:
        return  # one key: every window keeps it
    q, k, v, mask = case.tensors()
    w = _window_of(case)
    if mask is not None:  # every query keeps its own key, so that no row is empty (a convention, not judged here)
        mask = mask | torch.eye(case.n_q, dtype=torch.bool, device=mask.device)
    got = target.attend(q, k, v, mask, window=w)  # [..., T, Dv]
    pattern = reference.causal_mask(case.n_q, case.n_kv, window=w, device=q.device)  # [T, T]
    allowed_keys = pattern if mask is None else mask & pattern
    expected = reference.attention(q, k, v, mask, window=w)[0]
    allowed = budget(q, k, v, allowed_keys, expected)
    err = max_error(got, expected)
    if err <= allowed:
        return

    def ref(keys):
        return reference.attention(q, k, v, keys if mask is None else keys & mask)[0]
    i, j = torch.arange(case.n_q)[:, None], torch.arange(case.n_kv)[None, :]
    candidates = [(f"the window keeps {w + 1} keys, not {w}: i - w <= j where i - w < j was meant (off by one)",
                   ref(reference.causal_mask(case.n_q, case.n_kv, window=w + 1))),
                  (f"the window keeps {w - 1} keys, not {w}: off by one at the far end", ref(
                      reference.causal_mask(case.n_q, case.n_kv, window=w - 1))) if w > 1 else None,
                  ("the window is ignored: every earlier key is attended (plain causal)",
                   ref(reference.causal_mask(case.n_q, case.n_kv))),
                  ("the window is not causal: keys after the query are attended too", ref((j - i).abs() < w)),
                  ("neither the window nor causality is applied", ref(torch.ones_like(pattern)))]
    cause = next((text for text, out in filter(None, candidates) if _near(got, out, allowed)),
                 "the window does not select the keys i - w < j <= i")
    fail(f"max error {err:.3g}", what=f"the output with a window of w = {w} keys against the float64 reference "
         f"(weights shown)", budget=allowed, call=f"attention(Q, K, V{', mask' if mask is not None else ''}, window={w})",
         cause=cause, got=weights(target, q, k, mask, window=w),
         expected_tensor=reference.attention(q, k, v, mask, window=w)[1], labels=WEIGHT_LABELS,
         mask=allowed_keys.expand(got.shape[:-1] + (case.n_kv,)))  # hatches the keys outside the window


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
                  if _near(got, _scores_attention(q, k, v, mask, fn), allowed)),
                 "the scores are not capped as cap * tanh(s / cap) before the mask")
    fail(f"max error {err:.3g}", what=f"the output with softcap = {cap:g} against the float64 reference (weights shown)",
         budget=allowed, call=f"attention(Q, K, V{', mask' if mask is not None else ''}, softcap={cap:g})", cause=cause,
         got=weights(target, q, k, mask, softcap=cap), expected_tensor=reference.attention(q, k, v, mask, softcap=cap)[1],
         labels=WEIGHT_LABELS)
