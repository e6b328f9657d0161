"""Masks and batches: what a mask removes, and what each batch element may see.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import itertools
import math

import torch

from attn_spec import reference
from attn_spec.checking import probes
from attn_spec.checking.assertions import assert_close, fail, with_mask
from attn_spec.targets.base import MULTIHEAD_CONVENTIONS
from attn_spec.targets.conventions import FUNCTION_CONVENTIONS, broadcast_shapes
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.errors import TargetRaised, Uninformative, Unsupported
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.diagnosis.numbers import masked_share
from attn_spec.properties.informative import require_responsive

F64 = torch.float64


def push_limit(dtype: torch.dtype) -> float:
    """The largest raw score |q . k| the kit pushes inputs to: far beyond any softmax's
    comfort, yet representable, with headroom for the module adapter's input gain."""
    return min(1e6, torch.finfo(dtype).max / 64)


def sink_levels(dtype: torch.dtype, multihead: bool = False) -> tuple[float, float]:
    """The raw scores q . k that :func:`sunk_inputs` gives every pair, L and a lower L': L = 1e8 and L' = 1e6
    lie far below the -1e4 fill of older Hugging Face models, and above the -1e9 of tutorials, which no real
    score reaches (a -1e9 fill is right in float32 and float64; float16 cannot hold it, which mask-semantics
    catches otherwise). In float16, L is what the dtype holds (32752: below -1e4 up to d_k = 10) and L' its
    square root. With headroom for a module adapter's input gain."""
    top = min(1e8, torch.finfo(dtype).max / (64 if multihead else 2))
    return top, (1e6 if top == 1e8 else math.sqrt(top))


def sunk_inputs(q, k, level: float):
    """Q', K' of the shapes of Q, K where every raw score is -level: q_i = a e_0, k_j = -a e_0, a = sqrt(level).

    A correct attention gives each row uniform weights over its allowed keys, in any dtype; a mask
    that *replaces* masked scores by a finite fill above -level / sqrt(d_k) hands all the weight to
    the masked keys (one that adds the fill still ranks them lower: the push test catches that one)."""
    q2, k2 = torch.zeros_like(q), torch.zeros_like(k)  # [..., Tq, Dk], [..., Tk, Dk]
    q2[..., 0], k2[..., 0] = math.sqrt(level), -math.sqrt(level)
    return q2, k2


def _push_keys(q, k, masked, limit):
    """K moved at ``masked`` keys so that q . k there is about +limit (K [..., Tk, Dk], one query per batch)."""
    size = (limit / q.double().abs().sum(dim=-1, keepdim=True).clamp_min(1.0)).to(k.dtype)  # [..., 1, 1]
    direction = torch.where(q >= 0, 1.0, -1.0).to(k.dtype)  # [..., 1, Dk] sign(q), sign(0) = +1
    return torch.where(masked, k + size * direction, k)  # [..., Tk, Dk]


def _one_copy_per_query(q, k, v, mask, rows):
    """One batch element per query in ``rows``, each with all of Q and the mask and its own copy of K
    and V, so that the keys masked for that one query can be changed freely (and the inputs keep
    their shapes: a self-attention or causal-only target takes them)."""
    batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2], mask.shape[:-2])

    def copies(t):  # [..., T, D] -> [..., R, T, D]
        return t.expand(*batch, *t.shape[-2:]).unsqueeze(-3).expand(*batch, len(rows), *t.shape[-2:])
    return copies(q), copies(k).clone(), copies(v).clone(), copies(mask)


