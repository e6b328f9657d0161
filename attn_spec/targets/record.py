"""What a target was called with and what it did: the evidence a diagnosis is built from.

While a failing property is replayed on its minimal case (:func:`record`), every call into the target is kept as
a :class:`Call`: the inputs as the target saw them (copied before the call, strides and storage
kept, so that a kernel reading raw memory can be modelled), what came back (an output, a tuple,
or the exception it raised, with the line of the target's own code that raised it), and which
inputs the call wrote into.
"""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch

from attn_spec.errors import Failure, NotDifferentiable, TargetRaised, Unsupported
from attn_spec.targets.deadline import on_case

MAX_ELEMENTS = 1 << 21  # a call with more input elements is kept without its tensors (not replayed)


def snapshot(t):
    """A CPU copy of ``t`` that keeps its shape, strides and storage offset (scalars pass through)."""
    if not isinstance(t, torch.Tensor):
        return t
    t = t.detach()
    if t.is_contiguous() or t.untyped_storage().nbytes() > MAX_ELEMENTS * t.element_size():
        return t.to("cpu", copy=True)
    storage = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).to("cpu", copy=True)
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


def _copy_out(out):
    if isinstance(out, torch.Tensor):
        return out.detach().to("cpu", copy=True)
    if isinstance(out, (tuple, list)):  # a list stays a list: the diagnosis names what came back
        return type(out)(_copy_out(x) for x in out) if type(out) in (tuple, list) else tuple(map(_copy_out, out))
    return out


def same(a, b) -> bool:
    """Bitwise equal, NaN matching NaN (a tensor written in place differs from its copy)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    a, b = a.detach().cpu(), b.detach().cpu()
    equal = a == b
    if a.is_floating_point():
        equal |= a.isnan() & b.isnan()
    return bool(equal.all())


def raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the target's own code (outside torch and the kit)."""
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if "/torch/" not in f.filename and "/attn_spec/" not in f.filename]
    frame = (own or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else "?"


@dataclass
class Call:
    """One call into the target. ``kind``: "attend" (q, k, v, mask, scale, is_causal),
    "multihead" (x_q, x_kv, weights, n_heads, mask) or "vjp" (q, k, v, mask, grad_out)."""

    kind: str
    inputs: dict
    label: str = ""  # the call as the report names it, e.g. "attention(Q, K, V, mask)"
    out: object = None  # a CPU copy of what came back: a tensor, a tuple of them, or anything else
    error: tuple | None = None  # (exception type name, message, file:line) when the target raised
    unsupported: bool = False  # the target declared this input unsupported (NotImplementedError)
    changed: dict = field(default_factory=dict)  # input name -> its value after the call, when written into
    state_key: tuple = ()  # which module instance served the call (a stateful module's memory)
    kept: bool = True  # False: inputs too large to keep; the call is not replayed
    grad_inputs: frozenset = frozenset()  # inputs that required grad (leaves of a backward pass)


class Recorder:
    """Collects the calls of one replay, in order."""

    def __init__(self):
        self.calls: list[Call] = []

    def observe(self, kind: str, inputs: dict, thunk, *, label: str = "", state_key: tuple = ()):
        """Run ``thunk()`` (the call into the target), keeping its inputs and what it did."""
        size = sum(t.numel() for t in _tensors(inputs))
        kept = size <= MAX_ELEMENTS
        before = {name: snapshot(value) for name, value in _flat(inputs)} if kept else {}
        call = Call(kind, _unflat(before, inputs) if kept else {}, label=label, state_key=state_key, kept=kept,
                    grad_inputs=frozenset(name for name, value in _flat(inputs)
                                           if isinstance(value, torch.Tensor) and value.requires_grad))
        self.calls.append(call)
        try:
            out = thunk()
        except Unsupported:
            call.unsupported = True
            raise
        except TargetRaised as exc:
            call.error = (type(exc.exc).__name__, str(exc.exc), raised_at(exc.exc))
            raise
        except NotDifferentiable:  # a detached output: a model that detaches predicts the same
            call.error = (NotDifferentiable.__name__, "", "?")
            raise
        finally:
            if kept:
                for name, value in _flat(inputs):
                    if isinstance(value, torch.Tensor) and not same(value, before[name]):
                        call.changed[name] = snapshot(value)
        call.out = _copy_out(out) if kept else None
        return out


def _flat(inputs: dict):
    """(name, value) pairs with a dict of weights flattened to its own names."""
    for name, value in inputs.items():
        if isinstance(value, dict):
            yield from value.items()
        else:
            yield name, value


def _unflat(values: dict, like: dict) -> dict:
    return {name: ({key: values[key] for key in value} if isinstance(value, dict) else values[name])
            for name, value in like.items()}


def _tensors(inputs: dict):
    return [value for _, value in _flat(inputs) if isinstance(value, torch.Tensor)]


def record(fn, target, case) -> tuple[list[Call], BaseException | None]:
    """Run ``fn(target, case)`` once with fresh module instances, keeping every call into the target."""
    target.fresh_instances()
    target.recorder = Recorder()
    raised = None
    try:
        with on_case(case, lambda: f"{target.name}: replaying a failure on {case.summary()}"):  # each call's deadline
            fn(target, case)
    except (Failure, Unsupported) as exc:
        raised = exc
    except Exception as exc:  # noqa: BLE001 - a bug of the kit's own: the evidence stops here
        raised = exc
    finally:
        calls, target.recorder = target.recorder.calls, None
    return calls, raised


def differs(first: list[Call], second: list[Call]) -> bool:
    """Did the same inputs give different outputs (or a different outcome) in two replays?"""
    for a, b in zip(first, second):
        if a.kind != b.kind or not a.kept or not b.kept or not _same_inputs(a, b):
            return False  # the replays took different paths: nothing to compare from here on
        if (a.error is None) != (b.error is None) or not _same_out(a.out, b.out):
            return True
    return False


def _same_inputs(a: Call, b: Call) -> bool:
    for name, x in a.inputs.items():
        y = b.inputs.get(name)
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor) and not same(x, y):
            return False
    return True


def _same_out(x, y) -> bool:
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(_same_out(a, b) for a, b in zip(x, y))
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return same(x, y)
    return type(x) is type(y)
