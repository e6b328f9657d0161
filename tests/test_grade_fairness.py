"""What a grade says (issue 14, fairness): scoring policies, the summary's diagnosis, a class's usual mistakes.

Checked in-process on graded rows built here; tests/test_grade.py checks the same rules on a graded class.
"""
from __future__ import annotations

import pytest
import torch

from attn_spec.cli import main
from attn_spec.grading import rubric as rubrics
from attn_spec.grading.grader import Grade, PropertyGrade, _score
from attn_spec.grading import roots
from attn_spec.grading.outputs import feedback_markdown, grades_csv
from attn_spec.grading.summary import class_view, summary_html, summary_markdown
from attn_spec.report.results import PropertyResult


def _row(pid, status, conv="function", max_points=2.0, blocked_by=None, cause="", explained_by=""):
    return PropertyGrade(pid, status, cause=cause, blocked_by=blocked_by, convention=conv, max_points=max_points,
                         explained_by=explained_by)


def _graded(rows, rubric, name="s"):
    grade = Grade(name, "graded", properties=rows)
    _score(grade, rubric)
    return grade


def test_a_graded_row_is_a_property_result_with_points():
    row = _row("scale-sqrt-dk", "fail")
    assert isinstance(row, PropertyResult) and row.to_dict()["id"] == "scale-sqrt-dk"
    written = _graded([row], rubrics.load(None)).to_dict()["properties"][0]  # as grades.json has it
    assert written["id"] == "scale-sqrt-dk" and written["status"] == "fail"
    assert written["convention"] == "function" and written["max_points"] == 2.0 and written["points"] == 0.0


def test_a_symptom_of_a_checked_root_keeps_its_points_unless_the_rubric_charges_it():
    """One max_score for everyone; a failure a root's mistake explains costs nothing beyond the root's points;
    a failure blocked only by the catalog's order (no mistake reproduces it) is charged."""
    rows = lambda: [_row("scale-sqrt-dk", "fail", explained_by="scale-missing"),  # noqa: E731
                    _row("matches-reference", "fail", blocked_by="scale-sqrt-dk", explained_by="scale-missing"),
                    _row("gradients", "fail", blocked_by="scale-sqrt-dk"),
                    _row("rows-sum-to-one", "pass"), _row("gqa-equivalence", "n/a")]
    default = rubrics.load(None)
    assert default.charge_blocked is False
    fair = _graded(rows(), default)
    assert (fair.score, fair.max_score) == (4, 8)  # lost: scale-sqrt-dk's 2 points and the unexplained gradients'
    charged = _graded(rows(), rubrics.parse("charge_blocked = true"))
    assert (charged.score, charged.max_score) == (2, 8)
    with pytest.raises(rubrics.RubricError, match="charge_blocked must be true or false"):
        rubrics.parse('charge_blocked = "no"')


def test_a_root_is_charged_once_at_the_weight_of_the_most_important_property_it_breaks():
    """Issue 38: a mask bug whose root the diagnosis names on mask-semantics (1 point) but which also breaks
    causal-mask (2) cost 1; it costs 2 now, on causal-mask, and the feedback says why."""
    rubric = rubrics.load(None)
    rows = [_row("mask-semantics", "fail", max_points=1.0, explained_by="mask-after-softmax"),
            _row("causal-mask", "fail", blocked_by="mask-semantics", explained_by="mask-after-softmax"),
            _row("value-linearity", "fail", max_points=1.0, blocked_by="mask-semantics", explained_by="mask-after-softmax"),
            _row("rows-sum-to-one", "pass")]
    grade = _root(_graded(rows, rubric), "mask-after-softmax", ["mask-semantics", "causal-mask", "value-linearity"])
    assert (grade.score, grade.max_score) == (4, 6)
    assert [(r.id, r.points) for r in grade.properties] == [("mask-semantics", 1), ("causal-mask", 0),
                                                            ("value-linearity", 1), ("rows-sum-to-one", 2)]
    feedback = feedback_markdown(grade, rubric)
    assert ("- charged: 2 points, the weight of causal-mask, the most important of the 3 properties it breaks; the "
            "others are not charged") in feedback
    assert "| causal-mask | ✗ fail (symptom of root 1) | 0 / 2 (the mistake's charge) |" in feedback
    assert "| mask-semantics | ✗ fail (root 1: mask-after-softmax) | 1 / 1 (not charged) |" in feedback
    alone = _root(_graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing")], rubric), "scale-missing",
                  ["scale-sqrt-dk"])
    assert "- charged: 2 points, the weight of scale-sqrt-dk, the only property it breaks" in \
        feedback_markdown(alone, rubric)


