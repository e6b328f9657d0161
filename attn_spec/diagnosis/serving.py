"""Mistake models of serving kernels, and the diagnosis that names one root for a serving target's failures.

A serving mistake is a catalog entry (``@mistake``, level ``decode``, ``merge`` or ``varlen``: the convention it
models) whose function is the wrong kernel itself, written as a change of the correct one
(attn_spec.diagnosis.serving_correct): ``fn(call) -> {name: tensor}`` on the inputs one recorded call got, the
outputs named as the call's record names them (decode: out, k_after, v_after; merge: v, s; varlen: out). The diagnosis replays each failing property on its minimal case with every
call kept (``DecodeTarget.log``), and names the mistake that reproduces every kept call of every failing
property (outputs within a few units in the last place of their dtype, NaN where the target has NaN, caches
equal), where the correct kernel does not.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.diagnosis.model import MISTAKES, Mistake, mistake
from attn_spec.diagnosis.roots import Diagnosis
from attn_spec.diagnosis.serving_correct import CORRECT, correct_decode, correct_merge, correct_varlen, element
from attn_spec.serving_reference import gather_pages, scatter_pages, varlen_reference


def outputs(m: Mistake, c) -> dict:
    """The wrong kernel's outputs on the recorded call ``c``. A decode model of contiguous caches replays a paged call
    on the cache its block table stands for (gathered in the table's order), the pages written back after."""
    table = c.get("block_table")
    if m.level != "decode" or m.paged or table is None:
        return m.fn(c)
    pages = {name: c[name] for name in ("k_cache", "v_cache")}
    got = m.fn({**c, "block_table": None, **{name: gather_pages(t, table) for name, t in pages.items()}})
    return {**got, "k_after": scatter_pages(pages["k_cache"].to(torch.float64), got["k_after"], table),
            "v_after": scatter_pages(pages["v_cache"].to(torch.float64), got["v_after"], table)}


@mistake("decode-causal-top-left", level="decode", family="serving", caught_by=("decode-equals-full-causal",),
         sentence="causal is aligned top-left: new token i sees keys 0..i, not the keys up to n_keys - S_new + i",
         fix="align causal bottom-right (SDPA: attn_mask=causal_lower_right(S_new, n_keys), not is_causal=True)")
def causal_top_left(c):
    return correct_decode(c, causal_alignment="top-left")


@mistake("split-kv-unweighted-merge", level="decode", family="serving", caught_by=("split-kv-agree",),
         sentence="the partial outputs of the key chunks are averaged, not weighted by exp(lse_chunk - lse): "
                  "with num_splits > 1 a short chunk counts as much as a long one",
         fix="merge the chunks as sum_c exp(lse_c - lse) o_c with lse = logsumexp over the chunks' lse_c")
def split_kv_unweighted_merge(c):
    right = correct_decode(c)
    n = c.get("num_splits") or 1
    if n <= 1:
        return right
    q = c["q"].to("cpu", torch.float64).transpose(1, 2)  # [B, H, S, D]
    S, H = q.shape[2], q.shape[1]
    ends = torch.as_tensor(c["cache_seqlens"]).cpu() + (0 if c["k"] is None else S)  # [B]
    out = right["out"].clone()  # [B, S, H, Dv]
    for b, L in enumerate(ends.tolist()):
        group = H // right["k_after"].shape[2]
        keys, values = (reference.repeat_kv(right[name][b, :L], group, 1).transpose(0, 1)
                        for name in ("k_after", "v_after"))  # [H, L, D]
        mask = reference.causal_mask(S, L, alignment="bottom-right") if c["causal"] else torch.ones(S, L, dtype=bool)
        size = max(1, math.ceil(L / n))
        parts = [reference.attention(q[b], keys[:, i:i + size], values[:, i:i + size], mask[:, i:i + size],
                                     scale=c["scale"])[0] for i in range(0, L, size)]  # [H, S, Dv]: each chunk's own
        out[b] = (sum(parts) / len(parts)).transpose(0, 1)
    return {**right, "out": out}


@mistake("cache-tail-read", level="decode", family="serving",
         caught_by=("cache-outside-invariance", "decode-equals-full-causal"),
         sentence="every cache row is attended: the rows past cache_seqlens + S_new (a stale tail, the unfilled "
                  "end of the last page) are read as keys",
         fix="attend only rows [cache_leftpad, cache_seqlens + S_new) of each element (slice or mask the rest)")
def cache_tail_read(c):
    appended = correct_decode(c)  # appended where it must be, then the whole cache read
    full = torch.full_like(torch.as_tensor(c["cache_seqlens"]), c["k_cache"].shape[1])
    read = correct_decode({**c, "k_cache": appended["k_after"], "v_cache": appended["v_after"], "k": None, "v": None},
                          cache_seqlens=full)
    return {**appended, "out": read["out"]}


@mistake("cache-append-off-by-one", level="decode", family="serving",
         caught_by=("append-writes-exactly", "cache-outside-invariance", "decode-equals-full-causal"),
         sentence="the new k, v are written one row late, at [cache_seqlens + 1, cache_seqlens + S_new + 1), and "
                  "the keys attended end one row late: row cache_seqlens keeps its stale value and is attended",
         fix="write the new rows at cache_seqlens_b + t for t = 0 .. S_new - 1 and attend up to "
             "cache_seqlens_b + S_new (exclusive)")
def cache_append_off_by_one(c):
    if c["k"] is None:
        return correct_decode(c)
    return correct_decode(c, cache_seqlens=torch.as_tensor(c["cache_seqlens"]) + 1)


@mistake("decode-chunk-unmasked", level="decode", family="serving",
         caught_by=("chunked-prefill-equals-one-shot", "decode-equals-full-causal"),
         sentence="with a cache that is not empty the kernel takes its one-token decode path: a chunk of several "
                  "new tokens gets no causal mask inside it, each new token sees the whole chunk",
         fix="mask causally inside the chunk whatever the cache holds: new token i sees keys up to "
             "cache_seqlens + i (bottom-right)")
def decode_chunk_unmasked(c):
    parts = [correct_decode(element(c, b), causal=c["causal"] and int(c["cache_seqlens"][b]) == 0)
             for b in range(c["q"].shape[0])]
    return {name: torch.cat([p[name] for p in parts]) for name in ("out", "k_after", "v_after")}


@mistake("merge-empty-nan", level="merge", family="serving", caught_by=("merge-empty-neutral", "merge-equals-union"),
         sentence="the merge subtracts the larger LSE without a guard: two empty states (LSE -inf) give "
                  "exp(-inf - (-inf)) = NaN instead of the empty state (0, -inf)",
         fix="where both LSEs are -inf, return (0, -inf): weight 0 for each side (FlashInfer PR #4054)")
def merge_empty_nan(c):
    v_a, s_a, v_b, s_b = (t.to(torch.float64) for t in c["inputs"])
    ln = math.log(c["base"])
    m = torch.maximum(s_a, s_b) * ln  # [T, H]: -inf when both are empty
    w_a, w_b = torch.exp(s_a * ln - m), torch.exp(s_b * ln - m)  # NaN when both are empty
    d = w_a + w_b
    return {"v": (w_a[..., None] * v_a + w_b[..., None] * v_b) / d[..., None], "s": (m + torch.log(d)) / ln}


@mistake("merge-lse-max", level="merge", family="serving", caught_by=("merge-equals-union",),
         sentence="the merged LSE is the larger of the two, not their log-sum-exp: the output is weighted "
                  "right but the LSE passed on loses log(1 + exp(-|s_a - s_b|))",
         fix="return s = logaddexp(s_a, s_b) (max + log of the sum of the rescaled weights)")
def merge_lse_max(c):
    merged = correct_merge(c)
    return {**merged, "s": torch.maximum(*(t.to(torch.float64) for t in c["inputs"][1::2]))}


@mistake("varlen-causal-top-left", level="varlen", family="serving", caught_by=("varlen-equals-per-sequence",),
         sentence="causal (and the window) is aligned top-left in each sequence: query i sees keys 0..i of its "
                  "sequence, not the keys up to i + n_k - n_q",
         fix="align per sequence bottom-right: query i of a sequence of n_q queries over n_k keys sits at key "
             "position i + n_k - n_q (flash-attn's construct_local_mask)")
def varlen_causal_top_left(c):
    return correct_varlen(c, alignment="top-left")


@mistake("varlen-segments-ignored", level="varlen", family="serving",
         caught_by=("segment-isolation", "varlen-equals-per-sequence", "varlen-degenerate-lengths"),
         sentence="cu_seqlens is ignored: one attention over the whole packed batch (under causal, a triangle "
                  "over packed positions), so every query attends the keys of other sequences",
         fix="attend sequence b's queries to keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]) only: one call per "
             "segment, or a block-diagonal (document) mask, with causal per sequence")
def varlen_segments_ignored(c):
    T_q, T_k = c["q"].shape[0], c["k"].shape[0]
    return correct_varlen(c, cu_q=[0, T_q], cu_k=[0, T_k], alignment="top-left")


@mistake("varlen-cu-seqlens-off-by-one", level="varlen", family="serving",
         caught_by=("varlen-equals-per-sequence", "segment-isolation", "varlen-degenerate-lengths"),
         sentence="the key offsets are read one row late: sequence b attends rows [cu_seqlens_k[b] + 1, "
                  "cu_seqlens_k[b + 1] + 1), losing its first key and taking the next sequence's first",
         fix="sequence b's keys are rows cu_seqlens_k[b] (inclusive) to cu_seqlens_k[b + 1] (exclusive)")
def varlen_cu_seqlens_off_by_one(c):
    return correct_varlen(c, key_shift=1)


@mistake("varlen-empty-row-nan", level="varlen", family="serving",
         caught_by=("varlen-degenerate-lengths", "varlen-equals-per-sequence"),
         sentence="a query with no key to attend (a sequence with no keys, or causal over fewer keys than "
                  "queries) gets NaN: the softmax of an empty row, exp(-inf - max) / 0, is not guarded",
         fix="give a row with no key the output 0 (and LSE -inf): weights 0 where the row's max is -inf")
def varlen_empty_row_nan(c):
    out, lse = varlen_reference(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], causal=c["causal"], window=c["window"],
                                scale=c["scale"], softcap=c["softcap"])  # [T_q, H, Dv], [H, T_q]
    return {"out": out.masked_fill(torch.isneginf(lse).t()[..., None], math.nan)}