def _leak_cause(w, allowed, q, k, mask) -> str:
    """Why masked keys got weight: inverted polarity, an ignored mask, or a finite fill value."""
    mixed = (~allowed).any(dim=-1)  # [..., Tq] rows with some masked key
    on_allowed = w.masked_fill(~allowed, 0.0).nan_to_num(0.0).sum(dim=-1)  # [..., Tq]
    if mixed.any() and on_allowed[mixed].abs().max() < 1e-3:
        return "the mask is applied with inverted polarity (True taken as 'ignore'): masked keys get all the weight"
    if max_error(w, reference.attention(q, k, k, None)[1]) < 1e-3:
        return "the mask is ignored"
    shared = masked_share(w, allowed)
    if shared:
        return shared
    if w.masked_fill(allowed, 0.0).nan_to_num(1.0).abs().max() < 1e-2:
        return "masked keys keep a small weight: the fill value is finite and too small (use -inf or finfo.min)"
    return "the mask does not reach these keys (broadcast over the wrong dims, or applied to the wrong axis?)"


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

    Moving K and V at masked positions to huge finite values (raw scores near +1e6, or
    finfo.max / 64 in float16) must not change the output. Where additive masks are in the
    target's contract (sdpa, torch-mha, flex, hf with float masks, or declared: ``--masks bool,additive``), a float mask
    of 0 / -inf must give what the bool mask gives, and a finite float mask acts as a bias
    added *after* scaling; other targets get bool masks only. NaN in masked K/V is a convention (``0 * NaN`` propagates), probed and
    reported in the header, not judged here.

    Why: padding and causal masks are how a model is told what does not exist; a masked key
    that still counts leaks padding or the future, often silently. Catches: inverted polarity,
    a mask applied after the softmax (multiplied, or renormalised so masked scores still enter
    the max), a finite fill (-1e4) that large scores overwhelm, -1e9 that float16 cannot
    hold, an additive mask scaled with the scores.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    if mask is None or mask.all():
        raise Uninformative("the mask masks no key")
    w = probes.weights(target, q, k, mask).detach().to("cpu", F64)  # [..., Tq, Tk]
    allowed = mask.cpu().expand(w.shape)  # [..., Tq, Tk]
    leak = w.masked_fill(allowed, 0.0)  # NaN stays, and NaN != 0
    if (leak != 0).any():
        worst = leak.abs().nan_to_num(math.inf).max().item()
        fail(f"{worst:.3g}", what="the largest weight on a masked key", expected="exactly 0",
             call="attention(Q, K, V=identity, mask)", cause=_leak_cause(w, allowed, q, k, mask), got=w,
             expected_tensor=reference.attention(q, k, k, mask)[1], labels=probes.WEIGHT_LABELS)
    _check_masked_inputs_unused(target, q, k, v, mask)
    _check_sunk_rows(target, q, k, mask)
    _check_float_mask(target, case, q, k, v, mask)