def test_the_rubric_can_price_a_mistake_whatever_it_breaks():
    """[function.mistakes]: a mistake's price, taken from its heaviest broken properties first, at most what they
    are worth; an id outside the catalog is a usage error."""
    rubric = rubrics.parse('[function.mistakes]\nmask-after-softmax = 3\n')
    rubric.check_catalog()
    rows = [_row("mask-semantics", "fail", max_points=1.0, explained_by="mask-after-softmax"),
            _row("causal-mask", "fail", blocked_by="mask-semantics", explained_by="mask-after-softmax"),
            _row("value-linearity", "fail", max_points=1.0, blocked_by="mask-semantics", explained_by="mask-after-softmax")]
    grade = _root(_graded(rows, rubric), "mask-after-softmax", ["mask-semantics", "causal-mask", "value-linearity"])
    assert [(r.id, r.points) for r in grade.properties] == [("mask-semantics", 0), ("causal-mask", 0),
                                                            ("value-linearity", 1)]
    assert ("- charged: 3 points, the rubric's price of mask-after-softmax ([function.mistakes]), taken from "
            "mask-semantics, causal-mask; the others are not charged") in feedback_markdown(grade, rubric)
    high = _graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing")],
                   rubrics.parse('[function.mistakes]\nscale-missing = 50\n'))
    assert high.score == 0  # at most what the failures are worth
    with pytest.raises(rubrics.RubricError, match="unknown mistake"):
        rubrics.parse('[function.mistakes]\nno-such-mistake = 1\n').check_catalog()
    with pytest.raises(rubrics.RubricError, match="must be a table"):
        rubrics.parse('[function]\nmistakes = 3\n')


def test_also_failing_lines_are_whole():
    """Issue 38.6: the feedback cut each "also failing" line at 160 characters with "…"."""
    rubric = rubrics.load(None)
    long = "the output against the float64 reference: " + "max error 3.2 at [0, 1], " * 12 + "budget 1e-6"
    grade = _root(_graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing"),
                           _row("matches-reference", "fail", blocked_by="scale-sqrt-dk", explained_by="scale-missing")],
                          rubric), "scale-missing", ["scale-sqrt-dk", "matches-reference"])
    grade.properties[1].message = long
    feedback = feedback_markdown(grade, rubric)
    line = next(x for x in feedback.splitlines() if x.startswith("- matches-reference (not charged): "))
    assert line.endswith("budget 1e-6") and "…" not in line


def test_full_marks_leave_the_bonus_out():
    rubric = rubrics.load(None)
    grade = _graded([_row("rows-sum-to-one", "pass"), _row("matches-reference", "fail"),
                     _row("head-concat-equivalence", "pass", "module", 5.0)], rubric)
    assert grade.score > grade.max_score and not grade.full_marks  # 7 of 4, with a 5-point bonus: not full marks
    assert _graded([_row("rows-sum-to-one", "pass")], rubric).full_marks


def test_the_default_bonus_is_small():
    rubric = rubrics.load(None)
    module = sum(rubric.conventions["module"].points_for(p) for p in ("head-concat-equivalence", "scale-sqrt-dk",
                                                                       "matches-reference"))
    assert rubric.conventions["module"].default_points <= 0.1 and module <= 1.0


