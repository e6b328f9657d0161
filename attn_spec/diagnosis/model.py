"""Mistake models as data: ``@mistake`` turns one small function into a catalog entry.

A mistake model computes what a classic wrong implementation returns on the inputs a target was
actually called with. Its function is the wrong code itself, written plainly:

- ``level="attend"``: ``fn(q, k, v, mask, scale)`` for attention on Q [..., Tq, Dk], K, V and a
  bool (True = may attend) or additive float mask; ``scale`` is an explicit scale or None. Used on
  a module's calls too, per head, inside a correct multi-head wrapper (:func:`lift`).
- ``level="module"``: ``fn(x_q, x_kv, W, h, mask)`` for a multi-head module's forward.
- ``level="backward"``: ``fn(q, k, v, mask, G) -> (out, dQ, dK, dV)`` for a wrong backward pass.
- ``level="stochastic"``: ``fn(samples, weights) -> params or None`` judges repeated weight
  readings of the same input (randomness cannot be replayed, only recognised).
- ``level="dropout"``, ``level="alibi"``: ``fn(reading) -> params or None`` judges a readout of the dropped
  weights or of the ALiBi bias (attn_spec.diagnosis.mistakes_dropout, mistakes_alibi).
- ``level="decode"``, ``"merge"``, ``"varlen"``: ``fn(call) -> {name: tensor}``, a serving kernel of that
  convention on one recorded call (attn_spec.diagnosis.serving; ``paged``: a model of paged caches itself).

By default a model gets float64 copies of the inputs (its own rounding is then negligible);
``exact=True`` gives it the inputs in their own dtype, for mistakes whose rounding, overflow or
output dtype is the bug. ``precision="float32"`` judges it with the float32 error budget.
"""
from __future__ import annotations

import contextlib
import contextvars
import inspect
import math
from dataclasses import dataclass
from typing import Callable

import torch

from attn_spec import reference
from attn_spec.reference import masked  # noqa: F401 - a building block of the models: the reference's own

F64 = torch.float64
NEG_INF = float("-inf")
SERVING = ("decode", "merge", "varlen")  # levels of serving kernels: replayed on their own calls (diagnosis.serving)
LEVELS = ("attend", "module", "backward", "stochastic", "dropout", "alibi", *SERVING)
RECOGNISED = ("stochastic", "dropout", "alibi")  # levels whose randomness is recognised from readings, never replayed

MISTAKES: dict[str, "Mistake"] = {}


@dataclass(frozen=True)
class Mistake:
    """One classic wrong implementation: its code (``fn``), what it does in one sentence, and the fix."""

    id: str
    fn: Callable
    level: str
    sentence: str  # may name parameters: "the scores are scaled by {factor:.3g}"
    fix: str
    family: str
    caught_by: tuple[str, ...] = ()  # the properties that exist to catch it: the report shows it there
    exact: bool = False  # runs in the inputs' dtype and device-free CPU copies; its output dtype counts
    precision: str | None = None  # the dtype whose error budget judges it ("float32")
    params: tuple | dict = ()  # settings (dicts) tried in order, or {name: (lo, hi, typical)}: one number fitted
    grouped: bool = False  # receives grouped-query K/V as given (otherwise repeated to the query heads)
    arguments: bool = False  # receives ``is_causal`` itself (otherwise it is folded into the mask)
    stateful: bool = False  # receives ``state``, a dict kept across the calls of one replay
    options: bool = False  # receives ``window`` and ``softcap`` itself (otherwise the window is folded into the
    #                        mask and the cap applied by ``scores``, as the correct formula does)
    cause: str = ""  # the words one mismatch names it by (attn_spec.diagnosis.mismatch: they may name the numbers it
    #                  measured), where they are not the sentence
    paged: bool = False  # a decode model of paged caches itself (serving levels only)

    @property
    def recognised(self) -> bool:
        """Recognised from readings of random outputs, not replayed on recorded calls."""
        return self.level in RECOGNISED

    @property
    def serving(self) -> bool:
        """A serving kernel's model: replayed on the calls of its own convention, never on an attention's."""
        return self.level in SERVING

    @property
    def code(self) -> str:
        """The model's own code: the wrong implementation, as ``attn-spec explain`` shows it."""
        lines = inspect.getsource(self.fn).splitlines()
        start = next(i for i, line in enumerate(lines) if line.startswith("def "))
        return "\n".join(lines[start:]).rstrip()

    @property
    def typical(self) -> dict:
        """Parameters for a worked example: the first setting tried, or the typical fitted number."""
        if isinstance(self.params, dict):
            return {name: spec[2] for name, spec in self.params.items()}
        return dict(self.params[0]) if self.params else {}

    def describe(self, params: dict | None = None) -> str:
        return self.sentence.format(**(self.typical if params is None else params))

    def fix_for(self, params: dict | None = None) -> str:
        return self.fix.format(**(self.typical if params is None else params))

    def cause_for(self, **params) -> str:
        """What one output this model reproduces says of the target: its ``cause``, or else its sentence."""
        return (self.cause or self.sentence).format(**{**self.typical, **params})