@mistake("varlen-softcap-ignored", level="varlen", family="serving", caught_by=("varlen-equals-per-sequence",),
         sentence="the softcap argument is ignored: scores are not capped to c tanh(s / c), so large scores keep "
                  "their full weight",
         fix="cap the scaled scores before the mask and the softmax: s = softcap * tanh(s / softcap) (flash-attn's "
             "softcap; 0 means no cap)")
def varlen_softcap_ignored(c):
    return correct_varlen(c, softcap=None)


@mistake("varlen-kv-heads-tiled", level="varlen", family="serving",
         caught_by=("varlen-equals-per-sequence", "varlen-degenerate-lengths"),
         sentence="grouped K/V heads are tiled (query head h reads K/V head h % H_kv, repeat) instead of grouped "
                  "(h // g, repeat_interleave, as flash-attn reads them)",
         fix="query head h attends K/V head h // (H / H_kv): k.repeat_interleave(H // H_kv, dim=1), or index the "
             "K/V head as h // g in the kernel")
def varlen_kv_heads_tiled(c):
    return correct_varlen(c, grouping="tiled")


def _same(got, model, dtype) -> bool:
    """``got`` (the target's) equals ``model`` (float64) within a few units in the last place of ``dtype``, NaN
    where the target has NaN."""
    got, model = got.detach().to("cpu", torch.float64), model.detach().to("cpu", torch.float64)
    if got.shape != model.shape or not torch.equal(got.isnan(), model.isnan()):
        return False
    infinite = got.isinf() | model.isinf()  # an LSE of -inf (no key) or +inf (overflow): the same one, exactly
    if not torch.equal(got[infinite], model[infinite]):
        return False
    finite = ~got.isnan() & ~infinite
    scale = max(1.0, model[finite].abs().max().item()) if finite.any() else 1.0
    return bool(((got - model)[finite].abs() <= 64 * torch.finfo(dtype).eps * scale).all())