@pytest.mark.parametrize("policy, attempt_wins", [("bonus", True), ("when-defined", False)])
def test_the_module_policy_decides_whether_attempting_it_can_lower_a_grade(policy, attempt_wins):
    rubric = rubrics.parse(f'[module]\npolicy = "{policy}"')
    function = lambda: [_row("rows-sum-to-one", "pass"), _row("matches-reference", "pass")]  # noqa: E731
    skipped = _graded(function(), rubric)
    attempted = _graded(function() + [_row("head-concat-equivalence", "fail", "module", 3.0),
                                      _row("matches-reference", "pass", "module")], rubric)
    ratio = lambda g: g.score / g.max_score  # noqa: E731
    assert (ratio(attempted) >= ratio(skipped)) is attempt_wins
    feedback = feedback_markdown(attempted, rubric)
    assert {"bonus": "Optional, a bonus", "when-defined": "Counted when defined"}[policy] in feedback


def test_module_policies_parse_and_the_old_required_key_keeps_its_meaning():
    assert rubrics.load(None).conventions["module"].policy == "bonus"
    assert rubrics.load(None).conventions["function"].policy == "required"
    assert rubrics.parse("[module]\nrequired = false").conventions["module"].policy == "when-defined"
    assert rubrics.parse("[module]\nrequired = true").conventions["module"].required
    for text, words in [('[module]\npolicy = "sometimes"', "must be one of"),
                        ('[module]\nrequired = true\npolicy = "bonus"', "contradicts"),
                        ('[module]\nrequired = "yes"', "true or false")]:
        with pytest.raises(rubrics.RubricError, match=words):
            rubrics.parse(text)


def test_grades_csv_writes_na_not_zero_and_a_symptom_its_points():
    rubric = rubrics.load(None)
    grade = _graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing"),
                     _row("matches-reference", "fail", blocked_by="scale-sqrt-dk", explained_by="scale-missing"),
                     _row("gqa-equivalence", "n/a")], rubric)
    header, row = grades_csv([grade]).splitlines()
    cells = dict(zip(header.split(","), row.split(",")))
    assert cells["function:scale-sqrt-dk"] == "0" and cells["function:gqa-equivalence"] == "n/a"
    assert cells["function:matches-reference"] == "2"


def _root(grade, mistake, explains, conv="function"):
    m = roots.MISTAKES[mistake]
    grade.roots.append({"root": explains[0], "mistake": mistake, "sentence": m.describe(), "fix": m.fix_for(),
                        "explains": explains, "evidence": "reproduces every call", "convention": conv})
    return grade


def test_the_summary_shows_the_class_mistakes_then_what_no_mistake_explains():
    """The instructor's view: each mistake with its students, fix and lesson; unexplained failures by property;
    load failures in neither; the bonus out of the statistics."""
    rubric = rubrics.load(None)
    scaled = [_root(_graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing"),
                             _row("gradients", "fail", blocked_by="scale-sqrt-dk", explained_by="scale-missing"),
                             _row("head-concat-equivalence", "pass", "module", 1.0)], rubric, name),
                    "scale-missing", ["scale-sqrt-dk", "gradients"]) for name in ("alice", "bob")]
    odd = _graded([_row("scale-sqrt-dk", "pass"), _row("gradients", "fail", cause="the backward is wrong")], rubric, "carol")
    broken = _graded([_row("scale-sqrt-dk", "not-run"), _row("gradients", "not-run")], rubric, "dave")
    broken.outcome = "import-error"
    view = class_view(scaled + [odd, broken], rubric)
    summary = summary_markdown(view)
    fix = roots.MISTAKES["scale-missing"].fix_for()
    assert f"| scale-missing | function | 2 of 4 | alice, bob | {fix} | `attn-spec explain scale-missing` |" in summary
    assert "| gradients | function | 1 of 3 | carol | the backward is wrong |" in summary  # dave did not load
    assert view["scores"]["mean"] == pytest.approx((2 / 4 + 2 / 4 + 2 / 4 + 0) / 4)  # alice's bonus left out
    assert "Who made which mistake" not in summary_html(view)  # a handful: no heatmap
    many = class_view([_root(_graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing")], rubric, f"s{i}"),
                             "scale-missing", ["scale-sqrt-dk"]) for i in range(6)], rubric)
    page = summary_html(many)
    assert "Who made which mistake" in page and page.count("class='x'") == 6


