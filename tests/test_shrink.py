"""A failing explicit example is shrunk by the kit (Hypothesis shrinks only what it draws), and the explicit
examples that cost the fewest calls run first (issue 25.5: calls to the first failure)."""
from __future__ import annotations

import math

import torch

import attn_spec
from attn_spec.checking.cases import Case
from attn_spec.properties import catalog
from attn_spec.checking.shrink import _drawable, _smaller, _words
from attn_spec.reference import MultiHeadAttention, reference_attention
from attn_spec.targets.conventions import make_target


def no_scale(Q, K, V, mask=None):
    scores = (Q @ K.transpose(-2, -1)).masked_fill(~mask, -math.inf) if mask is not None else Q @ K.transpose(-2, -1)
    return torch.softmax(scores, dim=-1) @ V


def fails_on_the_first_example(Q, K, V, mask=None):  # right, except on that example's own tensors
    out = reference_attention(Q, K, V, mask)
    own = catalog()["matches-reference"].examples[0].tensors()  # Q, K, V, mask
    same = all(a is not None and a.shape == b.shape and a.stride() == b.stride() and torch.equal(a, b)
               for a, b in zip((Q, K, V, mask), own))
    return out + 1 if same else out


def _matches_reference(target):
    report = attn_spec.check(target, profile="quick", seed=1, only=["matches-reference"], diagnose=False)
    return report.targets[0].properties[0]


def test_the_richest_example_runs_first_and_its_failure_is_shrunk():
    first = catalog()["matches-reference"].examples[0]
    assert first.batch == (2, 3) and first.layout == "heads" and first.mask == "random"
    result = _matches_reference(no_scale)
    assert result.status == "fail" and result.found_after_calls == 1  # found on the first call, the richest case
    case = result.case
    assert case.batch == () and case.mask == "none" and case.n_q * case.n_kv < first.n_q * first.n_kv
    assert case.n_kv >= 2 and case.d_k >= 2  # one key, or d_k = 1 (sqrt(1) = 1), would hide a missing scale
    assert "not scaled" in result.cause and result.counterexample.case["n_kv"] == case.n_kv


def test_an_example_nothing_smaller_fails_stays_as_it_was():
    result = _matches_reference(fails_on_the_first_example)
    assert result.status == "fail" and result.case == catalog()["matches-reference"].examples[0]


def test_candidates_stay_what_the_property_draws():
    square = {"cross": False, "masks": ("none", "random")}
    case = Case(batch=(2,), n_q=3, n_kv=3, d_k=2, d_v=2, mask="causal", seed=4)
    steps = list(_smaller(case, square))
    assert Case(batch=(2,), n_q=1, n_kv=1, d_k=2, d_v=2, mask="causal", seed=4) in steps
    assert all(s.n_q == s.n_kv and s.d_k == s.d_v for s in steps)  # self-attention shapes shrink together
    assert not _drawable(case, square)  # a causal mask is not among the property's masks
    assert not _drawable(Case(batch=()), {"batch": True, "masks": ("none",)})
    assert not _drawable(Case(n_kv=1), {"min_n_kv": 2, "masks": ("none",)})
    packed = Case(n_q=2, n_kv=2, segments=((1, 1), (1, 1)))
    assert list(_smaller(packed, {})) == []  # a packed batch keeps its segments


def test_a_cause_is_the_same_whatever_it_measured():
    assert _words("error 3e-07, budget 7.24e-15") == _words("error 1e-07, budget 8e-15")
    assert _words("scores are not scaled") != _words("float64 inputs computed at float32 precision")


def test_a_module_gets_its_unbatched_examples_first():
    """A module is called once per batch element: the [2, 3]-batch example would cost it 6 calls."""
    module, function = make_target(MultiHeadAttention), make_target(no_scale)
    examples = catalog()["matches-reference"].examples
    assert [module.calls_per_attend(c) for c in examples] == [6, 1, 1, 2]
    assert {function.calls_per_attend(c) for c in examples} == {1}
    assert sorted(examples, key=module.calls_per_attend)[0].batch == ()
