"""Counterexamples that tell the truth (issue 23, item 4) and a verdict typed until it is rendered (issue 22,
item 4): each column labelled with what it is, the inputs and the output of the same failing batch element, the
mask in the call, a module's projection weights, small matrices printed whole; Status and Counterexample as
types, written by one ``render(what, fmt)``."""
import json
import math
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec.cases import Case
from attn_spec.errors import KitUsageError
from attn_spec.report import Counterexample, PropertyResult, Status, render
from attn_spec.report.matrices import CORNER, format_matrix
from gallery import BUGGY

ROOT = Path(__file__).resolve().parents[1]

SEED = 20261129
ENTRIES = {e.name: e for e in BUGGY}


def _check(fn, only, **keywords):
    report = attn_spec.check(fn, profile="quick", seed=SEED, only=only, diagnose=False, **keywords)
    return report, {p.id: p for p in report.targets[0].properties}


def _gallery(name, only):
    e = ENTRIES[name]
    return _check(e.obj, only, name=e.name, convention=e.convention, masks=e.masks, **e.options)


def second_element_unscaled(Q, K, V, mask=None):
    """Correct, except that batch element 1 (of a batched call) has no 1/sqrt(d_k): element 0 passes."""
    scores = Q @ K.transpose(-2, -1)  # [..., Tq, Tk]
    scale = torch.full(scores.shape[:-2] + (1, 1), 1 / math.sqrt(Q.shape[-1]), dtype=scores.dtype)
    if scores.dim() >= 3 and scores.shape[0] > 1:
        scale[1] = 1.0
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


def test_a_batched_counterexample_shows_the_inputs_and_output_of_the_failing_element():
    report, results = _check(second_element_unscaled, ["matches-reference"])
    ce = results["matches-reference"].counterexample
    assert isinstance(ce, Counterexample) and ce.element and ce.element[0] == 1, ce.element  # not element [0]
    case = Case(**{**ce.case, "batch": tuple(ce.case["batch"])})
    q, k, v, _ = case.tensors()
    for name, t in (("Q", q), ("K", k), ("V", v)):
        shown = ce.inputs[name]
        assert shown.element == ce.element  # the same element as the output's
        assert torch.equal(torch.tensor(shown.corner, dtype=torch.float64), t[ce.element].double())
    where = f"[{', '.join(map(str, ce.element))}] ["
    assert where in ce["inputs_text"] and ce["got_text"].startswith(where)  # and it says which element
    assert "\n".join("    " + line for line in ce["inputs_text"].splitlines()) in str(report)


def test_labels_say_what_expected_is():
    """non-contiguous compares with the target's own output on contiguous copies, not the float64 reference."""
    _, results = _gallery("assumes_row_major", ["non-contiguous"])
    labels = results["non-contiguous"].counterexample["labels"]
    assert labels[1] == "the target's own output on contiguous copies of them", labels
    _, results = _gallery("sequence_first_reshape", ["batch-independence"])
    labels = results["batch-independence"].counterexample["labels"]
    assert "float64 reference" not in labels[1] and "own output" in labels[1], labels


def test_the_default_label_is_what_the_measurement_names():
    from attn_spec.checking.assertions import compared_with
    assert compared_with("the output on K + c against the output before") == "the output before"
    assert compared_with("the output against the float64 reference") == "the float64 reference"
    assert compared_with("the smallest weight") == "the float64 reference"


def test_the_mask_is_in_the_call_and_in_the_reproduce_snippet():
    _, results = _gallery("ignores_mask", ["value-linearity"])
    failed = results["value-linearity"]
    assert failed.status == "fail" and failed.case.mask != "none"
    assert ", mask)" in failed.message, failed.message
    snippet = failed.counterexample["reproduce"]
    assert "Q, K, V, mask = case.tensors()" in snippet and "True = may attend" in snippet
    call = next(line for line in snippet.splitlines() if line.startswith("# the call that failed:"))
    assert "mask" in call, snippet
    exec(snippet.replace("attn_spec.reproduce(", "(lambda *a, **k: None)("), {})  # the lines before it run as printed