def test_names_in_the_summary_cannot_add_markup():
    rubric = rubrics.load(None)
    grade = _root(_graded([_row("scale-sqrt-dk", "fail", explained_by="scale-missing")], rubric, "<b>x</b>|y"),
                  "scale-missing", ["scale-sqrt-dk"])
    view = class_view([grade] * 6, rubric)
    assert "<b>" not in summary_html(view) and "<b>x</b>|y" not in summary_markdown(view)


@pytest.mark.parametrize("make, words", [
    (lambda tmp: tmp / "nowhere", "no such file or folder"),
    (lambda tmp: tmp, "holds no submissions"),
])
def test_an_empty_or_missing_class_is_a_usage_error_before_anything_starts(tmp_path, capsys, monkeypatch, make, words):
    from attn_spec.grading.isolation import zygote

    (tmp_path / "_ignored.py").write_text("")
    (tmp_path / "notes.txt").write_text("")
    monkeypatch.setattr(zygote, "launch", lambda: pytest.fail("the grading worker started"))
    assert main(["grade", str(make(tmp_path)), "--out", str(tmp_path.parent / "grades-out")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def test_a_claimed_root_needs_parameters_from_the_catalog():
    """attn_spec.grading.roots takes a root's parameters only as the catalog has them: one of a model's
    settings, or its fitted number within range; anything else is refused (the claim comes from the child)."""
    fitted, settings, plain = (roots.MISTAKES[m] for m in ("scale-temperature", "scale-hard-coded", "scale-missing"))
    assert roots._params({"temperature": 0.9}, fitted) == {"temperature": 0.9}
    for bad in ({"temperature": 50.0}, {"temperature": "0.9"}, {"temperature": float("nan")}, {"t": 1.0}, [], None):
        assert roots._params(bad, fitted) is None
    assert roots._params(dict(settings.params[0]), settings) == dict(settings.params[0])
    assert roots._params({"width": 3}, settings) is None
    assert roots._params({}, plain) == {} and roots._params({"x": 1}, plain) is None


def test_a_claimed_root_is_kept_only_where_the_graders_replay_reproduces_it():
    """The grader's own replay decides: a true claim explains its failures, a false one (another mistake, or
    a failure the mistake does not reproduce) explains nothing."""
    from attn_spec.properties import catalog
    from attn_spec.checking.runner import run_property
    from attn_spec.targets.conventions import FunctionTarget

    def no_scale(Q, K, V, mask=None):
        scores = Q @ K.transpose(-2, -1)
        return torch.softmax(scores if mask is None else scores.masked_fill(~mask, float("-inf")), dim=-1) @ V

    target = FunctionTarget(no_scale, "attention")
    rows = {pid: run_property(catalog()[pid], target, profile="quick", seed=7, dtypes=["float64"], devices=["cpu"])
            for pid in ("scale-sqrt-dk", "matches-reference")}
    assert all(r.status == "fail" for r in rows.values())
    cases = {pid: roots.case_of(r) for pid, r in rows.items()}
    order = list(rows)

    def claim(mistake, explains=order):
        return {"root": explains[0], "mistake": mistake, "params": {}, "explains": list(explains), "guess": False}
    kept = roots._checked(claim("scale-missing"), rows, cases, target, set(), order)
    assert kept.mistake == "scale-missing" and kept.explains == order and "replayed by the grader" in kept.evidence
    assert kept.sentence == roots.MISTAKES["scale-missing"].describe({})  # the kit's words, not the claim's
    assert roots._checked(claim("softmax-over-queries"), rows, cases, target, set(), order) is None
    assert roots._checked(dict(claim("scale-missing"), guess=True), rows, cases, target, set(), order) is None
    assert roots._checked(claim("no-such-mistake"), rows, cases, target, set(), order) is None
    assert roots._checked(claim("scale-missing"), rows, cases, target, set(order), order) is None  # already taken
    assert roots._checked(claim("scale-missing"), rows, cases, target, set(), order, [0]) is None  # no replay left
