"""Fold symptoms into their cause: each root's model replayed on the other roots' failures.

The first pass names each failure on its own calls, judged as a correct implementation would be (float64
copies, a row with no allowed key left to the target's convention). Two bugs' stories then often turn out
to be one: without the 1/sqrt(d_k) scale a float16 case at d_k=128 saturates to one-hot, which another
model reads as a mask off by one; an inverted mask empties a one-key row, and the NaN that follows became
a root of its own ("NaN out of finite inputs"). So every named root's model is replayed on every other
root's calls three more ways, each a way the wrong code really runs:

- **at the target's own dtype**: the model computed in the inputs' dtype (float16 saturates as the target
  did), judged with the error budget widened by the model's own rounding there (|model at that dtype -
  model in float64|: a naive same-dtype implementation of the wrong formula calibrates it, as a correct
  one's calibrates the error budget);
- **with the emptied rows left NaN** (model.plain_softmax): the softmax as written, no convention, so that
  NaN spreads through a backward pass as the target's did;
- both at once.

A root B all of whose failures root A's model reproduces is a symptom of A: it is folded into A (A explains
more, B is no root). A generic root (no model names it) gives up each failure A's model reproduces. When the
fold is uncertain (A reproduces only some of a named root's failures, or B's model reproduces A's too), the
roots stay apart and their evidence says so. A root that explains another's failures is ranked above it.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from attn_spec.diagnosis import replay
from attn_spec.diagnosis.evidence import one_thread
from attn_spec.diagnosis.model import MISTAKES, plain_softmax
from attn_spec.diagnosis.predict import observed, predict

WAYS = (("", False, False), ("at the target's own dtype", True, False),
        ("with the rows the mask empties left NaN, as a plain softmax gives", False, True),
        ("at the target's own dtype, with the emptied rows left NaN", True, True))


def _spread(a, b) -> float:
    """max |a - b| over the entries finite on both sides (the model's own rounding at a lower dtype)."""
    worst = 0.0
    for x, y in zip(replay._parts(a.out), replay._parts(b.out)):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and x.is_floating_point():
            x, y = x.detach().double(), y.detach().double()
            both = torch.isfinite(x) & torch.isfinite(y)
            if both.any():
                worst = max(worst, (x - y)[both].abs().max().item())
    return worst


def _agrees(m, params, ev: replay.Evidence, i: int, own: bool, plain: bool) -> bool:
    call, seen, budgets = ev.calls[i], observed(ev.calls[i]), ev.budgets(i, m.precision)
    with plain_softmax() if plain else contextlib.nullcontext():
        pred = predict(m, call, params)
        if pred is None:
            return True  # the model says nothing of this call (a module's call for an attend model)
        if replay.mismatch(pred, seen, budgets) <= 1:
            return True
        if not own or m.exact or pred.error is not None:
            return False
        lowered = predict(dataclasses.replace(m, exact=True), call, params)
    if lowered is None or lowered.error is not None:
        return False
    widened = [b + 2 * _spread(lowered, pred) for b in budgets]
    return replay.mismatch(pred, seen, widened) <= 1 or replay.mismatch(lowered, seen, budgets) <= 1


def reproduced(mistake_id: str, params: dict, evidence) -> str | None:
    """How the model reproduces every call of one failure (``evidence``: a FailureEvidence): "" as first
    replayed, or the words for the way it runs (WAYS); None when it does not."""
    m = MISTAKES.get(mistake_id or "")
    if m is None or m.level == "stochastic" or not evidence.reproduced or evidence.nondeterministic:
        return None
    ev = replay.Evidence(evidence.calls)
    if not ev.calls:
        return None
    with one_thread():
        if not any(ev.telling(i) for i in range(len(ev.calls))):
            return None  # the correct formula reproduces these calls: they show no mistake to fold
        for words, own, plain in WAYS:
            if all(_agrees(m, params, ev, i, own, plain) for i in range(len(ev.calls))):
                return words
    return None


def fold(roots: list, evidences: dict, order: list[str], generic) -> list:
    """``roots`` with each root that another root's model reproduces folded into it, causes ranked first
    (``generic(d)``: a root that names nothing)."""
    roots = list(roots)
    explained: dict[int, int] = {}  # id(root) -> failures of other roots its model reproduces
    for a in [r for r in roots if r.mistake and not r.guess]:
        if a not in roots:
            continue
        for b in [r for r in roots if r is not a]:
            pids = [p for p in b.evidenced if p in evidences]
            ways = {p: reproduced(a.mistake, a.params, evidences[p]) for p in pids}
            got = [p for p in pids if ways[p] is not None]
            if not got:
                continue
            explained[id(a)] = explained.get(id(a), 0) + len(got)
            how = {p: ways[p] or "as replayed" for p in got}
            if generic(b):
                _move(a, b, how, order)
                if not b.evidenced:
                    _take_blocked(a, b, order)
                    roots.remove(b)
            elif len(got) < len(pids):
                b.evidence += (f"; {a.mistake}'s model (root {a.root}) reproduces {', '.join(got)} too, not "
                               f"{', '.join(p for p in pids if p not in got)}: not folded, the two may be one bug")
            elif b.mistake and all(reproduced(b.mistake, b.params, evidences[p]) is not None
                                   for p in a.evidenced if p in evidences):
                note = f"; each of {a.mistake} and {b.mistake} reproduces the other's failures: not folded (uncertain)"
                a.evidence += note
                b.evidence += note
            else:
                _move(a, b, how, order)
                _take_blocked(a, b, order)
                roots.remove(b)
    for a in roots:  # each shown at the first property made to catch its mistake
        designated = [p for p in getattr(MISTAKES.get(a.mistake or ""), "caught_by", ()) if p in a.explains]
        if a.folded and designated:
            a.root = designated[0]
    named = [r for r in roots if not generic(r)]
    named.sort(key=lambda r: -explained.get(id(r), 0))  # the cause above its symptoms (stable otherwise)
    return named + [r for r in roots if generic(r)]


def _move(a, b, ways: dict[str, str], order: list[str]) -> None:
    """The failures of root ``b`` in ``ways`` become ``a``'s, each with the words of how ``a``'s model reproduces it."""
    pids = list(ways)
    a.explains = sorted(set(a.explains) | set(pids), key=order.index)
    b.explains = [p for p in b.explains if p not in pids]
    b.unproven = [p for p in b.unproven if p not in pids]
    shown_at = b.root
    if b.explains and b.root not in b.explains:
        b.root = b.explains[0]
    was = f"named {b.mistake} on its own" if b.mistake else f"'{b.sentence}' on its own"
    by_way = {}
    for p, how in ways.items():
        by_way.setdefault(how, []).append(p)
    told = "; ".join(f"{', '.join(ps)} {how}" for how, ps in by_way.items())
    a.evidence += f"; also explains the failures of root {shown_at} ({was}): its model reproduces {told}"
    a.folded.append({"root": shown_at, "explains": pids, "how": dict(ways)})


def _take_blocked(a, b, order: list[str]) -> None:
    """What ``b`` still held (failures the catalog's order put there) goes with it into ``a``."""
    rest = [p for p in b.explains if p not in a.explains]
    a.explains = sorted(a.explains + rest, key=order.index)
    a.unproven += [p for p in rest if p not in a.unproven]
    a.not_judged += [p for p in b.not_judged if p not in a.not_judged]
