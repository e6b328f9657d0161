"""The masking family: what a mask removes, causality, ``is_causal`` (the sdpa convention) and a sliding
window over the keys.

``is_causal`` and the window run where a target takes them (the sdpa convention; the hf convention,
FlexAttention, an sdpa-style target with a ``sliding_window``/``window_size`` parameter); elsewhere they
are skips with the reason. Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import probes
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.probes import WEIGHT_LABELS, weights
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.errors import Uninformative, Unsupported
from attn_spec.failures import because
from attn_spec.targets.base import MULTIHEAD_CONVENTIONS
from attn_spec.targets.behaviours import behaviour
from attn_spec.targets.conventions import broadcast_shapes
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import SCORE_RANGE, near, push_keys, push_limit, sink_levels, sunk_inputs

F64 = torch.float64


@prop("causal-mask", family="masking",
      statement="under a causal mask, weights above the diagonal are 0 and output i ignores keys and values after i",
      cases={"masks": ("causal",), "min_n_kv": 2}, at_scale={"masks": ("causal",)},
      examples=[Case(n_q=3, n_kv=3, d_k=2, d_v=2, mask="causal"), Case(n_q=2, n_kv=4, d_k=1, d_v=1, mask="causal")],
      lesson=Lesson(unicode="Aᵢⱼ = 0 for j > i,   outᵢ depends on K₀..ᵢ, V₀..ᵢ only",
                    latex=r"A_{ij} = 0 \ \text{for}\ j > i,\qquad \mathrm{out}_i = f(Q_i, K_{\le i}, V_{\le i})",
                    check="Reads the weights with V = identity under a causal mask and looks above the diagonal; then "
                          "changes K and V at future positions and checks earlier outputs do not move.",
                    example="causal"))
def causal_mask(target, case):
    """A[i, j] = 0 for j > i, the rest is softmax over j <= i; out[i] depends only on K, V[:i+1].

    Why: a decoder trained with a leak from the future learns to copy the next token and is
    useless at generation time. Catches: the mask ignored, inverted (True taken as 'ignore'),
    off by one (triu diagonal=0 masks the current token; row 0 then has no key), a mask
    applied after the softmax. Beyond probes.WEIGHTS_LIMIT the weights are not read (V = identity
    would be [n_q, n_kv] wide): the output under the mask is compared with the reference instead.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    if probes.weights_fit(case.n_q, case.n_kv):
        _causal_weights(target, case, q, k, mask)
    else:
        _causal_outputs(target, q, k, v, mask)
    split = case.n_kv // 2  # keys and values from here on are the future of the first `split` queries
    k2, v2 = k.clone(), v.clone()
    k2[..., split:, :] = -k2[..., split:, :] * 3 + 1
    v2[..., split:, :] = v2[..., split:, :] * 5 - 2
    rows = min(split, case.n_q)
    before = target.attend(q, k, v, mask)[..., :rows, :]
    after = target.attend(q, k2, v2, mask)[..., :rows, :]
    assert_close(after, before, budget=2 * row_reference(q, k, v, mask).budget,
                 what=f"the outputs of queries < {split} after changing keys and values at positions >= {split}",
                 call="attention(Q, K', V', causal mask)",
                 cause=because("output-reads-future"),
                 labels=("the outputs with the future keys and values changed",
                         "the target's own outputs before the change (the keys and values as drawn)"))


def _causal_weights(target, case, q, k, mask):
    """Weights read with V = identity: zero above the diagonal, and no allowed key left out."""
    w = probes.weights(target, q, k, mask).double().cpu()  # [..., Tq, Tk]
    ref_w = reference.attention(q, k, k, mask)[1]  # [..., Tq, Tk]
    future = ~reference.causal_mask(case.n_q, case.n_kv)  # [Tq, Tk]
    leak = w.masked_fill(~future, 0.0).abs()
    labels = probes.WEIGHT_LABELS
    if leak.max().item() > 0:
        fail(f"{leak.max().item():.3g}: queries see future keys", what="the largest weight above the diagonal",
             expected="0", call="attention(Q, K, V=identity, causal mask)", cause=because("causal-leak", w=w, future=future),
             got=w, expected_tensor=ref_w,
             labels=labels)
    dropped = (ref_w > 1e-3) & (w == 0)  # an allowed key the target never looks at
    if dropped.any():
        i, j = [int(x) for x in dropped.nonzero()[0][-2:]]
        fail("0, but j <= i is allowed", what=f"the weight of query {i} on key {j}",
             expected=f"the reference weight {ref_w[..., i, j].flatten()[0].item():.3g}",
             call="attention(Q, K, V=identity, causal mask)",
             cause=because("causal-off-by-one"),
             got=w, expected_tensor=ref_w, labels=labels)


