"""The assertions every property fails through: one message grammar, earned budgets, NaN never passing."""
from __future__ import annotations

import math
import pathlib

import pytest
import torch

from attn_spec.checking.assertions import assert_close, assert_within, counting, fail, message, restate
from attn_spec.errors import Failure

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _raised(fn, *args, **kwargs) -> Failure:
    with pytest.raises(Failure) as info:
        fn(*args, **kwargs)
    return info.value


def test_the_grammar_orders_what_measured_expected_budget_call():
    assert message("max error 0.161", what="the output", expected="0", budget=6.56e-15,
                   call="attention(Q, K, V)") == \
        "the output: max error 0.161, expected 0, budget 6.56e-15 (call: attention(Q, K, V))"
    assert message("[2, 3]", what="the output's shape", expected="[2, 2]") == "the output's shape: [2, 3], expected [2, 2]"
    assert message("worded elsewhere") == "worded elsewhere"
    assert message("0.5", what="w", budget="relative 1e-06") == "w: 0.5, budget relative 1e-06"


def test_close_passes_within_the_budget_and_returns_the_error():
    got, expected = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7], dtype=torch.float64)
    err = assert_close(got, expected, budget=1e-6, what="the output")
    assert 0 < err <= 1e-6
    assert assert_close(got, got, budget=0.0, what="the output") == 0.0


def test_close_fails_with_the_error_budget_call_cause_and_tensors():
    got, expected = torch.tensor([[0.5, 0.5]]), torch.tensor([[0.25, 0.75]], dtype=torch.float64)
    failure = _raised(assert_close, got, expected, budget=1e-3, what="the output against the float64 reference",
                      call="attention(Q, K, V)", cause="the scale is wrong")
    assert failure.message == ("the output against the float64 reference: max error 0.25, budget 0.001 "
                               "(call: attention(Q, K, V))")
    assert failure.cause == "the scale is wrong"
    assert failure.got is got and failure.expected is expected
    assert isinstance(failure, AssertionError)


def test_close_can_show_other_tensors_than_those_compared():
    shown = (torch.eye(2), torch.ones(2, 2))
    failure = _raised(assert_close, torch.zeros(2), torch.ones(2), budget=0.1, what="the row sums", shown=shown)
    assert failure.got is shown[0] and failure.expected is shown[1]


def test_a_lazy_cause_is_computed_only_on_failure():
    calls = []

    def diagnose():
        calls.append(1)
        return "diagnosed"

    assert_close(torch.ones(2), torch.ones(2), budget=0.0, what="x", cause=diagnose)
    assert calls == []
    assert _raised(assert_close, torch.ones(2), torch.zeros(2), budget=0.0, what="x", cause=diagnose).cause == "diagnosed"
    assert calls == [1]


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_or_inf_in_the_result_never_passes_and_is_named(bad):
    got = torch.tensor([1.0, bad])
    failure = _raised(assert_close, got, torch.ones(2), budget=math.inf, what="the output")  # even an infinite budget
    assert "max error inf (the result has NaN or inf)" in failure.message


def test_nan_in_the_expected_values_is_named_on_their_side():
    failure = _raised(assert_close, torch.ones(2), torch.tensor([1.0, math.nan]), budget=1.0, what="the output")
    assert "(the expected values have NaN or inf)" in failure.message


@pytest.mark.parametrize("budget", [math.nan, -1.0])
def test_an_invalid_budget_is_a_bug_of_the_kit_not_a_pass(budget):
    with pytest.raises(ValueError, match="invalid budget"):
        assert_close(torch.ones(2), torch.ones(2), budget=budget, what="the output")
    with pytest.raises(ValueError, match="invalid budget"):
        assert_within(0.0, budget, what="a deviation")


def test_within():
    assert_within(1e-7, 1e-6, what="a deviation")
    assert_within(1e-6, 1e-6, what="a deviation")
    failure = _raised(assert_within, 0.5, 1e-6, what="how far an output lies outside the range", call="attention(Q, K, V)",
                      cause="not convex", got=torch.zeros(1), expected_tensor=torch.ones(1))
    assert failure.message == "how far an output lies outside the range: 0.5, budget 1e-06 (call: attention(Q, K, V))"
    assert failure.cause == "not convex" and failure.got is not None and failure.expected is not None
    assert "nan, budget" in _raised(assert_within, math.nan, 1.0, what="a deviation").message


def test_fail_words_a_non_numeric_check():
    failure = _raised(fail, "float32", what="the output's dtype", expected="float16, the inputs' dtype",
                      call="attention(Q, K, V)", cause="a buffer made without dtype=")
    assert failure.message == "the output's dtype: float32, expected float16, the inputs' dtype (call: attention(Q, K, V))"
    assert failure.got is None and failure.expected is None


def test_restate_prefixes_the_property_and_keeps_everything():
    original = Failure("the output: max error 1", cause="a cause", got=torch.ones(1), expected=torch.zeros(1))
    with pytest.raises(Failure) as info:
        restate(original, "matches-reference: ")
    again = info.value
    assert again.message == "matches-reference: the output: max error 1\nlikely cause: a cause"
    assert again.cause == "a cause" and again.got is original.got and again.expected is original.expected


def test_failures_are_raised_only_through_the_failure_grammar():
    grammar = {ROOT / "attn_spec" / "failures.py", ROOT / "attn_spec" / "checking" / "assertions.py"}
    sites = [f"{path.relative_to(ROOT)}:{n}" for folder in ("attn_spec", "properties")
             for path in sorted((ROOT / folder).rglob("*.py")) if path not in grammar
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1) if "raise Failure(" in line]
    assert not sites, f"raise failures through attn_spec.failures (fail) or checking.assertions: {sites}"


def test_a_failure_counts_the_calls_made_before_its_cause_is_worded():
    """A cause that costs calls (a probe of which inputs the output follows) explains the failure; the calls
    that found it are those made before: Failure.calls, what found_after_calls reports."""
    class Counted:
        calls = 3

    target = Counted()

    def cause():
        target.calls += 6  # the diagnosis calls the target again
        return "why"

    with counting(target):
        failure = _raised(fail, "1.2", what="the output", cause=cause)
    assert (failure.calls, failure.cause, target.calls) == (3, "why", 9)
    assert _raised(fail, "1.2", what="the output").calls is None  # outside a property's run: nothing counted
