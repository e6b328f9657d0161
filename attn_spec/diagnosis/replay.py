"""Replay mistake models on the calls a failing property made, and keep those that reproduce them.

A model *fits* a failure when, on every recorded call, it predicts what the target did: the same
exception, or an output of the same shape and dtype whose entries are within the call's error
budget (``attn_spec.checking.tolerance``: what a correct same-dtype implementation may err by),
NaN and inf in the same places, and the same inputs written in place. It is *named* only if the
target also differs from the correct formula on some call, judged at the target's own precision:
when the correct formula computed in float32 already explains a float64 target, only that is named.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_spec import reference
from attn_spec.checking import grad_tolerance, tolerance
from attn_spec.diagnosis.model import F64, MISTAKES, Mistake
from attn_spec.diagnosis.predict import CORRECT, Prediction, fold_causal, grouped, input_dtype, observed, predict
from attn_spec.targets.record import Call

PRECISION = "computes-in-float32"


@dataclass
class Fit:
    mistake: Mistake
    params: dict
    calls: int  # calls that were replayed
    telling: int  # calls on which the model differs from the correct formula
    free: int  # output rows left free (fewer is more specific)
    messages: int = 0  # crashes predicted with the very message the target raised



def mismatch(pred: Prediction, seen: Prediction, budgets) -> float:
    """How far ``pred`` is from ``seen``, in units of the budget: <= 1 agrees, inf for a different kind."""
    if (pred.error is None) != (seen.error is None):
        return math.inf
    if pred.error is not None:
        return 0.0 if pred.error[0] == seen.error[0] else math.inf  # the same kind of crash
    if set(pred.changed) != set(seen.changed):
        return math.inf
    worst = 0.0
    for name, t in pred.changed.items():
        worst = max(worst, _distance(t, seen.changed[name], budgets[0]))
    a, b = _parts(pred.out), _parts(seen.out)
    if len(a) != len(b):
        return math.inf
    for i, (x, y) in enumerate(zip(a, b)):
        budget = budgets[min(i, len(budgets) - 1)]
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and (pred.dtype or x.dtype) != (seen.dtype or y.dtype):
            return math.inf
        worst = max(worst, _distance(x, y, budget, pred.free if i == 0 else None))
    return worst


def _parts(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _distance(x, y, budget, free=None) -> float:
    """max |x - y| / budget; NaN and inf must sit in the same places. A free row of ``x`` (a row with
    no allowed key) matches a row of ``y`` that is all zeros or all NaN/inf: the two conventions."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
        return 0.0 if type(x) is type(y) and not isinstance(x, torch.Tensor) else math.inf
    if x.shape != y.shape:
        return math.inf
    if x.dtype == torch.bool or y.dtype == torch.bool:
        return 0.0 if torch.equal(x.bool(), y.bool()) else math.inf
    x, y = x.detach().to(F64), y.detach().to(F64)
    if free is not None and x.dim():
        rows = free.expand(*x.shape[:-1], 1)
        conventional = (y == 0).all(dim=-1, keepdim=True) | (~torch.isfinite(y)).all(dim=-1, keepdim=True)
        if not conventional[rows].all():
            return math.inf
        x, y = x.masked_fill(rows, 0.0), y.masked_fill(rows, 0.0)
    bad_x, bad_y = ~torch.isfinite(x), ~torch.isfinite(y)
    if not torch.equal(bad_x, bad_y):
        return math.inf
    diff = (x - y).masked_fill(bad_x, 0.0).abs()
    err = diff.max().item() if diff.numel() else 0.0
    return err / budget if budget > 0 else (0.0 if err == 0 else math.inf)


# ------------------------------------------------------------------ budgets and the correct formula


