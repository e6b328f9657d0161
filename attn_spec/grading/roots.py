"""Diagnosis inside grading: the child names each failure's root, the grader re-checks every root it uses.

After a convention's properties ran, the grader sends the failures (property ids and minimal cases)
to the submission's child, which replays them next to the submission, recording every call, and
fits the mistake models as ``attn-spec check`` does (sandbox._diagnose). The roots come back as
plain JSON: a mistake id, its parameters, the failures it explains. Nothing is unpickled.

The child shares its process with the student's code, which can change the diagnosis there, so
a root is a claim. The grader keeps only what it has checked itself: for each failure a root claims,
it replays the property on its minimal case through the wire (the grader's own inputs, the
submission's outputs as plain tensors, recorded by the grader) and fits that one mistake model,
with those parameters, to the calls (attn_spec.diagnosis.replay.fit). A failure the model does not
reproduce is not explained by it; a root none of whose failures is reproduced is dropped; a mistake
id or parameter outside the kit's catalog is refused. Every sentence, fix and lesson is the kit's
own text for that mistake. Searching the catalog (dozens of models) happens in the child; checking
one model is cheap.
"""
from __future__ import annotations

import math
from dataclasses import replace

from attn_spec.diagnosis import MISTAKES
from attn_spec.diagnosis import replay
from attn_spec.diagnosis.evidence import one_thread
from attn_spec.targets.record import record
from attn_spec.diagnosis.roots import Diagnosis
from attn_spec.diagnosis.run import case_of, replayable
from attn_spec.errors import Failure
from attn_spec.properties import catalog

MAX_ROOTS = 32  # roots read from one reply
DIAGNOSIS_SECONDS = 60  # for the child's diagnosis of one convention's failures


def diagnose_rows(child, target, conv: str, rows, dtypes, device: str) -> list[Diagnosis]:
    """The checked roots of the failing ``rows`` (one convention's graded rows, checked on ``dtypes`` and
    ``device`` first); the rows they explain
    point at them (``blocked_by``, ``explained_by``, ``cause``). Raises Stopped as any call does."""
    failing = {r.id: r for r in rows if r.status == "fail" and r.id in catalog()}
    cases = {pid: case_of(r) for pid, r in failing.items()}
    sent = [{"id": pid, "case": failing[pid].counterexample["case"], "vacuous": bool(failing[pid].vacuous)}
            for pid, case in cases.items() if case is not None and replayable(case)]
    if not sent:
        return []
    child.read_hits()
    before = set(child.forbidden)
    try:
        header = {"op": "diagnose", "convention": conv, "failures": sent, "dtypes": list(dtypes), "device": device}
        reply, _ = child.request(header, [],
                                 "diagnosing its failures", seconds=DIAGNOSIS_SECONDS)
    finally:
        child.read_hits()
        child.forbidden = before  # the kit's diagnosis calls the reference there, which the tripwires report
    claims = reply.get("roots") if isinstance(reply.get("roots"), list) else []
    roots, taken = [], set()
    order = [r.id for r in rows]
    replays = [2 * len(failing)]  # re-checks allowed: a reply full of false claims cannot make the grader loop
    for claim in claims[:MAX_ROOTS]:
        root = _checked(claim, failing, cases, target, taken, order, replays)
        if root is not None:
            roots.append(root)
            taken |= set(root.explains)
    for d in roots:
        for pid in d.explains:
            row = failing[pid]
            row.explained_by, row.cause = d.mistake, d.sentence
            row.blocked_by = None if pid == d.root else d.root
    return roots


def _checked(claim, failing: dict, cases: dict, target, taken: set, order: list, replays=None) -> Diagnosis | None:
    """The root ``claim`` names, as the grader's own Diagnosis, on the failures it reproduces; or None."""
    if not isinstance(claim, dict) or claim.get("guess") is not False:
        return None
    m = MISTAKES.get(claim.get("mistake")) if isinstance(claim.get("mistake"), str) else None
    params = _params(claim.get("params"), m) if m is not None else None
    explains = claim.get("explains")
    if params is None or not isinstance(explains, list):
        return None
    wanted = [p for p in dict.fromkeys(x for x in explains if isinstance(x, str))
              if p in failing and p not in taken and not failing[p].vacuous and cases.get(p) is not None]
    model = replace(m, params=(params,)) if m.params else m  # exactly the parameters claimed
    shown, calls = [], 0
    replays = [len(wanted)] if replays is None else replays
    for pid in sorted(wanted, key=order.index):
        if replays[0] <= 0:
            break
        replays[0] -= 1
        reproduced = _reproduces(model, pid, target, cases[pid])
        if reproduced:
            shown.append(pid)
            calls += reproduced
    if not shown:
        return None
    root = next((p for p in m.caught_by if p in shown), shown[0])
    evidence = (f"reproduces every call of {len(shown)} failing propert{'y' if len(shown) == 1 else 'ies'} "
                f"({calls} call{'' if calls == 1 else 's'}) within the error budget, replayed by the grader")
    return Diagnosis(root, m.id, m.describe(params), m.fix_for(params), shown, evidence, params=params)


def _reproduces(model, pid: str, target, case) -> int:
    """Calls reproduced when the property, replayed on its case through the wire, fails again and
    ``model`` reproduces every one of its calls (0 otherwise)."""
    calls, raised = record(catalog()[pid].fn, target, case)
    if not isinstance(raised, Failure):
        return 0
    with one_thread():
        fit = replay.fit(model, replay.Evidence(calls))
    return fit.calls if fit is not None else 0


def _params(value, m) -> dict | None:
    """The parameters claimed for ``m``, if the catalog allows them: one of its settings, or its one
    fitted number within its range; None otherwise."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        return None
    if isinstance(m.params, dict):
        if set(value) != set(m.params):
            return None
        for name, (lo, hi, _) in m.params.items():
            x = value[name]
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo <= x <= hi:
                return None
        return {k: float(v) for k, v in value.items()}
    settings = [dict(s) for s in m.params] or [{}]
    return next((dict(s) for s in settings if s == value), None)
