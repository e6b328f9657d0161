"""Diagnose a target's failures: replay each one, fit the mistake models, group them by root."""
from __future__ import annotations

import math
import time

import torch

from attn_spec.checking import chunked
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.diagnosis.evidence import gather
from attn_spec.diagnosis.model import MISTAKES
from attn_spec.diagnosis.passing import Consistency, keep_consistent, passing_calls
from attn_spec.diagnosis import fits
from attn_spec.diagnosis.discriminate import separate_all
from attn_spec.diagnosis.fold import fold
from attn_spec.diagnosis.roots import Diagnosis, generic, group, settle
from attn_spec.diagnosis.serving import diagnose_serving
from attn_spec.targets.base import conventions


def case_of(result):
    """The minimal failing case of a result: kept by the runner, or rebuilt from its counterexample."""
    case = getattr(result, "case", None)
    if case is not None or not result.counterexample:
        return case
    fields = dict(result.counterexample["case"])
    if "batch" in fields:
        fields["batch"] = tuple(fields["batch"])
    return (MhaCase if "d_model" in fields else Case)(**fields)


def replayable(case) -> bool:
    """The mistake models replay a case in float64 on the CPU, each on all of its scores at once: they are
    made for minimal cases. A case of a fixed shape whose scores take more than one chunk of the chunked
    reference (attn_spec.checking.chunked) is not replayed (at 10k keys that took over 10 minutes): its
    failure keeps the cause its property found on a few of its rows."""
    scores = math.prod(getattr(case, "batch", ())) * case.n_q * case.n_kv  # [..., Tq, Tk]
    return 8 * scores <= chunked.CHUNK_BYTES["cpu"]


def diagnose(target, results, registry) -> list[Diagnosis]:
    """The roots of the failing ``results`` of ``target`` (``registry``: property id -> Property)."""
    order = [r.id for r in results]
    failures = [r for r in results if r.status == "fail" and r.id in registry]
    # A vacuous failure (the property would have held only because the output ignores its inputs) is
    # no evidence of a mistake of its own: it joins the root of the others (matches-reference's first).
    vacuous = [r.id for r in failures if getattr(r, "vacuous", False)]
    if len(vacuous) < len(failures):
        failures = [r for r in failures if r.id not in vacuous]
    else:
        vacuous = []
    evidences, shortlist = {}, []
    for r in failures:
        case = case_of(r)
        if case is not None and replayable(case) and not getattr(r, "hung", False):  # a replay of a hang would wait out its deadline
            evidences[r.id] = gather(r.id, registry[r.id].fn, target, case, shortlist=shortlist)
            shortlist += [f.mistake.id for f in evidences[r.id].fits if f.mistake.id not in shortlist]
    consistency = Consistency(passing_calls(target, results, registry, replayable) if evidences else {})
    every_fit = {pid: list(ev.fits) for pid, ev in evidences.items()}
    dropped = keep_consistent(evidences, consistency)
    after = {pid: registry[pid].after for pid in registry}
    roots = group([r.id for r in failures], evidences, order=order, after=after, target=target,
                  mistakes=list(MISTAKES.values()))
    roots = fold(roots, evidences, order, generic)  # a root another's model reproduces is a symptom of it
    roots = separate_all(roots, evidences, target)  # a second probe where tied models fit every failing call
    on_qkv = target.convention in conventions(kind="attention", multihead=False)  # attention on Q, K, V directly
    roots = settle(roots, order, measure=lambda: fits.measure(target) if on_qkv else None)
    if dropped and not any(d.named for d in roots):  # one model for every failure, though it contradicts a pass?
        for pid, ev in evidences.items():
            ev.fits = every_fit[pid]
        alone = group([r.id for r in failures], evidences, order=order, after=after, target=target,
                      mistakes=list(MISTAKES.values()))
        if len(alone) == 1 and alone[0].named:
            roots = alone
    for root in roots:
        judge_against_passing(root, consistency)
        root.not_judged = [p for p in root.explains if p != root.root and p in evidences and _not_judged(evidences[p])]
    if vacuous and roots:
        home = next((d for d in roots if "matches-reference" in d.explains), roots[0])
        home.explains = sorted(home.explains + vacuous, key=order.index)
        home.unproven += vacuous  # vacuous: no evidence of a mistake of their own
    return roots


def _not_judged(ev) -> bool:
    """Did the failure stop before its property's relation was judged (the target raised, or returned no tensor)?"""
    return ev.crash is not None or any(c.kind in ("attend", "multihead") and c.error is None and c.kept
                                       and not isinstance(c.out, torch.Tensor) for c in ev.calls)


def judge_against_passing(root: Diagnosis, consistency: Consistency) -> None:
    """Mark ``root`` consistent with the passing properties or not (a guess may contradict one)."""
    m = MISTAKES.get(root.mistake or "")
    against = consistency.contradicted(m, root.params) if m is not None else []
    root.consistent_with_passing = not against
    if against:
        root.evidence += (f"; it contradicts {', '.join(against)}, which passed: the mistake holds on some inputs only "
                          f"(no model in the catalog agrees with those too)")
    elif m is not None and consistency.checked():
        root.evidence += f"; it agrees with the {len(consistency.passing)} passing properties' recorded calls"


def diagnose_one(target, result, registry, *, shortlist=()) -> Diagnosis | None:
    """The root of one failing result on its own (pytest items, ``check_property``), or None."""
    case = case_of(result)
    if result.status != "fail" or case is None or not replayable(case) or result.id not in registry \
            or getattr(result, "hung", False):
        return None
    evidence = gather(result.id, registry[result.id].fn, target, case, shortlist=shortlist)
    roots = group([result.id], {result.id: evidence}, order=[result.id], after={}, target=target,
                  mistakes=list(MISTAKES.values()))
    return roots[0] if roots else None


def diagnose_report(target, report, registry) -> None:
    """Fill ``report.diagnoses`` and make each explained failure point at its root (``blocked_by``, ``cause``)."""
    report.diagnoses = diagnose(target, report.properties, registry)
    by_id = {r.id: r for r in report.properties}
    for d in report.diagnoses:
        for pid in d.explains:
            result = by_id[pid]
            result.blocked_by = None if pid == d.root else d.root
            if d.named:
                result.cause = d.sentence


def diagnose_target(target, report, registry) -> None:
    """The roots of a checked target's failures, in its report: an attention's by the mistake catalog (the
    time it took in ``report.diagnosis_seconds``), a serving kernel's by its own models, replayed on its calls."""
    if not any(r.status == "fail" and r.id in registry for r in report.properties):
        return
    if target.is_attention:
        start = time.perf_counter()
        diagnose_report(target, report, registry)
        report.diagnosis_seconds = time.perf_counter() - start
    elif target.convention in conventions(kind="serving"):
        diagnose_serving(target, report, registry)
