"""Merging partial attentions by their log-sum-exp (the ``merge`` convention, attn_spec.targets.serving_merge):
split-KV decoding, cascade and ring attention compute attention over parts of the keys and merge the parts.

A case is read as T = n_q queries over n_kv keys with H = the product of its batch dims heads, D = d_v; the
keys are split into 2 to 4 parts drawn from the case's seed (some of them empty), the partial attentions
(out_i, lse_i) computed in float64 and handed to the kernel in the case's dtype (LSEs in float32 for half
precision, as kernels keep them) and in the LSE base the kernel was found to use.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import assert_within, fail
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.cases import Case
from attn_spec.checking.tolerance import earned, eps, max_error
from attn_spec.failures import because

F64 = torch.float64
MERGE_CASES = {"masks": ("none",)}


def _lse_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _strided(s):
    """``s`` [T, H] as a non-contiguous view of an [H, T] buffer (vLLM PR #22003: a strided LSE corrupted merges)."""
    return s.t().contiguous().t()  # [T, H], strides (1, T)


def partial_states(case):
    """(parts [(v [T, H, D], s [T, H]) in float64, natural log], (out, lse) over every key): keys split at random."""
    q, k, v, _ = case.tensors()  # [..., T, D]
    q, k, v = (t.to(F64).reshape(-1, *t.shape[-2:]) for t in (q, k, v))  # [H, T, D]
    gen = torch.Generator().manual_seed(case.seed)
    n_parts = int(torch.randint(2, 5, (1,), generator=gen))
    owner = torch.randint(0, n_parts, (k.shape[-2],), generator=gen)  # [n_kv]: the part each key goes to
    if n_parts > 2:
        owner[owner == n_parts - 1] = 0  # the last part is empty
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # [H, T, n_kv]
    parts = []
    for i in torch.randperm(n_parts, generator=gen).tolist():  # in shuffled order
        allowed = (owner == i)[None, None, :].expand_as(scores)  # [H, T, n_kv]
        out, _ = reference.attention(q, k, v, allowed)  # [H, T, D]; 0 for an empty part
        lse = reference.lse(reference.masked(scores, allowed))  # [H, T]; -inf for an empty part
        parts.append((out.transpose(0, 1), lse.t()))  # [T, H, D], [T, H]
    full, _ = reference.attention(q, k, v)
    return parts, (full.transpose(0, 1), reference.lse(scores).t())


def _in_kernel_form(part, case, base):
    v, s = part
    return v.to(case.torch_dtype), _strided((s / math.log(base)).to(_lse_dtype(case.torch_dtype)))


def _fold(merge, parts):
    state = parts[0]
    for part in parts[1:]:
        state = merge(*state, *part)
    return state


@prop("merge-equals-union", family="serving",
      statement="merging the partial attentions of a random partition of the keys (some parts empty, in shuffled order, "
                "LSEs strided) gives attention over all the keys: its output and its LSE",
      conventions=("merge",), cases=MERGE_CASES,
      # Tried first: one merge call, two heads of two queries, keys split 2 + 2 (seed 2): a wrong LSE shows at once
      examples=(Case(batch=(2,), n_q=2, n_kv=4, d_k=2, d_v=2, seed=2),),
      lesson=Lesson(unicode="lse = log Σᵢ exp(lseᵢ),  out = Σᵢ exp(lseᵢ − lse) outᵢ  =  attention over ∪ᵢ Kᵢ",
                    latex=r"\mathrm{lse} = \log \sum_i e^{\mathrm{lse}_i},\quad \mathrm{out} = \sum_i "
                          r"e^{\mathrm{lse}_i - \mathrm{lse}}\,\mathrm{out}_i",
                    check="Splits the keys into 2 to 4 parts (one empty when there are 3 or more), computes each "
                          "part's attention and LSE in float64, folds them with the kernel in shuffled order with "
                          "strided LSEs, and compares the output and the LSE with attention over every key.",
                    example="merge"))
def merge_equals_union(target, case):
    """merge((out_1, lse_1), ..., (out_P, lse_P)) = (attention over K_1 ∪ ... ∪ K_P, logsumexp of all the scores).

    Why: split-KV decoding, cascade attention and ring attention are only correct if merging is exact; an
    error in the LSE passes silently into every later merge. Catches: the merged LSE taken as the max (log of
    the rescaled sum forgotten), weights exp(lse_i) without subtracting the max (overflow), the LSE read with
    the wrong strides (vLLM PR #22003), an LSE base mixed up, NaN from an empty part.
    """
    base = target.base
    parts, (out_ref, lse_ref) = partial_states(case)
    v, s = _fold(target.merge, [_in_kernel_form(p, case, base) for p in parts])
    naive_v, naive_s = _fold(lambda *a: _same_dtype(*a, base), [_in_kernel_form(p, case, base) for p in parts])
    unit = eps(case.torch_dtype) * max(1.0, max(p[0].abs().max().item() for p in parts)) * (len(parts) + 1)
    call = f"{target.name} folded over {len(parts)} parts of {case.n_kv} keys (LSE base {target.behaviour()['lse-base']})"
    assert_within(max_error(v, out_ref), earned(max_error(naive_v, out_ref), unit),
                  what="max |merged out - attention over every key|", call=call, got=v.to(F64), expected_tensor=out_ref)
    lse_unit = eps(s.dtype) * max(1.0, lse_ref.abs().max().item()) * (len(parts) + 1)
    assert_within(max_error(s.to(F64) * math.log(base), lse_ref),
                  earned(max_error(naive_s.to(F64) * math.log(base), lse_ref), lse_unit),
                  what="max |merged LSE - logsumexp of every score| (natural log)", call=call,
                  got=(s.to(F64) * math.log(base)), expected_tensor=lse_ref,
                  cause=because("merge-lse-max"))


def _same_dtype(v_a, s_a, v_b, s_b, base):
    """An ordinary merge in the inputs' own dtypes (half precision accumulating in float32): the rounding a correct
    kernel shows, the noise floor of the budget."""
    acc = torch.promote_types(v_a.dtype, torch.float32)
    ln = math.log(base)
    s = torch.logaddexp(s_a * ln, s_b * ln)  # [T, H], natural log, in the LSE's dtype
    safe = torch.where(torch.isneginf(s), 0.0, s)
    w_a, w_b = torch.exp(s_a * ln - safe)[..., None].to(acc), torch.exp(s_b * ln - safe)[..., None].to(acc)
    return (w_a * v_a.to(acc) + w_b * v_b.to(acc)).to(v_a.dtype), (s / ln).to(s_a.dtype)


@prop("merge-empty-neutral", family="serving",
      statement="the empty state (0, -inf) is neutral in a merge, and two empty states merge to (0, -inf), not NaN",
      conventions=("merge",), cases=MERGE_CASES,
      lesson=Lesson(unicode="merge(x, (0, −∞)) = merge((0, −∞), x) = x,   merge((0, −∞), (0, −∞)) = (0, −∞)",
                    latex=r"\mathrm{merge}(x, (0, -\infty)) = x,\quad \mathrm{merge}((0, -\infty), (0, -\infty)) = "
                          r"(0, -\infty)",
                    check="Merges a random state with the empty one on either side (bitwise the same state back), "
                          "and the empty state with itself, rows mixed in one call.",
                    example="merge"))
def merge_empty_neutral(target, case):
    """merge(x, E) = merge(E, x) = x bitwise and merge(E, E) = E, for the empty state E = (0, -inf).

    Why: a split of the keys with no key in it (a short sequence over many splits, a fully masked chunk) is
    the empty state; it must change nothing. Catches: exp(-inf - (-inf)) = NaN when both sides are empty
    (FlashInfer #4051), a +inf or 0 LSE taken for "empty" (flash-attn's +inf for empty rows, the CPU flash
    op's 0: neither is neutral).
    """
    T, H, D = case.n_q, max(1, math.prod(case.batch)), case.d_v
    gen = torch.Generator().manual_seed(case.seed)
    v = torch.randn(T, H, D, generator=gen, dtype=F64).to(case.torch_dtype)  # [T, H, D]
    s = _strided((torch.rand(T, H, generator=gen, dtype=F64) * 6 - 3).to(_lse_dtype(case.torch_dtype)))  # [T, H]
    zero, empty = torch.zeros_like(v), torch.full_like(s, -math.inf)
    for label, (got_v, got_s), (want_v, want_s) in (
            ("merge(x, empty)", target.merge(v, s, zero, empty.clone()), (v, s)),
            ("merge(empty, x)", target.merge(zero.clone(), empty.clone(), v, s), (v, s)),
            ("merge(empty, empty)", target.merge(zero.clone(), empty.clone(), zero.clone(), empty.clone()), (zero, empty))):
        same = torch.equal(got_v, want_v) and torch.equal(got_s.to(want_s.dtype), want_s)
        if not same:
            bad = got_v.isnan().any() or got_s.isnan().any()
            fail(f"{'NaN' if bad else 'a different state'} (first row: v {got_v[0, 0].tolist()}, s {got_s[0, 0].item()})",
                 what=f"{label} over {T} x {H} rows", expected="x itself, bitwise" if label != "merge(empty, empty)"
                 else "the empty state (0, -inf)", call=f"{target.name}(v_a, s_a, v_b, s_b)",
                 cause=because("merge-empty-nan") if bad else "",
                 got=got_v[:, 0].to(F64), expected_tensor=want_v[:, 0].to(F64),
                 labels=(f"v of {label}, head 0", "v of x itself, head 0" if label != "merge(empty, empty)"
                         else "v of the empty state (zeros), head 0"))