class Evidence:
    """The recorded calls of one failure, with each call's error budget and correct prediction, memoised."""

    def __init__(self, calls: list[Call]):
        self.calls = [c for c in calls if c.kept and not c.unsupported]
        self._budgets: dict = {}
        self._correct: dict = {}
        self._telling: dict = {}
        self.precision: str | None = None  # "float32" when the target computes float64 inputs at float32

    def budgets(self, i: int, precision: str | None = None) -> list[float]:
        key = (i, precision)
        if key not in self._budgets:
            self._budgets[key] = _budgets(self.calls[i], precision)
        return self._budgets[key]

    def telling(self, i: int, precision: str | None = None) -> bool:
        """Does the target differ from the correct formula on call ``i`` (judged at ``precision``)?"""
        key = (i, precision)
        if key not in self._telling:
            good = self.correct(i)
            self._telling[key] = good is None or mismatch(good, observed(self.calls[i]), self.budgets(i, precision)) > 1
        return self._telling[key]

    def correct(self, i: int) -> Prediction | None:
        if i not in self._correct:
            self._correct[i] = predict(CORRECT, self.calls[i])
        return self._correct[i]


def _budgets(call: Call, precision: str | None) -> list[float]:
    """The error a correct implementation may show on this call, per output part."""
    x = dict(call.inputs)
    lower = precision == "float32"
    try:
        if call.kind == "multihead":
            names = ("x_q", "x_kv")
            x_q, x_kv = (_at(x[n], lower) for n in names)
            W = {key: _at(w, lower) for key, w in x["weights"].items()}
            ref = reference.multihead(x_q, x_kv, *(W[n] for n in ("W_Q", "W_K", "W_V", "W_O")), x["n_heads"],
                                      x["mask"])[0]
            return [tolerance.multihead_budget(x_q, x_kv, W, x["n_heads"], x["mask"], ref)]
        q, k, v = (_at(x[n], lower) for n in ("q", "k", "v"))
        mask = x.get("mask")
        if x.get("window") is not None:
            mask = fold_causal(mask, q.shape[-2], k.shape[-2], x["window"])
        if x.get("is_causal"):
            mask = fold_causal(mask, q.shape[-2], k.shape[-2])
        if grouped(q, k):
            g = q.shape[-3] // k.shape[-3]
            k, v = reference.repeat_kv(k, g), reference.repeat_kv(v, g)
        scale, cap = x.get("scale"), x.get("softcap")
        ref = reference.attention(q, k, v, mask, scale=scale, softcap=cap)[0]
        out_budget = (tolerance.budget(q, k, v, mask, ref, scale=scale) if cap is None else
                      tolerance.softcap_budget(q, k, v, mask, ref, cap))
        if call.kind == "attend":
            return [out_budget]
        g_out = _at(x["grad_out"], lower)
        grads = grad_tolerance.reference_grads(q, k, v, mask, g_out, scale=scale)
        return [out_budget, *grad_tolerance.grad_budgets(q, k, v, mask, g_out, grads)]
    except (RuntimeError, ValueError, IndexError, TypeError):  # inputs a formula cannot take (a target wrote into them)
        return [1e-6]


def _at(t, lower: bool):
    """The tensor as the budget sees it: contiguous, and at float32 when judging a float32 computation."""
    t = t.contiguous()
    return t.float() if lower and t.dtype == torch.float64 else t


# ------------------------------------------------------------------ fitting


def _candidates(m: Mistake, ev: Evidence):
    if isinstance(m.params, dict):
        yield from _fitted(m, ev)
    elif m.params:
        yield from m.params
    else:
        yield {}


