"""Mistake models of serving kernels, and the diagnosis that names one root for a serving target's failures.

A serving mistake is the wrong kernel itself, written as a change of the correct one
(attn_spec.targets.serving_decode.decode_reference): ``fn(call) -> (out, k_cache after, v_cache after)`` on
the inputs one recorded call got. The diagnosis replays each failing property on its minimal case with every
call kept (``DecodeTarget.log``), and names the mistake that reproduces every kept call of every failing
property (outputs within a few units in the last place of their dtype, NaN where the target has NaN, caches
equal), where the correct kernel does not.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

import torch

from attn_spec.diagnosis.roots import Diagnosis
from attn_spec.targets.serving_decode import decode_reference

SERVING_MISTAKES: dict[str, "ServingMistake"] = {}


@dataclass(frozen=True)
class ServingMistake:
    id: str
    convention: str
    fn: Callable
    sentence: str
    fix: str
    caught_by: tuple[str, ...]


def serving_mistake(id: str, *, convention: str, sentence: str, fix: str, caught_by):
    def register(fn):
        SERVING_MISTAKES[id] = ServingMistake(id, convention, fn, sentence, fix, tuple(caught_by))
        return fn
    return register


def _correct(c):
    return decode_reference(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k"], c["v"],
                            c["cache_leftpad"], causal=c["causal"], scale=c["scale"])


@serving_mistake("decode-causal-top-left", convention="decode",
                 sentence="causal is aligned top-left: new token i sees keys 0..i, not the keys up to n_keys - S_new + i",
                 fix="align causal bottom-right (SDPA: attn_mask=causal_lower_right(S_new, n_keys), not is_causal=True)",
                 caught_by=("decode-equals-full-causal",))
def causal_top_left(c):
    return decode_reference(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"], c["k"], c["v"],
                            c["cache_leftpad"], causal=c["causal"], scale=c["scale"], causal_alignment="top-left")


@serving_mistake("cache-tail-read", convention="decode",
                 sentence="every cache row is attended: the rows past cache_seqlens + S_new (a stale tail, the unfilled "
                          "end of the last page) are read as keys",
                 fix="attend only rows [cache_leftpad, cache_seqlens + S_new) of each element (slice or mask the rest)",
                 caught_by=("cache-outside-invariance", "decode-equals-full-causal"))
def cache_tail_read(c):
    _, _, k_after, v_after = _correct(c)  # appended where it must be, then the whole cache read
    full = torch.full_like(torch.as_tensor(c["cache_seqlens"]), c["k_cache"].shape[1])
    out, _, _, _ = decode_reference(c["q"], k_after, v_after, full, None, None, c["cache_leftpad"],
                                    causal=c["causal"], scale=c["scale"])
    return out, None, k_after, v_after


@serving_mistake("cache-append-off-by-one", convention="decode",
                 sentence="the new k, v are written one row late, at [cache_seqlens + 1, cache_seqlens + S_new + 1), and "
                          "the keys attended end one row late: row cache_seqlens keeps its stale value and is attended",
                 fix="write the new rows at cache_seqlens_b + t for t = 0 .. S_new - 1 and attend up to "
                     "cache_seqlens_b + S_new (exclusive)",
                 caught_by=("append-writes-exactly", "cache-outside-invariance", "decode-equals-full-causal"))
def cache_append_off_by_one(c):
    late = None if c["k"] is None else torch.as_tensor(c["cache_seqlens"]) + 1
    return decode_reference(c["q"], c["k_cache"], c["v_cache"], c["cache_seqlens"] if late is None else late,
                            c["k"], c["v"], c["cache_leftpad"], causal=c["causal"], scale=c["scale"])


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
    out, _, k_after, v_after = fn(call)
    dtype = call["q"].dtype
    return (_same(call["out"], out, dtype) and _same(call["k_after"], k_after, call["k_after"].dtype)
            and _same(call["v_after"], v_after, call["v_after"].dtype))


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
    if not all(calls.values()) or all(all(reproduces(_correct, c) for c in kept) for kept in calls.values()):
        return  # nothing kept, or the correct kernel reproduces it all: not a mistake of these models
    fits = [m for m in SERVING_MISTAKES.values() if m.convention == target.convention
            and all(reproduces(m.fn, c) for kept in calls.values() for c in kept)]
    if not fits:
        return
    m, order = fits[0], [r.id for r in report.properties]
    pids = [r.id for r in failing]
    root = next((p for p in m.caught_by if p in pids), pids[0])
    evidence = (f"reproduces every call of {len(pids)} failing propert{'y' if len(pids) == 1 else 'ies'} "
                f"({sum(len(kept) for kept in calls.values())} calls), outputs and caches")
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
            f"The wrong kernel, as the kit models it (a change of decode_reference)\n"
            + "".join(f"  {line}\n" for line in code.rstrip().splitlines()) +
            f"\nHow the kit recognises it\n  Each failing property is replayed on its minimal case with every call into "
            f"the kernel kept; {m.id} is named when it reproduces every kept call (outputs within a few units in the "
            f"last place, NaN where the kernel gave NaN, both caches afterwards) and the correct kernel does not. "
            f"Shown at: {', '.join(m.caught_by)}.\n")