def test_a_modules_counterexample_shows_its_projection_weights_and_heads():
    _, results = _gallery("SplitWithoutTranspose", ["head-concat-equivalence"])
    ce = results["head-concat-equivalence"].counterexample
    assert {"W_Q", "W_K", "W_V", "W_O"} <= set(ce["inputs"])
    assert all(ce["inputs"][name] is not None for name in ("W_Q", "W_O"))  # small: the values themselves
    assert "W_Q" in ce["inputs_text"] and "heads" in ce["summary"]
    assert "weights: W_Q, W_K, W_V, W_O" in ce["reproduce"] and "heads" in ce["reproduce"]


def test_small_matrices_are_printed_whole():
    whole = format_matrix(torch.arange(2 * CORNER, dtype=torch.float64).reshape(2, CORNER))
    assert "…" not in whole and str(float(2 * CORNER - 1))[:2] in whole
    cut = format_matrix(torch.zeros(CORNER + 1, CORNER + 1))
    assert "…" in cut and "⋮" in cut and f"[{CORNER + 1}x{CORNER + 1}]" in cut
    q = torch.arange(32, dtype=torch.float64).reshape(2, 16)  # [2, 16]: the scale probe's inputs at d_k = 16
    ce = Counterexample.of(case={}, summary="", got=q[:1, :2], expected=q[:1, :2] + 1, labels=("got", "expected"),
                           inputs={"q": q, "K": q}, seed=0, reproduce="")
    assert "…" not in ce["inputs_text"] and "[2x16]" in ce["inputs_text"] and "31" in ce["inputs_text"]


def test_a_counterexample_reads_back_from_its_json_as_it_was_written():
    report, results = _gallery("ignores_mask", ["causal-mask"])
    ce = results["causal-mask"].counterexample
    back = Counterexample.from_dict(json.loads(report.to_json())["targets"][0]["properties"][0]["counterexample"])
    assert back.to_dict() == json.loads(json.dumps(ce.to_dict()))
    failed = results["causal-mask"]
    row = PropertyResult("causal-mask", "fail", failed.message, failed.statement, failed.cause,
                         counterexample=back.to_dict())  # a grade's row, plain data
    assert render(row, "markdown") == render(failed, "markdown") and render(row, "text") == render(failed, "text")


def test_status_is_typed_and_keeps_its_public_strings():
    result = PropertyResult("x", "pass")
    assert result.status is Status.PASS and result.status == "pass" and f"{result.status}" == "pass"
    assert json.loads(json.dumps(result.to_dict()))["status"] == "pass"
    result.status = "not-run"
    assert result.status is Status.NOT_RUN
    with pytest.raises(ValueError):
        result.status = "failed"


def test_one_render_writes_every_format():
    report, results = _gallery("ignores_mask", ["causal-mask"])
    assert render(report, "text") == str(report) and render(report, "markdown") == report.to_markdown()
    assert render(report, "html") == report._repr_html_() and render(report, "json") == report.to_json() + "\n"
    assert "<testsuites" in render(report, "junit")
    assert render(results["causal-mask"], "text").startswith("✗ causal-mask")
    with pytest.raises(KitUsageError):
        render(report, "pdf")


def test_a_module_report_says_which_properties_ran_with_heads():
    """Issue 23.5: a reader of a module's report must know which checks drew heads and weights (so "the first
    batch element" cannot be read as "the first head")."""
    report = attn_spec.check(f"{ROOT / 'examples' / 'seed_attention.py'}:MultiHeadAttention", profile="quick", seed=0,
                             only=["rows-sum-to-one", "scale-sqrt-dk", "head-concat-equivalence"])
    (line,) = [n for n in report.targets[0].notes if n.startswith("heads: ")]
    assert "head-concat-equivalence drew 1 to 4 heads" in line and "rows-sum-to-one ran one head" in line
    # scale-sqrt-dk draws heads but reads them through identity projections: not among the random-weight ones
    assert "scale-sqrt-dk drew the heads and read each through projections that select" in line
    assert line in str(report)
    plain = attn_spec.check(f"{ROOT / 'examples' / 'seed_attention.py'}:attention", profile="quick", seed=0,
                            only=["rows-sum-to-one"])
    assert not any(n.startswith("heads: ") for n in plain.targets[0].notes)
