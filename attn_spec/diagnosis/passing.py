"""What passed is evidence too: a mistake model is named only if it agrees with the properties that passed.

A model that reproduces every call of a failure can still be the wrong story: "the weights are
log_softmax(scores)" while ``rows-sum-to-one`` passed. Each passing property's first explicit example
is replayed once with its calls kept (the target passed it: its outputs there are right by the
property's relation), and a model is consistent with it when it predicts what the target returned on
those calls, within the same error budget as for a failure. A model that predicts otherwise on a
passing call contradicts what was measured and is not named.
"""
from __future__ import annotations

import dataclasses

import torch

from attn_spec.diagnosis import replay
from attn_spec.diagnosis.evidence import one_thread
from attn_spec.targets.record import record
from attn_spec.diagnosis.predict import predict


CHECKED = ("function", "module")  # conventions whose calls the kit makes as is (the ecosystem's are translated)


def passing_calls(target, results, registry, replayable) -> dict[str, replay.Evidence]:
    """property id -> the recorded calls of one example it passed on (``replayable(case)``: small enough).
    Only for the kit's own conventions, and a bshd kernel is left out: the calls of the ecosystem's are kept
    in the kit's terms (HF's mask folded, a kernel's transposes undone), where a passing call's mask and
    options are not the ones the models of those conventions read."""
    out = {}
    if target.convention not in CHECKED or getattr(target, "layout", "bhsd") == "bshd":
        return out
    for r in results:
        if r.status != "pass" or r.id not in registry:
            continue
        prop = registry[r.id]
        for case in prop.examples_for(target.convention)[:2]:
            if not replayable(case):
                continue
            calls, raised = record(prop.fn, target, case)
            ev = replay.Evidence(calls)
            if raised is None and ev.calls:
                out[r.id] = ev
                break
    return out


class Consistency:
    """Which passing properties a model (with its parameters) contradicts, memoised per model and setting."""

    def __init__(self, passing: dict[str, replay.Evidence]):
        self.passing = passing
        self._seen: dict[tuple, list[str]] = {}

    def contradicted(self, mistake, params: dict) -> list[str]:
        """The passing properties on one of whose calls ``mistake`` predicts other than the target returned."""
        key = (mistake.id, tuple(sorted(params.items())))
        if key not in self._seen:
            with one_thread():
                self._seen[key] = [pid for pid, ev in self.passing.items() if not _agrees(mistake, params, ev)]
        return self._seen[key]

    def checked(self) -> bool:
        return bool(self.passing)


def _agrees(mistake, params, ev: replay.Evidence) -> bool:
    """Does ``mistake`` predict the target's outputs on these passing calls? Only finite entries are compared:
    where either side is NaN or inf (a row the mask emptied, a convention's free rows), a passing property
    has already judged the target, and the model's own convention there may differ."""
    if mistake.recognised or mistake.options or mistake.arguments or mistake.grouped:
        return True  # models of an argument (is_causal, scale, a window, a softcap, GQA) the passing calls lack
    state = {}
    for i, call in enumerate(ev.calls):
        pred = predict(mistake, call, params, state)
        if pred is None or (pred.error is not None) != (call.error is not None):
            if pred is not None:
                return False
            continue
        budgets = ev.budgets(i, mistake.precision)
        for k, (x, y) in enumerate(zip(_parts(pred.out), _parts(call.out))):
            if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
                continue
            if x.shape != y.shape:
                return False
            x, y = x.detach().to(torch.float64), y.detach().to(torch.float64)
            both = torch.isfinite(x) & torch.isfinite(y)
            budget = budgets[min(k, len(budgets) - 1)]
            if both.any() and (x - y)[both].abs().max().item() > max(budget, 1e-12):
                return False
    return True


def _parts(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def keep_consistent(evidences: dict, consistency: Consistency) -> dict[tuple, list[str]]:
    """Drop from each failure's fits the models that contradict a passing property (attn_spec.diagnosis.run
    restores them only where, restored, one model names every failure: then the root says what it contradicts).
    A model with settings tried in order first gets its later settings: softmax(dim=-2) and softmax(dim=2) agree
    on 4-D scores, and only what passed on 3-D ones tells them apart.
    Returns (mistake id, params) -> the properties it contradicts."""
    dropped: dict[tuple, list[str]] = {}
    for ev in evidences.values():
        kept = []
        for f in ev.fits:
            against = consistency.contradicted(f.mistake, f.params)
            if against:
                dropped[(f.mistake.id, tuple(sorted(f.params.items())))] = against
                f = _later_setting(f, ev, consistency)
            if f is not None:
                kept.append(f)
        ev.fits = kept
    return dropped


def _later_setting(f, ev, consistency: Consistency):
    """The fit of ``f``'s model with a setting after ``f``'s that reproduces the failure and contradicts no pass."""
    settings = f.mistake.params
    if isinstance(settings, dict) or f.params not in settings:
        return None
    replayed = replay.Evidence(ev.calls)
    replayed.precision = "float32" if any(g.mistake.id == replay.PRECISION for g in ev.fits) else None
    for params in settings[settings.index(f.params) + 1:]:
        refit = replay.fit(dataclasses.replace(f.mistake, params=(params,)), replayed)
        if refit is not None and not consistency.contradicted(f.mistake, params):
            refit.mistake = f.mistake
            return refit
    return None