def _causal_outputs(target, q, k, v, mask):
    """At lengths too long to read the weights: the output under the causal mask matches the reference.

    A mismatch counts against the mask only when the same target matches the reference without a
    mask (otherwise its values are wrong, which matches-reference reports); which wrong mask
    reproduces the output on a few rows names the bug."""
    got = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    ref = row_reference(q, k, v, mask)  # on chosen rows at long lengths (checking.rows)
    if ref.holds(got):
        return
    if not row_reference(q, k, v).holds(target.attend(q, k, v, None)):
        return  # wrong without a mask too: not the mask's failure
    ref.check(got, what="the output under the causal mask against the float64 reference (without a mask it "
              "matches)", call="attention(Q, K, V, causal mask)",
              cause=because("causal-rows", got=got, q=q, k=k, v=v, mask=mask, allowed=ref.budget))


def _one_copy_per_query(q, k, v, mask, rows):
    """One batch element per query in ``rows``, each with all of Q and the mask and its own copy of K
    and V, so that the keys masked for that one query can be changed freely (and the inputs keep
    their shapes: a self-attention or causal-only target takes them)."""
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], mask.shape[:-2])

    def copies(t):  # [..., T, D] -> [..., R, T, D]
        return t.expand(*batch, *t.shape[-2:]).unsqueeze(-3).expand(*batch, len(rows), *t.shape[-2:])
    return copies(q), copies(k).clone(), copies(v).clone(), copies(mask)


@prop("mask-semantics", family="masking",
      statement="masked keys get exactly zero weight; the output does not depend on K or V at masked positions; "
                "where additive masks are in the target's contract (sdpa, torch-mha, flex, hf with float masks, or declared with --masks), "
                "a bool mask and the equivalent additive -inf mask agree",
      cases={"masks": ("random", "causal"), "min_n_kv": 2}, after=("rows-sum-to-one", "scale-sqrt-dk"),
      at_scale="it reads the weights with V = identity, an [n_q, n_kv] output per head; at such sizes "
               "matches-reference checks a padding mask and causal-mask a causal one",
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, mask="causal"),
                Case(n_q=3, n_kv=4, d_k=4, d_v=2, dtype="float32", mask="random", seed=3),
                Case(n_q=2, n_kv=3, d_k=2, d_v=2, dtype="float16", mask="causal")],
      lesson=Lesson(unicode="Aᵢⱼ = 0 where maskᵢⱼ = False,   outᵢ = Σ_{j allowed} Aᵢⱼ Vⱼ",
                    latex=r"A_{ij} = 0 \ \text{where}\ \mathrm{mask}_{ij} = \mathrm{False},\qquad \mathrm{out}_i = \sum_{j\ \mathrm{allowed}} A_{ij} V_j",
                    check="Reads the weights under a random mask, moves K and V at masked positions to huge values and "
                          "checks the output does not move, and compares a bool mask with the additive 0/−∞ mask.",
                    example="mask"))
