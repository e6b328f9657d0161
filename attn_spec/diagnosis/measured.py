"""Roots read from what the recorded calls returned and the shapes they crashed on, before any model is fitted.

- :func:`returned_type`: a target that returns a NumPy array, a list, a tuple, a number or None fails every
  property for that one reason; the root is named by the type, before any property's relation is judged.
- :func:`length_crash`: a target that crashes past some length without declaring a limit (the length probe
  measured where: attn_spec.targets.lengths) fails the properties that go past it with that crash, one root
  stated by the measured boundary, not by a mistake model (none models a hard-coded size).
- :func:`wrong_transpose`: a target that transposes K over the wrong pair of axes (``K.transpose(0, 1)`` on
  batched inputs) is right on 2-D inputs and wrong or crashing on batched ones; the pair is measured by
  replaying the formula with each pair of K's axes on every recorded call, and the crash pattern against
  the shapes is read off the calls (it crashes only where those two dims differ).
"""
from __future__ import annotations

import itertools

import torch

from attn_spec.diagnosis.model import F64, correct
from attn_spec.targets.base import type_words

def _returned(call):
    """The non-tensor a call returned, or None (a tensor, a crash, a call not kept)."""
    if call.error is not None or not call.kept or call.kind not in ("attend", "multihead"):
        return None
    return None if isinstance(call.out, torch.Tensor) else call.out


def returned_type(evidences: dict) -> tuple[str, str, list[str]] | None:
    """(the type's words, why, the failing properties whose calls returned it) when some call returned no
    tensor, or None. The first such type names the root; the properties whose calls returned it join it."""
    first, pids = None, []
    for pid, ev in evidences.items():
        outs = [c.out for c in ev.calls if _returned(c) is not None or (c.error is None and c.kept and c.out is None
                                                                        and c.kind in ("attend", "multihead"))]
        if not outs:
            continue
        words = type_words(outs[0])
        first = first or words
        if words == first:
            pids.append(pid)
    return (*first, pids) if first else None


# ------------------------------------------------------------------ K transposed over the wrong axes


def _replayed_calls(evidences: dict):
    for pid, ev in evidences.items():
        for call in ev.calls:
            if call.kind in ("attend", "vjp") and call.kept and not call.unsupported and "k" in call.inputs:
                yield pid, call


def _predict(call, axes):
    """What ``softmax(scale Q K.transpose(a, b)) V`` gives on ``call`` (its gradients too, for a backward
    call): ("error", the exception's type) or ("out", a tuple of tensors)."""
    x = call.inputs
    q, k, v = (x[n].detach().to(F64).requires_grad_(call.kind == "vjp") for n in ("q", "k", "v"))
    try:
        with torch.enable_grad():
            kt = k.transpose(*axes)  # the wrong pair; on 2-D K, (0, 1) is the right transpose
            out = correct(q, kt.transpose(-2, -1), v, x.get("mask"), x.get("scale"))  # q @ kt, scaled
            if call.kind == "attend":
                return "out", (out.detach(),)
            grads = torch.autograd.grad((out * x["grad_out"].to(F64)).sum(), (q, k, v), allow_unused=True)
    except (RuntimeError, IndexError) as exc:
        return "error", type(exc).__name__
    return "out", (out.detach(), *(torch.zeros_like(t) if g is None else g for g, t in zip(grads, (q, k, v))))


def _agrees(call, predicted) -> bool:
    kind, value = predicted
    if call.error is not None:
        return kind == "error" and value == call.error[0]
    got = call.out if isinstance(call.out, tuple) else (call.out,)
    if kind == "error" or len(got) != len(value):
        return False
    for g, p in zip(got, value):
        if not isinstance(g, torch.Tensor) or g.shape != p.shape or not torch.isfinite(g).all():
            return False
        size = max(1.0, p.abs().max().item()) if p.numel() else 1.0
        tol = (1e-9 if g.dtype == F64 else 2e-2) * size  # float64 rounding, or float16's at most
        if p.numel() and (g.to(F64) - p).abs().max().item() > tol:
            return False
    return True


def wrong_transpose(evidences: dict) -> tuple[tuple[int, int], list[str], str] | None:
    """((a, b), the failing properties, the measured crash pattern) when ``K.transpose(a, b)`` for a wrong
    pair of axes reproduces every recorded attend call, crashes included, and some call is batched; else None.

    The pair is measured, not assumed: each pair of K's axes other than the last two is replayed, and it
    must agree with every call (the same exception type where the target raised, the same output where it
    returned). The words of the crash pattern come from the calls: where it crashed and where it ran."""
    calls = list(_replayed_calls(evidences))
    batched = [c for _, c in calls if c.inputs["k"].dim() >= 3]
    # a crash the right transpose would not raise (grouped K/V heads never repeated crash either way)
    if not any(c.error and _predict(c, (-2, -1))[0] == "out" for c in batched):
        return None
    rank = max(c.inputs["k"].dim() for c in batched)
    for a, b in itertools.combinations(range(rank), 2):
        if (a, b) == (rank - 2, rank - 1):
            continue  # the right pair
        differ = [c for c in batched if c.error and c.inputs["k"].dim() > b and c.inputs["k"].shape[a] != c.inputs["k"].shape[b]]
        if differ and all(_agrees(c, _predict(c, (a, b))) for _, c in calls):
            pids = sorted({pid for pid, _ in calls})
            # the story of every failure, or of none: a pair that reproduces a few crashes is a coincidence
            return ((a, b), pids, _pattern(batched, (a, b))) if set(pids) == set(evidences) else None
    return None


def _pattern(batched, axes) -> str:
    """Where the batched calls crashed and where they ran, against K's dims ``a`` and ``b``."""
    a, b = axes
    differ = [c for c in batched if c.inputs["k"].dim() > b and c.inputs["k"].shape[a] != c.inputs["k"].shape[b]]
    crashed = [c for c in differ if c.error]
    ran = [c for c in batched if not c.error]
    text = (f"of {_count(len(differ), 'batched call')} where K's dims {a} and {b} differ, {len(crashed)} raised "
            f"{crashed[0].error[0] if crashed else 'nothing'}" + (f" (K {list(crashed[0].inputs['k'].shape)})"
                                                                  if crashed else ""))
    if ran:
        text += f"; it ran on K {list(ran[0].inputs['k'].shape)}"
    return text + "; on 2-D inputs the transpose is the right one"


def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


# ------------------------------------------------------------------ a crash past a length, undeclared


def length_crash(evidences: dict, target) -> tuple[str, list[str]] | None:
    """(where the crash starts, the failing properties that raise it) when the length probe found an undeclared
    crash (``Supports.length_crash``: "raises IndexError from 17 positions on; takes up to 16, ...") and some
    failure is that exception past that length; else None."""
    supported = getattr(target, "supported", None)
    where = getattr(supported, "length_crash", "")
    if not where:
        return None
    def past(call) -> bool:  # a crash on inputs longer than the target takes (a call too large to keep: long)
        lengths = [t.shape[-2] for name, t in call.inputs.items()
                   if name in ("q", "k", "x_q", "x_kv") and isinstance(t, torch.Tensor) and t.dim() >= 2]
        return call.error is not None and (not call.kept or max(lengths, default=0) > supported.crash_length)
    pids = [pid for pid, ev in evidences.items()
            if ev.crash and where.startswith(f"raises {ev.crash[0]} from ") and any(past(c) for c in ev.calls)]
    return (where, pids) if pids else None
