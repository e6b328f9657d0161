"""Replay mistake models on the calls a failing property made, and keep those that reproduce them.

A model *fits* a failure when, on every recorded call, it predicts what the target did: the same
exception, or an output of the same shape and dtype whose entries are within the call's error
budget (``attn_spec.checking.tolerance``: what a correct same-dtype implementation may err by),
NaN and inf in the same places, and the same inputs written in place. It is *named* only if it
also differs from the correct formula on some call, judged at the target's own precision: when
the correct formula computed in float32 already explains a float64 target, only that is named.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attn_spec import reference
from attn_spec.checking import grad_tolerance, tolerance
from attn_spec.diagnosis.model import F64, MISTAKES, Mistake, collecting_free, correct, lift
from attn_spec.diagnosis.record import Call, snapshot

CORRECT = Mistake("correct", correct, "attend", "the correct formula", "", "")
PRECISION = "computes-in-float32"
DTYPE_NAMES = {torch.float64: "float64", torch.float32: "float32", torch.float16: "float16",
               torch.bfloat16: "bfloat16"}


@dataclass
class Prediction:
    """What a model (or the target) did on one call."""

    out: object = None  # a tensor, a tuple of them, or anything else
    error: tuple | None = None  # (type name, message) of the exception it raised
    changed: dict = field(default_factory=dict)  # inputs written in place -> their new value
    free: torch.Tensor | None = None  # bool [..., Tq, 1]: output rows a convention decides (any value fits)
    dtype: torch.dtype | None = None  # the dtype of every tensor it returns (None: each tensor's own)


@dataclass
class Fit:
    mistake: Mistake
    params: dict
    calls: int  # calls that were replayed
    telling: int  # calls on which the model differs from the correct formula
    free: int  # output rows left free (fewer is more specific)
    messages: int = 0  # crashes predicted with the very message the target raised


    @property
    def sentence(self) -> str:
        return self.mistake.describe(self.params)


def observed(call: Call) -> Prediction:
    return Prediction(call.out, call.error[:2] if call.error else None, dict(call.changed))


# ------------------------------------------------------------------ running a model on a call


def _grouped(q, k) -> bool:
    return q.dim() >= 3 and k.dim() >= 3 and 1 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0


def _fold_causal(mask, n_q, n_kv):
    tril = reference.causal_mask(n_q, n_kv)  # [Tq, Tk]
    if mask is None:
        return tril
    return tril & mask if mask.dtype == torch.bool else mask.masked_fill(~tril, -math.inf)


def _prepared(m: Mistake, call: Call, names):
    """Copies of the call's tensors for ``m``: float64, or (exact) the dtype and memory layout the target
    saw, leaves of a backward pass included (writing into one of those raises, as it did for the target)."""
    out = {}
    for name in names:
        t = call.inputs.get(name)
        if isinstance(t, dict):
            out[name] = {key: _prepared_tensor(m, w) for key, w in t.items()}
        else:
            out[name] = _prepared_tensor(m, t, name in call.grad_inputs)
    return out


def _prepared_tensor(m, t, leaf=False):
    if not isinstance(t, torch.Tensor):
        return t
    if m.exact:
        t = snapshot(t)
        return t.requires_grad_(True) if leaf and t.is_floating_point() else t
    return t.to(F64) if t.is_floating_point() else t.clone()


def _attend_inputs(m, call):
    x = _prepared(m, call, ("q", "k", "v", "mask"))
    q, k, v, mask = x["q"], x["k"], x["v"], x["mask"]
    scale, is_causal = call.inputs.get("scale"), call.inputs.get("is_causal", False)
    if is_causal and not m.arguments:
        mask = _fold_causal(mask, q.shape[-2], k.shape[-2])
    if not m.grouped and _grouped(q, k):
        g = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
    args = {"is_causal": is_causal} if m.arguments else {}
    return q, k, v, mask, scale, args, x


def _run(m: Mistake, call: Call, params: dict, state: dict):
    """(output, the model's own input copies) of ``m`` on ``call``; None when ``m`` says nothing about it."""
    level = m.level
    if level == "stochastic" or (level == "module" and call.kind != "multihead"):
        return None
    if call.kind == "attend":
        q, k, v, mask, scale, args, x = _attend_inputs(m, call)
        if level == "backward":
            return correct(q, k, v, mask, scale), x
        with torch.set_grad_enabled(bool(call.grad_inputs) and m.exact):
            return m.fn(q, k, v, mask, scale, **args, **params), x
    if call.kind == "multihead":
        x = _prepared(m, call, ("x_q", "x_kv", "weights", "mask"))
        h = call.inputs["n_heads"]
        if level == "module":
            extra = {"state": state.setdefault(call.state_key, {})} if m.stateful else {}
            return m.fn(x["x_q"], x["x_kv"], x["weights"], h, x["mask"], **extra, **params), x
        fn = correct if level == "backward" else m.fn
        extra = {"is_causal": False} if m.arguments and level != "backward" else {}
        return lift(lambda q, k, v, mask, scale, **p: fn(q, k, v, mask, scale, **extra, **p),
                    x["x_q"], x["x_kv"], x["weights"], h, x["mask"], **({} if level == "backward" else params)), x
    # a vjp: (out, dQ, dK, dV) of <out, G>
    q, k, v, mask, scale, args, x = _attend_inputs(m, call)
    g = _prepared_tensor(m, call.inputs["grad_out"])
    if level == "backward":
        return m.fn(q, k, v, mask, scale, g, **params), x
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = m.fn(*leaves, mask, scale, **args, **params)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None  # not differentiable: the target's vjp says so itself (a skip), nothing to compare
        grads = torch.autograd.grad((out * g.to(out.dtype)).sum(), leaves, allow_unused=True)
    grads = [torch.zeros_like(t) if d is None else d for d, t in zip(grads, leaves)]
    return (out.detach(), *grads), x


def predict(m: Mistake, call: Call, params: dict | None = None, state: dict | None = None) -> Prediction | None:
    """What ``m`` does on ``call``: an output, or an exception, or None when it does not apply."""
    state = {} if state is None else state
    with collecting_free() as free:
        try:
            ran = _run(m, call, params or {}, state)
        except Exception as exc:  # noqa: BLE001 - the wrong code crashing is a prediction too
            return Prediction(error=(type(exc).__name__, str(exc)))
    if ran is None:
        return None
    out, inputs = ran
    changed = {}
    if m.exact:
        for name, t in _flat(inputs):
            old = _flat_get(call.inputs, name)
            if isinstance(t, torch.Tensor) and isinstance(old, torch.Tensor) and not _same(t, old):
                changed[name] = t
    dtype = None if m.exact else _dtype(call)  # a float64 copy stands for the inputs' dtype
    return Prediction(out, None, changed, _free_rows(free, out), dtype)


def _dtype(call: Call) -> torch.dtype:
    return call.inputs["q" if "q" in call.inputs else "x_q"].dtype


def _flat(inputs):
    for name, value in inputs.items():
        if isinstance(value, dict):
            yield from value.items()
        else:
            yield name, value


def _flat_get(inputs, name):
    return dict(_flat(inputs)).get(name)


def _same(a, b) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else (a == b)).all())


