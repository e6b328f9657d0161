"""Mistake models of serving kernels, and the diagnosis that names one root for a serving target's failures.

A serving mistake is the wrong kernel itself, written as a change of the correct one
(attn_spec.targets.serving_decode.decode_reference, serving_merge.merge_reference): ``fn(call) -> {name: tensor}``
on the inputs one recorded call got, the outputs named as the call's record names them (decode: out, k_after,
v_after; merge: v, s). The diagnosis replays each failing property on its minimal case with every
call kept (``DecodeTarget.log``), and names the mistake that reproduces every kept call of every failing
property (outputs within a few units in the last place of their dtype, NaN where the target has NaN, caches
equal), where the correct kernel does not.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

import math

from attn_spec.diagnosis.roots import Diagnosis
from attn_spec.diagnosis.serving_paged import PAGED_MODELS, _correct_decode, _decoded  # shared with the paged models
from attn_spec.targets.serving_decode import decode_reference, gather_pages, scatter_pages
from attn_spec.targets.serving_merge import merge_reference
from attn_spec.targets.serving_varlen import varlen_reference

SERVING_MISTAKES: dict[str, "ServingMistake"] = {}


@dataclass(frozen=True)
class ServingMistake:
    id: str
    convention: str
    fn: Callable
    sentence: str
    fix: str
    caught_by: tuple[str, ...]
    paged: bool = False  # a decode model of paged caches itself (attn_spec.diagnosis.serving_paged)

    def apply(self, c) -> dict:
        """The wrong kernel's outputs on the recorded call ``c``. A model of contiguous caches replays a paged call on
        the cache its block table stands for (gathered in the table's order), the pages written back after."""
        table = c.get("block_table")
        if self.convention != "decode" or self.paged or table is None:
            return self.fn(c)
        pages = {name: c[name] for name in ("k_cache", "v_cache")}
        got = self.fn({**c, "block_table": None, **{name: gather_pages(t, table) for name, t in pages.items()}})
        return {**got, "k_after": scatter_pages(pages["k_cache"].to(torch.float64), got["k_after"], table),
                "v_after": scatter_pages(pages["v_cache"].to(torch.float64), got["v_after"], table)}


def serving_mistake(id: str, *, convention: str, sentence: str, fix: str, caught_by, paged: bool = False):
    def register(fn):
        SERVING_MISTAKES[id] = ServingMistake(id, convention, fn, sentence, fix, tuple(caught_by), paged)
        return fn
    return register


def _correct_merge(c):
    v, s = merge_reference(*c["inputs"], base=c["base"])
    return {"v": v, "s": s}


def _varlen(c, **change) -> dict:
    """varlen_reference on one recorded call, with ``change`` (cu_q, cu_k, alignment, key_shift) made to it."""
    args = {"cu_q": c["cu_q"], "cu_k": c["cu_k"], **change}
    out, _ = varlen_reference(c["q"], c["k"], c["v"], args.pop("cu_q"), args.pop("cu_k"), causal=c["causal"],
                              window=c["window"], scale=c["scale"], softcap=c["softcap"], **args)
    return {"out": out}


CORRECT = {"decode": _correct_decode, "merge": _correct_merge, "varlen": _varlen}


@serving_mistake("decode-causal-top-left", convention="decode",
                 sentence="causal is aligned top-left: new token i sees keys 0..i, not the keys up to n_keys - S_new + i",
                 fix="align causal bottom-right (SDPA: attn_mask=causal_lower_right(S_new, n_keys), not is_causal=True)",
                 caught_by=("decode-equals-full-causal",))
def causal_top_left(c):
    return _decoded(*decode_reference(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k"], c["v"],
                                      c["cache_leftpad"], causal=c["causal"], scale=c["scale"],
                                      causal_alignment="top-left"))


@serving_mistake("split-kv-unweighted-merge", convention="decode",
                 sentence="the partial outputs of the key chunks are averaged, not weighted by exp(lse_chunk - lse): "
                          "with num_splits > 1 a short chunk counts as much as a long one",
                 fix="merge the chunks as sum_c exp(lse_c - lse) o_c with lse = logsumexp over the chunks' lse_c",
                 caught_by=("split-kv-agree",))
def split_kv_unweighted_merge(c):
    right = _correct_decode(c)
    n = c.get("num_splits") or 1
    if n <= 1:
        return right
    q = c["q"].to("cpu", torch.float64)  # [B, S, H, D]
    S, H, D = q.shape[1:]
    scale = 1.0 / math.sqrt(D) if c["scale"] is None else float(c["scale"])
    ends = torch.as_tensor(c["cache_seqlens"]).cpu() + (0 if c["k"] is None else S)  # [B]
    out = right["out"].clone()  # [B, S, H, Dv]
    for b, L in enumerate(ends.tolist()):
        group = H // right["k_after"].shape[2]
        keys = right["k_after"][b, :L].repeat_interleave(group, 1)  # [L, H, D]
        values = right["v_after"][b, :L].repeat_interleave(group, 1)
        scores = scale * torch.einsum("shd,lhd->hsl", q[b], keys)  # [H, S, L]
        if c["causal"]:
            scores = scores.masked_fill(torch.arange(L)[None, :] > torch.arange(S)[:, None] + (L - S), -math.inf)
        size = max(1, math.ceil(L / n))
        parts = [torch.einsum("hsl,lhd->shd", torch.softmax(scores[..., i:i + size], dim=-1).nan_to_num(0.0),
                              values[i:i + size]) for i in range(0, L, size)]  # [S, H, Dv] each chunk's own
        out[b] = sum(parts) / len(parts)
    return {**right, "out": out}


@serving_mistake("cache-tail-read", convention="decode",
                 sentence="every cache row is attended: the rows past cache_seqlens + S_new (a stale tail, the unfilled "
                          "end of the last page) are read as keys",
                 fix="attend only rows [cache_leftpad, cache_seqlens + S_new) of each element (slice or mask the rest)",
                 caught_by=("cache-outside-invariance", "decode-equals-full-causal"))
def cache_tail_read(c):
    appended = _correct_decode(c)  # appended where it must be, then the whole cache read
    full = torch.full_like(torch.as_tensor(c["cache_seqlens"]), c["k_cache"].shape[1])
    out, _, _, _ = decode_reference(c["q"], appended["k_after"], appended["v_after"], full, None, None,
                                    c["cache_leftpad"], causal=c["causal"], scale=c["scale"])
    return {**appended, "out": out}


@serving_mistake("cache-append-off-by-one", convention="decode",
                 sentence="the new k, v are written one row late, at [cache_seqlens + 1, cache_seqlens + S_new + 1), and "
                          "the keys attended end one row late: row cache_seqlens keeps its stale value and is attended",
                 fix="write the new rows at cache_seqlens_b + t for t = 0 .. S_new - 1 and attend up to "
                     "cache_seqlens_b + S_new (exclusive)",
                 caught_by=("append-writes-exactly", "cache-outside-invariance", "decode-equals-full-causal"))
def cache_append_off_by_one(c):
    late = None if c["k"] is None else torch.as_tensor(c["cache_seqlens"]) + 1
    return _decoded(*decode_reference(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"] if late is None else late,
                                      c["k"], c["v"], c["cache_leftpad"], causal=c["causal"], scale=c["scale"]))


@serving_mistake("decode-chunk-unmasked", convention="decode",
                 sentence="with a cache that is not empty the kernel takes its one-token decode path: a chunk of several "
                          "new tokens gets no causal mask inside it, each new token sees the whole chunk",
                 fix="mask causally inside the chunk whatever the cache holds: new token i sees keys up to "
                     "cache_seqlens + i (bottom-right)",
                 caught_by=("chunked-prefill-equals-one-shot", "decode-equals-full-causal"))
def decode_chunk_unmasked(c):
    parts = [_decoded(*decode_reference(
        c["q"][b:b + 1], c["k_cache"][b:b + 1], c["v_cache"][b:b + 1], c["cache_seqlens"][b:b + 1],
        *(None if c[name] is None else c[name][b:b + 1] for name in ("k", "v", "cache_leftpad")),
        causal=c["causal"] and int(c["cache_seqlens"][b]) == 0, scale=c["scale"])) for b in range(c["q"].shape[0])]
    return {name: torch.cat([p[name] for p in parts]) for name in ("out", "k_after", "v_after")}


@serving_mistake("merge-empty-nan", convention="merge",
                 sentence="the merge subtracts the larger LSE without a guard: two empty states (LSE -inf) give "
                          "exp(-inf - (-inf)) = NaN instead of the empty state (0, -inf)",
                 fix="where both LSEs are -inf, return (0, -inf): weight 0 for each side (FlashInfer PR #4054)",
                 caught_by=("merge-empty-neutral", "merge-equals-union"))
def merge_empty_nan(c):
    v_a, s_a, v_b, s_b = (t.to(torch.float64) for t in c["inputs"])
    ln = math.log(c["base"])
    m = torch.maximum(s_a, s_b) * ln  # [T, H]: -inf when both are empty
    w_a, w_b = torch.exp(s_a * ln - m), torch.exp(s_b * ln - m)  # NaN when both are empty
    d = w_a + w_b
    return {"v": (w_a[..., None] * v_a + w_b[..., None] * v_b) / d[..., None], "s": (m + torch.log(d)) / ln}


@serving_mistake("merge-lse-max", convention="merge",
                 sentence="the merged LSE is the larger of the two, not their log-sum-exp: the output is weighted "
                          "right but the LSE passed on loses log(1 + exp(-|s_a - s_b|))",
                 fix="return s = logaddexp(s_a, s_b) (max + log of the sum of the rescaled weights)",
                 caught_by=("merge-equals-union",))
def merge_lse_max(c):
    merged = _correct_merge(c)
    return {**merged, "s": torch.maximum(*(t.to(torch.float64) for t in c["inputs"][1::2]))}


for _id, _fn, _words in PAGED_MODELS:  # the paged decode models, after the contiguous ones
    serving_mistake(_id, convention="decode", paged=True, **_words)(_fn)
@serving_mistake("varlen-causal-top-left", convention="varlen",
                 sentence="causal (and the window) is aligned top-left in each sequence: query i sees keys 0..i of its "
                          "sequence, not the keys up to i + n_k - n_q",
                 fix="align per sequence bottom-right: query i of a sequence of n_q queries over n_k keys sits at key "
                     "position i + n_k - n_q (flash-attn's construct_local_mask)",
                 caught_by=("varlen-equals-per-sequence",))
def varlen_causal_top_left(c):
    return _varlen(c, alignment="top-left")


@serving_mistake("varlen-segments-ignored", convention="varlen",
                 sentence="cu_seqlens is ignored: one attention over the whole packed batch (under causal, a triangle "
                          "over packed positions), so every query attends the keys of other sequences",
                 fix="attend sequence b's queries to keys [cu_seqlens_k[b], cu_seqlens_k[b + 1]) only: one call per "
                     "segment, or a block-diagonal (document) mask, with causal per sequence",
                 caught_by=("segment-isolation", "varlen-equals-per-sequence", "varlen-degenerate-lengths"))
def varlen_segments_ignored(c):
    T_q, T_k = c["q"].shape[0], c["k"].shape[0]
    return _varlen(c, cu_q=[0, T_q], cu_k=[0, T_k], alignment="top-left")


@serving_mistake("varlen-cu-seqlens-off-by-one", convention="varlen",
                 sentence="the key offsets are read one row late: sequence b attends rows [cu_seqlens_k[b] + 1, "
                          "cu_seqlens_k[b + 1] + 1), losing its first key and taking the next sequence's first",
                 fix="sequence b's keys are rows cu_seqlens_k[b] (inclusive) to cu_seqlens_k[b + 1] (exclusive)",
                 caught_by=("varlen-equals-per-sequence", "segment-isolation", "varlen-degenerate-lengths"))
def varlen_cu_seqlens_off_by_one(c):
    return _varlen(c, key_shift=1)


@serving_mistake("varlen-empty-row-nan", convention="varlen",
                 sentence="a query with no key to attend (a sequence with no keys, or causal over fewer keys than "
                          "queries) gets NaN: the softmax of an empty row, exp(-inf - max) / 0, is not guarded",
                 fix="give a row with no key the output 0 (and LSE -inf): weights 0 where the row's max is -inf",
                 caught_by=("varlen-degenerate-lengths", "varlen-equals-per-sequence"))
def varlen_empty_row_nan(c):
    out = _varlen(c)["out"]
    _, lse = varlen_reference(c["q"], c["k"], c["v"], c["cu_q"], c["cu_k"], causal=c["causal"], window=c["window"],
                              scale=c["scale"], softcap=c["softcap"])  # [H, T_q]
    return {"out": out.masked_fill(torch.isneginf(lse).t()[..., None], math.nan)}


def _same(got, model, dtype) -> bool:
    """``got`` (the target's) equals ``model`` (float64) within a few units in the last place of ``dtype``, NaN
    where the target has NaN."""
    got, model = got.detach().to("cpu", torch.float64), model.detach().to("cpu", torch.float64)
    if got.shape != model.shape or not torch.equal(got.isnan(), model.isnan()):
        return False
    finite = ~got.isnan()
    scale = max(1.0, model[finite].abs().max().item()) if finite.any() else 1.0
    return bool(((got - model)[finite].abs() <= 64 * torch.finfo(dtype).eps * scale).all())


def reproduces(fn, call) -> bool:
    """The model's outputs equal the recorded ones, each within a few units in the last place of its dtype (a model
    that raises on the call, one past a block table say, does not reproduce it: the kernel returned)."""
    try:
        outputs = fn(call)
    except (ValueError, IndexError, RuntimeError):  # a length past the cache or its block table, say
        return False
    return all(_same(call[name], model, call[name].dtype) for name, model in outputs.items())


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
    fits = [m for m in SERVING_MISTAKES.values() if m.convention == target.convention and (paged or not m.paged)
            and all(reproduces(m.apply, c) for kept in calls.values() for c in kept)]
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


def lesson(mistake_id: str) -> str:
    """``attn-spec explain ID`` for a serving mistake: what the wrong kernel does, the fix, its code, how it is found."""
    m = SERVING_MISTAKES[mistake_id]
    source = inspect.getsource(m.fn)
    code = source[source.index("\ndef ") + 1:]  # without the decorator
    return (f"{m.id} ({m.convention} convention)\n\nWhat the wrong kernel does\n  {m.sentence}\n\nThe fix\n  {m.fix}\n\n"
            f"The wrong kernel, as the kit models it (a change of the correct kernel's reference)\n"
            + "".join(f"  {line}\n" for line in code.rstrip().splitlines()) +
            f"\nHow the kit recognises it\n  Each failing property is replayed on its minimal case with every call into "
            f"the kernel kept; {m.id} is named when it reproduces every kept call (outputs within a few units in the "
            f"last place, NaN where the kernel gave NaN, both caches afterwards) and the correct kernel does not. "
            f"Shown at: {', '.join(m.caught_by)}.\n")

