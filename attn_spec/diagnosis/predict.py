"""What a mistake model (or the correct formula) does on one recorded call.

Each model gets copies of the call's inputs: float64 by default (its own rounding is then
negligible), or exactly the dtype, strides and storage the target saw (``exact``), leaves of a
backward pass included. A model's output, its exception, the inputs it writes into and the output
rows a convention decides (rows with no allowed key) make its :class:`Prediction`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attn_spec.reference import fold_causal, repeat_kv
from attn_spec.diagnosis.model import F64, Mistake, capped, collecting_free, correct, lift
from attn_spec.targets.record import Call, snapshot
from attn_spec.errors import NotDifferentiable

CORRECT = Mistake("correct", correct, "attend", "the correct formula", "", "")


@dataclass
class Prediction:
    """What a model (or the target) did on one call."""

    out: object = None  # a tensor, a tuple of them, or anything else
    error: tuple | None = None  # (type name, message) of the exception it raised
    changed: dict = field(default_factory=dict)  # inputs written in place -> their new value
    free: torch.Tensor | None = None  # bool [..., Tq, 1]: output rows a convention decides (any value fits)
    dtype: torch.dtype | None = None  # the dtype of every tensor it returns (None: each tensor's own)


def observed(call: Call) -> Prediction:
    return Prediction(call.out, call.error[:2] if call.error else None, dict(call.changed))


def grouped(q, k) -> bool:
    return q.dim() >= 3 and k.dim() >= 3 and 1 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0


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
    window, softcap = call.inputs.get("window"), call.inputs.get("softcap")
    if window is not None and not m.options:
        mask = fold_causal(mask, q.shape[-2], k.shape[-2], window)
    if is_causal and not m.arguments:
        mask = fold_causal(mask, q.shape[-2], k.shape[-2])
    if not m.grouped and grouped(q, k):
        g = q.shape[-3] // k.shape[-3]
        k, v = repeat_kv(k, g), repeat_kv(v, g)
    args = {"is_causal": is_causal} if m.arguments else {}
    if m.options:
        args.update(window=window, softcap=softcap)
    return q, k, v, mask, scale, args, x


def _cap(m: Mistake, call: Call):
    """A model that does not take the softcap itself gets it applied to its scores (see model.capped)."""
    return capped(None if m.options else call.inputs.get("softcap"))


def _run(m: Mistake, call: Call, params: dict, state: dict):
    """(output, the model's own input copies) of ``m`` on ``call``; None when ``m`` says nothing about it."""
    level = m.level
    if m.recognised or m.serving or (level == "module" and call.kind != "multihead") or call.inputs.get("dropout") \
            or call.inputs.get("alibi") is not None:
        return None  # dropout and ALiBi calls are recognised from readouts (mistakes_dropout, mistakes_alibi); a
        #              serving kernel's model is replayed on its own calls (diagnosis.serving)
    if call.kind == "attend":
        q, k, v, mask, scale, args, x = _attend_inputs(m, call)
        if level == "backward":
            return correct(q, k, v, mask, scale), x
        with torch.set_grad_enabled(bool(call.grad_inputs) and m.exact), _cap(m, call):
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
    with torch.enable_grad(), _cap(m, call):
        out = m.fn(*leaves, mask, scale, **args, **params)
        if not isinstance(out, torch.Tensor):
            return None
        if not out.requires_grad:  # what the vjp of a target that is trained raises (Target._not_differentiable)
            raise NotDifferentiable("the output is not differentiable in Q, K, V")
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
    dtype = None if m.exact else input_dtype(call)  # a float64 copy stands for the inputs' dtype
    return Prediction(out, None, changed, _free_rows(free, out), dtype)


def input_dtype(call: Call) -> torch.dtype:
    """The dtype of the call's queries (of x_q for a module)."""
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