def _free_rows(free: list, out) -> torch.Tensor | None:
    """Output rows [..., Tq, 1] that depend on a free weight (collected [..., Tq, Tk] masks)."""
    first = out[0] if isinstance(out, tuple) and out else out
    if not free or not isinstance(first, torch.Tensor) or first.dim() < 1:
        return None
    rows = None
    for where in free:
        r = where.any(dim=-1, keepdim=True)  # [..., Tq, 1]
        while r.dim() > first.dim():
            r = r.any(dim=0)
        try:
            r = torch.broadcast_to(r, (*first.shape[:-1], 1))
        except RuntimeError:
            return torch.ones(*first.shape[:-1], 1, dtype=torch.bool)  # cannot place it: all rows free
        rows = r if rows is None else rows | r
    return rows


# ------------------------------------------------------------------ comparing predictions


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
        if x.get("is_causal"):
            mask = _fold_causal(mask, q.shape[-2], k.shape[-2])
        if _grouped(q, k):
            g = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(g, dim=-3), v.repeat_interleave(g, dim=-3)
        scale = x.get("scale")
        ref = reference.attention(q, k, v, mask, scale=scale)[0]
        out_budget = tolerance.budget(q, k, v, mask, ref, scale=scale)
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
    if m.level == "stochastic":
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
    if precision is not None and any(_dtype(c) == torch.float64 for c in ev.calls):
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
        if m.level == "stochastic" or isinstance(m.params, dict):
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


def dtype_name(t) -> str:
    return DTYPE_NAMES.get(getattr(t, "dtype", None), str(getattr(t, "dtype", "?")))