def mistake(id: str, *, sentence: str, fix: str, family: str, level: str = "attend", caught_by=(), params=(),
            **flags):
    """Register ``fn`` as the mistake ``id`` (stable, kebab-case: a public contract, like property ids); ``flags``:
    the record's other fields (exact, precision, grouped, arguments, stateful, options, cause, paged)."""
    if level not in LEVELS:
        raise ValueError(f"level {level!r} is not one of {LEVELS}")  # sanity check

    def register(fn):
        if id in MISTAKES:
            raise ValueError(f"mistake id {id!r} is registered twice")  # sanity check
        MISTAKES[id] = Mistake(id, fn, level, sentence, fix, family, tuple(caught_by),
                               params=params if isinstance(params, dict) else tuple(params), **flags)
        return fn

    return register


# ------------------------------------------------------------------ building blocks of the models
# The formula is the reference's (attn_spec.reference: scores, masked, softmax_keys, attention), in the inputs' own
# dtype; a model states its mistake as a change to its inputs or options, or writes its different formula with these
# pieces. What a replay adds: the call's softcap (capped), free rows (collecting_free), plain_softmax.

_FREE: contextvars.ContextVar[list | None] = contextvars.ContextVar("free", default=None)


@contextlib.contextmanager
def collecting_free():
    """Collect the weights that a model leaves free (rows with no allowed key: a convention)."""
    token = _FREE.set([])
    try:
        yield _FREE.get()
    finally:
        _FREE.reset(token)


def leave_free(where: torch.Tensor) -> None:
    """Mark weights [..., Tq, Tk] as free: targets differ there by convention (NaN, zeros, uniform)."""
    collected = _FREE.get()
    if collected is not None and bool(where.any()):
        collected.append(where)


def scale_of(q, scale=None) -> float:
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


_CAP: contextvars.ContextVar[float | None] = contextvars.ContextVar("cap", default=None)


@contextlib.contextmanager
def capped(cap):
    """Within: ``scores`` soft-caps them, cap * tanh(s / cap), as a call with ``softcap=cap`` asks."""
    token = _CAP.set(cap)
    try:
        yield
    finally:
        _CAP.reset(token)


def _reference(options: dict) -> dict:
    """The reference's options for a model: the inputs' own dtype, the call's softcap (see capped), then ``options``."""
    return {"softcap": _CAP.get(), "dtype": None, **options}


def scores(q, k, scale=None):
    """scale * Q K^T [..., Tq, Tk] in the inputs' dtype, soft-capped as the call asks: the reference's scores."""
    return reference.scores(q, k, scale=scale, **_reference({}))


_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("plain", default=False)


@contextlib.contextmanager
def plain_softmax():
    """Within: ``softmax_keys`` is torch.softmax as written, a row with no allowed key NaN (no convention), so that
    a model replayed on a target whose mask empties rows shows the NaN spreading as the target's does."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


def softmax_keys(s):
    """The reference's softmax over the keys; a row with no allowed key is left free and given zeros (or, within
    plain_softmax, NaN)."""
    if _PLAIN.get():
        return torch.softmax(s, dim=-1)  # [..., Tq, Tk]: NaN where a row has no allowed key
    leave_free(torch.isneginf(s).all(dim=-1, keepdim=True).expand(s.shape))  # [..., Tq, Tk]
    return reference.softmax_keys(s)


def weights(q, k, mask=None, scale=None, **options):
    """The reference's weights [..., Tq, Tk], in the inputs' dtype (its ``options``: causal, window, softcap)."""
    return softmax_keys(reference.scores(q, k, mask, scale=scale, **_reference(options)))


def correct(q, k, v, mask=None, scale=None, **options):
    """softmax(scale Q K^T + mask) V, the formula every mistake departs from: the reference's
    (attn_spec.reference.attention, with its ``options``: causal, window, softcap, ...), in the inputs' dtype."""
    return reference.attention(q, k, v, mask, scale=scale, softmax=softmax_keys, **_reference(options))[0]


def split_heads(t, h):
    """[T, D] -> [h, T, D / h]: head i takes columns i*D/h:(i+1)*D/h."""
    return t.reshape(t.shape[0], h, t.shape[-1] // h).transpose(0, 1)


def merge_heads(t):
    """[h, T, Dh] -> [T, h * Dh]."""
    return t.transpose(0, 1).reshape(t.shape[1], -1)


def lift(fn, x_q, x_kv, W, h, mask, **params):
    """A module that computes its heads with ``fn`` and is otherwise correct."""
    q, k, v = (split_heads(x @ W[name].T, h) for x, name in ((x_q, "W_Q"), (x_kv, "W_K"), (x_kv, "W_V")))
    return merge_heads(fn(q, k, v, mask, None, **params)) @ W["W_O"].T  # [Tq, D]