def _fitted(m: Mistake, ev: Evidence):
    """One number fitted on the first call where the target differs from the correct formula."""
    (name, (lo, hi, _)), = m.params.items()
    for i, call in enumerate(ev.calls):
        seen, good = observed(call), ev.correct(i)
        if good is None or mismatch(good, seen, ev.budgets(i)) <= 1:
            continue
        budgets = ev.budgets(i)

        def cost(x):
            pred = predict(m, call, {name: x})
            return math.inf if pred is None else min(mismatch(pred, seen, budgets), 1e300)

        log = lo > 0
        a, b = (math.log(lo), math.log(hi)) if log else (lo, hi)
        grid = [a + (b - a) * j / 48 for j in range(49)]
        best = min(grid, key=lambda t: cost(math.exp(t) if log else t))
        step = (b - a) / 48
        a, b = best - step, best + step
        for _ in range(90):  # golden-section search around the best grid point
            c, d = b - (b - a) / 1.618, a + (b - a) / 1.618
            if cost(math.exp(c) if log else c) < cost(math.exp(d) if log else d):
                b = d
            else:
                a = c
        value = math.exp((a + b) / 2) if log else (a + b) / 2
        for digits in (1, 2, 3, 4):  # a round number that fits as well is what the code has
            rounded = float(f"{value:.{digits}g}")
            if cost(rounded) <= 1:
                value = rounded
                break
        yield {name: value}
        return


def fit(m: Mistake, ev: Evidence) -> Fit | None:
    """The first parameter setting with which ``m`` reproduces every call and differs from the correct formula."""
    if m.recognised or m.serving:
        return None
    for params in _candidates(m, ev):
        state, replayed, telling, free, messages = {}, 0, 0, 0, 0
        for i, call in enumerate(ev.calls):
            pred = predict(m, call, params, state)
            if pred is None:
                continue
            replayed += 1
            if mismatch(pred, observed(call), ev.budgets(i, m.precision)) > 1:
                break
            if ev.telling(i, None if m.precision else ev.precision):  # judged at the target's own precision
                telling += 1
            free += int(pred.free.sum()) if pred.free is not None else 0
            messages += bool(pred.error and call.error and pred.error[1] == call.error[1])
        else:
            if telling:
                return Fit(m, params, replayed, telling, free, messages)
    return None


def fits(ev: Evidence, mistakes=None, shortlist=()) -> list[Fit]:
    """The models that reproduce the evidence, most specific first (no parameters, fewest free rows).

    Tried in rounds, stopping at the first round that finds one: the ``shortlist`` (models already
    named for other failures of the same target), then every model with no fitted number, then the
    models that fit a number (a temperature, a slope): a fitted number explains more, so it is the
    weakest evidence. The precision model is always tried first: it sets the precision the others
    are judged at.
    """
    candidates = list(MISTAKES.values()) if mistakes is None else list(mistakes)
    precision = next((m for m in candidates if m.id == PRECISION), None)
    ev.precision = None
    found = []
    if precision is not None and any(input_dtype(c) == torch.float64 for c in ev.calls):
        hit = fit(precision, ev)
        if hit:
            ev.precision = "float32"
            found.append(hit)
    rounds = ([m for m in candidates if m.id in set(shortlist)],
              [m for m in candidates if not isinstance(m.params, dict)],
              [m for m in candidates if isinstance(m.params, dict)])
    for group in rounds:
        found += [hit for hit in (fit(m, ev) for m in group if m is not precision) if hit]
        if found:
            break
    return sorted(found, key=lambda f: (isinstance(f.mistake.params, dict), -f.messages, f.free))


def nearest(ev: Evidence, mistakes=None):
    """(Fit-like guess, calls reproduced) of the model closest to the evidence when none fits, or None."""
    best, best_key = None, None
    for m in (list(MISTAKES.values()) if mistakes is None else mistakes):
        if m.recognised or m.serving or isinstance(m.params, dict):
            continue
        for params in _candidates(m, ev):
            state, agree, telling, total, ratios = {}, 0, 0, 0, []
            for i, call in enumerate(ev.calls):
                pred = predict(m, call, params, state)
                if pred is None:
                    continue
                total += 1
                r = mismatch(pred, observed(call), ev.budgets(i, m.precision))
                if r <= 1:
                    agree += 1
                    telling += ev.telling(i)
                ratios.append(min(r, 1e30))
            if not telling:
                continue
            key = (telling, agree, -sorted(ratios)[len(ratios) // 2])
            if best_key is None or key > best_key:
                best, best_key = (Fit(m, params, total, telling, 0), agree), key
    return best
