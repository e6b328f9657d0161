"""The properties' assertions, raised in the one failure grammar of :mod:`attn_spec.failures`.

    >>> assert_close(out, ref, budget=1e-6, what="the output against the float64 reference",
    ...              call="attention(Q, K, V)", cause="the scale is wrong")
    Failure: the output against the float64 reference: max error 0.161, budget 1e-06 (call: attention(Q, K, V))
"""
from __future__ import annotations

import math
from typing import NoReturn

import torch

from attn_spec.checking.tolerance import max_error
from attn_spec.errors import Failure
from attn_spec.failures import (  # noqa: F401 - the grammar, raised from here too
    Cause, compared_with, counting, fail, message, number, with_mask)


def _check_budget(budget: float, what: str) -> None:
    if math.isnan(budget) or budget < 0:  # a NaN budget would pass everything: a bug of the kit, never a pass
        raise ValueError(f"attn-spec computed an invalid budget ({budget}) for {what}")


NONFINITE_CAUSE = ("the target's output has NaN or inf on finite inputs: this comparison cannot tell anything "
                   "else until that is fixed")


def assert_close(got: torch.Tensor, expected: torch.Tensor, *, budget: float, what: str, call: str = "",
                 cause: Cause = "", shown=None, labels=None, inputs=None) -> float:
    """max |got - expected| <= budget; NaN or inf anywhere is an infinite error, which fails. Returns the error.

    ``shown``: the (got, expected) tensors to print when they are not the two compared; ``inputs``: the tensors
    of the call, when they are not the case's own (see fail). An ``expected``
    with NaN or inf (the target's own output, transformed) gives no lesson of its own: the failure says
    so ("NaN or inf on both sides") instead of ``cause``.
    """
    _check_budget(budget, what)
    err = max_error(got, expected)
    if err <= budget and math.isfinite(err):  # NaN or inf on either side never passes, whatever the budget
        return err
    measured = f"max error {number(err)}"
    if math.isinf(err):
        bad_got, bad_expected = (not torch.isfinite(t.detach()).all() for t in (got, expected))
        side = ("NaN or inf on both sides" if bad_got and bad_expected else
                "the result has NaN or inf" if bad_got else "the expected values have NaN or inf")
        measured += f" ({side})"
        if bad_expected:
            cause = NONFINITE_CAUSE
    shown_got, shown_expected = shown if shown is not None else (got, expected)
    fail(measured, what=what, budget=budget, call=call, cause=cause, got=shown_got, expected_tensor=shown_expected,
         labels=labels, inputs=inputs)


def assert_within(value: float, limit: float, *, what: str, call: str = "", cause: Cause = "", got=None,
                  expected_tensor=None, labels=None) -> None:
    """value <= limit (a NaN value fails): a measured deviation within its budget."""
    _check_budget(limit, what)
    if not value <= limit:
        fail(number(value), what=what, budget=limit, call=call, cause=cause, got=got, expected_tensor=expected_tensor,
             labels=labels)


def restate(failure: Failure, prefix: str, notes: str = "") -> NoReturn:
    """Raise ``failure`` again with ``prefix``, its cause and ``notes`` in the message (a reproduction
    prints it whole)."""
    note = f"\nlikely cause: {failure.cause}" if failure.cause else ""
    note += f"\n{notes}" if notes else ""
    raise Failure(f"{prefix}{failure.message}{note}", cause=failure.cause, got=failure.got,
                  expected=failure.expected, labels=failure.labels, inputs=failure.inputs) from None