def reproduces(fn, call) -> bool:
    """The model's outputs equal the recorded ones, each within a few units in the last place of its dtype (a model
    that raises on the call, one past a block table say, does not reproduce it: the kernel returned)."""
    try:
        outputs = fn(call)
    except (ValueError, IndexError, RuntimeError):  # a length past the cache or its block table, say
        return False
    return all(_same(call[name], model, call[name].dtype) for name, model in outputs.items()
               if model is not None and call.get(name) is not None)  # an LSE only where the call returned one


def replay(target, prop, case) -> list[dict]:
    """Every call of ``target`` while ``prop`` runs on ``case`` again (its failure is expected, and dropped)."""
    target.log = []
    try:
        prop.fn(target, case)
    except Exception:  # noqa: BLE001 - the failure being diagnosed, or the target's exception
        pass
    finally:
        calls, target.log = target.log, None
    return calls


def diagnose_serving(target, report, registry) -> None:
    """Fill ``report.diagnoses`` with the one serving mistake that reproduces every failing property's calls."""
    failing = [r for r in report.properties if r.status == "fail" and r.id in registry
               and getattr(r, "case", None) is not None]
    if not failing or not hasattr(target, "log"):
        return
    calls = {r.id: replay(target, registry[r.id], r.case) for r in failing}
    correct = CORRECT[target.convention]
    if not all(calls.values()) or all(all(reproduces(correct, c) for c in kept) for kept in calls.values()):
        return  # nothing kept, or the correct kernel reproduces it all: not a mistake of these models
    paged = "block_table" in getattr(target, "accepts", ())  # a kernel that takes no block table has no pages
    fits = [m for m in MISTAKES.values() if m.level == target.convention and (paged or not m.paged)
            and all(reproduces(lambda call: outputs(m, call), c) for kept in calls.values() for c in kept)]
    if not fits:
        return
    m, order = fits[0], [r.id for r in report.properties]
    pids = [r.id for r in failing]
    root = next((p for p in m.caught_by if p in pids), pids[0])
    evidence = (f"reproduces every call of {len(pids)} failing propert{'y' if len(pids) == 1 else 'ies'} "
                f"({sum(len(kept) for kept in calls.values())} calls), every output")
    if len(fits) > 1:
        evidence += f"; also consistent with: {', '.join(f.id for f in fits[1:])}"
    report.diagnoses = [Diagnosis(root, m.id, m.sentence, m.fix, sorted(pids, key=order.index), evidence)]
    for r in failing:
        r.blocked_by = None if r.id == root else root
        r.cause = m.sentence