def _check_sunk_rows(target, q, k, mask):
    """Allowed scores far below the common finite fills (every score of a row equal, at each of sink_levels):
    masked keys keep exactly 0 weight. Both levels are read before judging, so that a diagnosis sees both."""
    levels = sink_levels(q.dtype, target.convention in MULTIHEAD_CONVENTIONS)
    sunk = [sunk_inputs(q, k, level) for level in levels]
    weights = [probes.weights(target, q2, k2, mask).detach().to("cpu", F64) for q2, k2 in sunk]  # [..., Tq, Tk] each
    for level, (q2, k2), w in zip(levels, sunk, weights):
        allowed = mask.cpu().expand(w.shape)  # [..., Tq, Tk]
        leak = w.masked_fill(allowed, 0.0)  # NaN stays, and NaN != 0
        if not (leak != 0).any():
            continue
        worst = leak.abs().nan_to_num(math.inf).max().item()
        fail(f"{worst:.3g}", what=f"the largest weight on a masked key when every score is {-level / math.sqrt(q.shape[-1]):.3g}",
             expected="exactly 0", call="attention(Q', K', V=identity, mask), q_i = a e_0, k_j = -a e_0",
             cause="masked scores are replaced by a finite fill (masked_fill(~mask, -1e4) or -1e9) that lies above "
                   "the allowed scores, so the masked keys take the weight (fill with -inf or finfo(dtype).min)"
             if (leak.nan_to_num(0.0).sum(dim=-1) > 0.5).any() else _leak_cause(w, allowed, q2, k2, mask),
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
    limit = push_limit(q.dtype)
    loud_k, loud_v = _push_keys(own(qs), ks, masked, limit), torch.where(masked, vs + limit, vs)
    base = own(target.attend(qs, ks, vs, ms))  # [..., R, 1, Dv]
    allowed = 2 * budget(qs, ks, vs, ms, reference.attention(qs, ks, vs, ms)[0])
    moved = own(target.attend(qs, loud_k, loud_v, ms))
    if max_error(moved, base) <= allowed:
        return
    moved_k = own(target.attend(qs, loud_k, vs, ms))  # which of the two reaches the output?
    cause = ("masked keys' large scores still enter the softmax, so the allowed weights underflow to 0/0 "
             "(mask applied after the softmax, then renormalised?)" if not torch.isfinite(moved_k).all() else
             "masked keys still count: the mask is applied after the softmax, or as a finite additive "
             "bias that large scores overwhelm (fill with -inf or finfo.min)")
    labels = ("the output after the move", "the target's own output before it")
    assert_close(moved_k, base, budget=allowed, call="attention(Q, K', V, mask), one copy per query", labels=labels,
                 what=f"the output after moving K at masked positions (scores up to about {limit:.3g}), "
                      f"for the queries they are masked for", cause=cause)
    assert_close(moved, base, budget=allowed, call="attention(Q, K', V', mask), one copy per query", labels=labels,
                 what=f"the output after adding {limit:.3g} to V at masked positions",
                 cause="values at masked positions reach the output: their weight is not exactly 0")


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
                 cause=lambda: "the float mask is read as a keep-mask (positions equal to 0 are masked)"
                 if max_error(got, reference.attention(q, k, v, ~mask)[0]) < 1e-3 else
                 "a float mask is not added to the scores as a bias")
    if max_error(out, expected) > allowed:
        return  # the plain output is already off: matches-reference reports that, not this property
    gen = torch.Generator().manual_seed(case.seed)
    bias = (torch.randint(-2, 3, float_mask.shape, generator=gen) / 2).to(float_mask)  # [..., Tq, Tk] in {-1..1}
    biased = float_mask + bias
    got = target.attend(q, k, v, biased)
    expected = reference.attention(q, k, v, biased)[0]
    allowed = budget(q, k, v, biased, expected)

    def cause():
        scaled = reference.attention(q, k, v, biased / math.sqrt(case.d_k))[0]
        return ("the float mask is scaled with the scores ((QK^T + mask) / sqrt(d_k)); add it after scaling"
                if max_error(got, scaled) <= max(allowed, 1e-3) else
                "a finite float mask is not added to the scaled scores as a bias")
    assert_close(got, expected, budget=allowed, what="the output with a finite float mask against the float64 "
                 "reference", call="attention(Q, K, V, float_mask)", cause=cause)


def _flat_batch(t, batch):
    return t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:])  # [B, T, D]


@prop("batch-independence", family="batching",
      statement="each element of the leading batch/head dims is computed on its own: the batched output "
                "equals the per-example outputs, and broadcast (stride-0) K/V or masks work",
      conventions=FUNCTION_CONVENTIONS, cases={"batch": True}, after=("rows-sum-to-one",),
      at_scale="it recomputes every batch element alone; checked at the drawn sizes",
      examples=[Case(batch=(2,), n_q=2, n_kv=3, d_k=2, d_v=2, seed=5),
                Case(batch=(2, 2), n_q=2, n_kv=2, d_k=2, d_v=1, mask="random", seed=6)],
      lesson=Lesson(unicode="out[b] = attn(Q[b], K[b], V[b], mask[b])   for every batch index b",
                    latex=r"\mathrm{out}[b] = \mathrm{attn}(Q[b], K[b], V[b], \mathrm{mask}[b])\quad \forall b",
                    check="Runs each batch element alone and compares with its slice of the batched output; makes element 0 "
                          "huge and checks the others do not move; broadcasts K/V/mask with expand.",
                    example="batch"))