def mask_semantics(target, case):
    """A[i, j] = 0 exactly where mask[i, j] is False, and out[i] = sum over allowed j of A[i, j] V[j].

    Moving K and V at masked positions to the edge of the scores attention reaches (raw scores near
    +65504, SCORE_RANGE: what float16 holds) must not change the output. Where additive masks are in the
    target's contract (sdpa, torch-mha, flex, hf with float masks, or declared: ``--masks bool,additive``), a float mask
    of 0 / -inf must give what the bool mask gives, and a finite float mask acts as a bias
    added *after* scaling; other targets get bool masks only. NaN in masked K/V is a convention (``0 * NaN`` propagates), probed and
    reported in the header, not judged here.

    Why: padding and causal masks are how a model is told what does not exist; a masked key
    that still counts leaks padding or the future, often silently. Catches: inverted polarity,
    a mask applied after the softmax (multiplied, or renormalised so masked scores still enter
    the max), a finite fill (-1e4, replaced or added) that scores within SCORE_RANGE overwhelm,
    -1e9 that float16 cannot hold, an additive mask scaled with the scores. A fill beyond the
    range (d2l's -1e6) passes: how far it stays exact is the finite-fill behaviour.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    if mask is None or mask.all():
        raise Uninformative("the mask masks no key")
    w = probes.weights(target, q, k, mask).detach().to("cpu", F64)  # [..., Tq, Tk]
    allowed = mask.cpu().expand(w.shape)  # [..., Tq, Tk]
    leak = w.masked_fill(allowed, 0.0)  # NaN stays, and NaN != 0
    if (leak != 0).any():
        fail(_worst_leak(leak), what="the largest weight on a masked key", expected="exactly 0",
             call="attention(Q, K, V=identity, mask)", cause=because("mask-leak", w=w, allowed=allowed, q=q, k=k, mask=mask), got=w,
             expected_tensor=reference.attention(q, k, k, mask)[1], labels=probes.WEIGHT_LABELS)
    _check_masked_inputs_unused(target, q, k, v, mask)
    _check_sunk_rows(target, q, k, mask)
    _check_float_mask(target, case, q, k, v, mask)


def _worst_leak(leak) -> str:
    """The largest weight on a masked key, as the report says it: "NaN" where one is NaN (it read "inf",
    a weight no softmax gives)."""
    return "NaN" if leak.isnan().any() else f"{leak.abs().max().item():.3g}"


def _check_sunk_rows(target, q, k, mask):
    """Allowed scores at the edge of SCORE_RANGE (every score of a row equal, at each of sink_levels): masked keys
    keep exactly 0 weight. Both levels are read before judging, so that a diagnosis sees both."""
    levels = sink_levels(q.dtype, target.convention in MULTIHEAD_CONVENTIONS)
    sunk = [sunk_inputs(q, k, level) for level in levels]
    weights = [probes.weights(target, q2, k2, mask).detach().to("cpu", F64) for q2, k2 in sunk]  # [..., Tq, Tk] each
    for level, (q2, k2), w in zip(levels, sunk, weights):
        allowed = mask.cpu().expand(w.shape)  # [..., Tq, Tk]
        leak = w.masked_fill(allowed, 0.0)  # NaN stays, and NaN != 0
        if not (leak != 0).any():
            continue
        fail(_worst_leak(leak), what=f"the largest weight on a masked key when every score is {-level / math.sqrt(q.shape[-1]):.3g}",
             expected="exactly 0", call="attention(Q', K', V=identity, mask), q_i = a e_0, k_j = -a e_0",
             cause=because("finite-fill-above")
             if (leak.nan_to_num(0.0).sum(dim=-1) > 0.5).any() else because("mask-leak", w=w, allowed=allowed, q=q2, k=k2,
                                                                              mask=mask),
             got=w, expected_tensor=reference.attention(q2, k2, k2, mask)[1], inputs={"Q'": q2, "K'": k2})


def _check_masked_inputs_unused(target, q, k, v, mask):
    """Huge finite K and V at the masked keys of each query leave its output unchanged."""
    rows = sorted({round(x) for x in torch.linspace(0, q.shape[-2] - 1, min(q.shape[-2], 4)).tolist()})
    qs, ks, vs, ms = _one_copy_per_query(q, k, v, mask, rows)
    pick = torch.arange(len(rows), device=q.device), torch.tensor(rows, device=q.device)  # element r: query rows[r]

    def own(t):  # [..., R, Tq, D] -> [..., R, 1, D]: each element's own query
        return t[..., pick[0], pick[1], :].unsqueeze(-2)
    masked = ~(ms if ms.shape[-2] == 1 else own(ms)).transpose(-2, -1)  # [..., R, Tk, 1] keys masked for each
    # element's query (a key-padding mask [..., 1, Tk] is every query's own)
    limit = min(push_limit(q.dtype), SCORE_RANGE)
    loud_k, loud_v = push_keys(own(qs), ks, masked, limit), torch.where(masked, vs + limit, vs)
    base = own(target.attend(qs, ks, vs, ms))  # [..., R, 1, Dv]
    allowed = 2 * budget(qs, ks, vs, ms, reference.attention(qs, ks, vs, ms)[0])
    moved = own(target.attend(qs, loud_k, loud_v, ms))
    if max_error(moved, base) <= allowed:
        return
    moved_k = own(target.attend(qs, loud_k, vs, ms))  # which of the two reaches the output?
    labels = ("the output after the move", "the target's own output before it")
    assert_close(moved_k, base, budget=allowed, call="attention(Q, K', V, mask), one copy per query", labels=labels,
                 what=f"the output after moving K at masked positions (scores up to about {limit:.3g}), "
                      f"for the queries they are masked for", cause=because("masked-keys-count", got=moved_k))
    assert_close(moved, base, budget=allowed, call="attention(Q, K', V', mask), one copy per query", labels=labels,
                 what=f"the output after adding {limit:.3g} to V at masked positions",
                 cause=because("masked-values-reach-output"))


def _check_float_mask(target, case, q, k, v, mask):
    """0 / -inf float mask == bool mask; a finite float mask is a bias added after scaling.

    Only for targets whose contract includes additive masks (sdpa, torch-mha, flex, hf with float masks, or declared)."""
    if "additive" not in target.masks:
        return  # promised bool masks only: a float mask would be read as a bool one, rightly
    float_mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, -math.inf)
    try:
        got = target.attend(q, k, v, float_mask)  # [..., Tq, Dv]
    except Unsupported:
        return  # the target declined this float mask: only the bool mask applies
    out = target.attend(q, k, v, mask)
    expected = reference.attention(q, k, v, mask)[0]
    allowed = budget(q, k, v, mask, expected)
    assert_close(got, out, budget=2 * allowed, what="the output with a float mask of 0 / -inf against the output "
                 "with the equivalent bool mask", call="attention(Q, K, V, float_mask)",
                 labels=("the output with the float mask", "the target's own output with the equivalent bool mask"),
                 cause=because("float-mask-read", got=got, q=q, k=k, v=v, mask=mask))
    if max_error(out, expected) > allowed:
        return  # the plain output is already off: matches-reference reports that, not this property
    gen = torch.Generator().manual_seed(case.seed)
    bias = (torch.randint(-2, 3, float_mask.shape, generator=gen) / 2).to(float_mask)  # [..., Tq, Tk] in {-1..1}
    biased = float_mask + bias
    got = target.attend(q, k, v, biased)
    expected = reference.attention(q, k, v, biased)[0]
    allowed = budget(q, k, v, biased, expected)
    assert_close(got, expected, budget=allowed, what="the output with a finite float mask against the float64 "
                 "reference", call="attention(Q, K, V, float_mask)",
                 cause=because("float-mask-scaled", got=got, q=q, k=k, v=v, bias=biased, allowed=allowed))


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
        empty = reference.keyless_rows(case.n_q, case.n_kv, alignment=alignment)  # [Tq] rows without keys
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
                 reference.keyless_rows(case.n_q, case.n_kv, alignment="bottom-right").to(got.device)[:, None],
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
    cause = next((text for text, out in filter(None, candidates) if near(got, out, allowed)),
                 "the window does not select the keys i - w < j <= i")
    fail(f"max error {err:.3g}", what=f"the output with a window of w = {w} keys against the float64 reference "
         f"(weights shown)", budget=allowed, call=f"attention(Q, K, V{', mask' if mask is not None else ''}, window={w})",
         cause=cause, got=weights(target, q, k, mask, window=w),
         expected_tensor=reference.attention(q, k, v, mask, window=w)[1], labels=WEIGHT_LABELS,
         mask=allowed_keys.expand(got.shape[:-1] + (case.n_kv,)))  # hatches the keys outside the window
