"""The one grammar every failure of a property is raised in (``fail``), at the ground floor beside
:mod:`attn_spec.errors`: the targets' own checks of an output and the properties' assertions
(:mod:`attn_spec.checking.assertions`) raise through it.

    <what>: <measured>[, expected <expected>][, budget <budget>][ (call: <call>)]

- ``what``: the quantity measured, a noun phrase ("the output against the float64 reference");
- ``measured``: its value on this case ("max error 0.161");
- ``expected``: what a correct attention gives, when that is not simply "within the budget";
- ``budget``: how far the measured value may go, earned by measurement (``checking.tolerance``);
- ``call``: the call of the target that produced the measured value, written as the user would.

The likely bug (``cause``, one sentence) and the tensors shown side by side (``got`` and
``expected_tensor``) travel on the :class:`attn_spec.errors.Failure`. A property names the cause and leaves
its wording to the diagnosis: ``cause=because("key", **facts)`` (:class:`Because`), worded when the failure
is raised by the function the package's root hands :func:`word_causes_with` (attn_spec.diagnosis.causes.word),
so a wording that costs calls is made only when the assertion fails. A plain string or a function
returning one is taken as it is.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Callable, NoReturn, Union

from attn_spec.errors import Failure


@dataclass(frozen=True, eq=False)
class Because:
    """The cause a property names, for the diagnosis to word (attn_spec.diagnosis.causes): ``key`` names the
    behaviour that broke, ``facts`` what the property measured (numbers, tensors, the target to probe further)."""

    key: str
    facts: dict = field(default_factory=dict)


def because(key: str, **facts) -> Because:
    """``Because(key, facts)``: ``cause=because("causal-off-by-one")``, ``because("scale-named", name=name)``."""
    return Because(key, facts)


Cause = Union[str, Callable[[], str], Because]
_WORDING: list[Callable[[Because], str]] = []  # the one function that words a Because (word_causes_with)


def word_causes_with(word: Callable[[Because], str]) -> None:
    """Word every :class:`Because` with ``word`` from now on (the package's root hands it the diagnosis's)."""
    _WORDING[:] = [word]


def worded(cause: Cause) -> str:
    """The cause in words: a Because worded by the diagnosis, a function called, a string as it is."""
    if isinstance(cause, Because):
        return _WORDING[0](cause) if _WORDING else cause.key
    return cause() if callable(cause) else cause

# The target whose calls a failure counts (the runner sets it while a property runs): ``fail`` notes its call
# count before wording the cause, so Failure.calls is the calls that found the failure, not those that explain it.
_COUNTED: contextvars.ContextVar = contextvars.ContextVar("attn_spec_counted_target", default=None)


@contextlib.contextmanager
def counting(target):
    """While this runs, a failure raised through :func:`fail` records ``target.calls`` as it was when the
    property's relation failed (``Failure.calls``), before a ``cause`` that costs calls is worded."""
    token = _COUNTED.set(target)
    try:
        yield
    finally:
        _COUNTED.reset(token)


def number(x) -> str:
    """A measured number as the grammar prints it: 3 significant digits."""
    return f"{x:.3g}" if isinstance(x, (int, float)) else str(x)


def message(measured: str, *, what: str = "", expected: str = "", budget=None, call: str = "") -> str:
    """The failure message in the grammar above; empty parts are left out."""
    text = f"{what}: {measured}" if what else measured
    if expected:
        text += f", expected {expected}"
    if budget is not None:
        text += f", budget {number(budget)}"
    return f"{text} (call: {call})" if call else text


def fail(measured: str, *, what: str = "", expected: str = "", budget=None, call: str = "", cause: Cause = "",
         got=None, expected_tensor=None, labels=None, inputs=None, vacuous: bool = False, mask=None,
         summary: str | dict = "") -> NoReturn:
    """Raise the Failure: the property does not hold on this case. ``labels``: what the shown tensors are,
    (got, expected); by default the result of ``call`` and the float64 reference. ``inputs``: the tensors
    ``call`` was given, when they are not the case's own (a probe's). ``vacuous``: the property would
    hold only trivially (the output ignores its inputs). ``mask``, ``summary`` (words, or sizes by name): see Failure."""
    labels = labels or (f"the result of {call}" if call else "the target's result", compared_with(what))
    counted = _COUNTED.get()
    calls = None if counted is None else counted.calls  # before the cause: its calls explain the failure, not find it
    failure = Failure(message(measured, what=what, expected=expected, budget=budget, call=call),
                      cause=worded(cause), got=got, expected=expected_tensor, labels=labels,
                      inputs=inputs, vacuous=vacuous, mask=mask, summary=summary, call=call)
    failure.calls = calls
    raise failure


def with_mask(mask, name: str = "mask") -> str:
    """``", mask"`` where the call took a mask, else "": a ``call`` names every argument the target got."""
    return f", {name}" if mask is not None else ""


def compared_with(what: str) -> str:
    """What a measured quantity is compared with, as ``what`` names it ("the output on K + c against the output
    before": "the output before"); the float64 reference where ``what`` names nothing. The default label of
    ``expected`` (a counterexample's columns say what they really are)."""
    return what.rsplit(" against ", 1)[1] if " against " in what else "the float64 reference"