def batch_independence(target, case):
    """out[b] = attn(Q[b], K[b], V[b], mask[b]) for every index b of the leading dims.

    Three checks: each element computed alone equals its slice of the batched output; giving
    element 0 huge scores leaves every other element's output unchanged; K, V and the mask
    broadcast along the last batch dim with ``expand`` (stride 0, as in multi-query
    attention) give what their contiguous copies give. (Multi-head modules take 2-D inputs,
    so this applies to the function conventions only.)

    Why: batch and head dims are independent sequences; a leak between them trains on
    other examples' data and breaks as soon as batch composition changes. Catches: batch
    and sequence dims interleaved by a reshape (batch-first read as sequence-first), a max
    or sum over the whole tensor (x.max() without dim), ``.view`` on broadcast K/V.
    """
    require_responsive(target, case)
    if math.prod(case.batch) < 2:
        raise Uninformative("a single batch element: nothing to be independent of")
    q, k, v, mask = case.tensors()
    out = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    allowed = 2 * budget(q, k, v, mask, reference.attention(q, k, v, mask)[0])
    for index in itertools.product(*map(range, case.batch)):
        alone = target.attend(q[index], k[index], v[index], mask if mask is None or mask.dim() == 2 else mask[index])
        assert_close(out[index], alone, budget=allowed, labels=(
                     f"element {list(index)} of attention(Q, K, V{with_mask(mask)})",
                     f"attention(Q{list(index)}, K{list(index)}, V{list(index)}{with_mask(mask)}), the target's "
                     f"own output on that element alone"),
                     inputs={"Q": q[index], "K": k[index], "V": v[index],
                             "mask": mask if mask is None or mask.dim() == 2 else mask[index]},
                     what=f"batch element {list(index)} of the batched output against the element computed alone",
                     call=f"attention(Q[{', '.join(map(str, index))}], ...{with_mask(mask)})",
                     cause="batch elements are mixed (a reshape or view that interleaves the batch with the "
                           "sequence dim, e.g. batch-first read as sequence-first?)")
    _check_no_leak(target, case, q, k, v, mask, out, allowed)
    _check_broadcast(target, q, k, v, mask)


def _check_no_leak(target, case, q, k, v, mask, out, allowed):
    """Huge scores in batch element 0 must not change any other element."""
    n = math.prod(case.batch)
    if n < 2:
        return
    first = (0,) * len(case.batch)
    q0, k0 = q[first].double(), k[first].double()  # [Tq, Dk], [Tk, Dk]
    peak = max((q0.abs().sum(dim=-1).max() * k0.abs().max()).item(), q0.abs().max().item())  # bounds |q . k| and |q|
    gain = push_limit(q.dtype) / max(peak, 1.0)
    loud = q.clone()
    loud[first] = (q0 * gain).to(q.dtype)
    got = _flat_batch(target.attend(loud, k, v, mask), case.batch)[1:]  # [B - 1, Tq, Dv]
    before = _flat_batch(out, case.batch)[1:]
    cause = ("a reduction runs over the whole batch: a max without dim= lets element 0's large scores "
             "underflow the others to 0/0" if not torch.isfinite(got).all() else
             "batch elements influence each other (a max, sum or normalisation over the batch dims?)")
    assert_close(got, before, budget=allowed, call=f"attention(Q', K, V{with_mask(mask)}), Q' = Q with element 0 scaled",
                 labels=("the other elements' outputs after the scaling", "the target's own outputs before it"),
                 what=f"the outputs of the other batch elements after scaling the queries of element 0 by {gain:.3g}",
                 cause=cause)


def _check_broadcast(target, q, k, v, mask):
    """K, V and mask expanded (stride 0) along the last batch dim == their contiguous copies."""
    batch = q.shape[:-2]

    def shared(t):  # one slice shared along the last batch dim, as multi-query attention shares K/V
        t = t.expand(*batch, *t.shape[-2:])
        return t[..., :1, :, :].expand(t.shape)

    k_b, v_b = shared(k), shared(v)
    m_b = None if mask is None else shared(mask)
    expected = target.attend(q, k_b.contiguous(), v_b.contiguous(), None if m_b is None else m_b.contiguous())
    try:
        got = target.attend(q, k_b, v_b, m_b)
    except TargetRaised as exc:
        exc.cause = "broadcast (stride-0) inputs are rejected: a .view() on an expanded tensor? (use .reshape())"
        raise
    allowed = 2 * budget(q, k_b, v_b, m_b, reference.attention(q, k_b, v_b, m_b)[0])
    assert_close(got, expected, budget=allowed, call="attention(Q, K.expand(...), V.expand(...), mask.expand(...))",
                 labels=("the output on the expanded K, V and mask", "the target's own output on contiguous copies"),
                 what="the output with K, V and mask expanded with stride 0 against their contiguous copies",
                 cause="broadcast (stride-0) inputs are read as if contiguous")
