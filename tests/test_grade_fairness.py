"""What a grade says (issue 14, fairness): scoring policies, the summary's diagnosis, a class's usual mistakes.

Checked in-process on graded rows built here; tests/test_grade.py checks the same rules on a graded class.
"""
from __future__ import annotations

import pytest

from attn_spec.cli import main
from attn_spec.grading import rubric as rubrics
from attn_spec.grading.grader import Grade, PropertyGrade, _score
from attn_spec.grading.outputs import feedback_markdown, grades_csv, summary_markdown
from attn_spec.report.results import PropertyResult


def _row(pid, status, conv="function", max_points=2.0, blocked_by=None, cause=""):
    return PropertyGrade(pid, status, cause=cause, blocked_by=blocked_by, convention=conv, max_points=max_points)


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


def test_charge_blocked_decides_whether_a_blocked_failure_costs_its_points():
    rows = lambda: [_row("scale-sqrt-dk", "fail"), _row("matches-reference", "fail", blocked_by="scale-sqrt-dk"),  # noqa: E731
                    _row("rows-sum-to-one", "pass"), _row("gqa-equivalence", "n/a")]
    default = rubrics.load(None)
    assert default.charge_blocked is False
    fair = _graded(rows(), default)
    assert (fair.score, fair.max_score) == (2, 4)  # lost: scale-sqrt-dk's 2 points, nothing for what it blocks
    charged = _graded(rows(), rubrics.parse("charge_blocked = true"))
    assert (charged.score, charged.max_score) == (2, 6)
    with pytest.raises(rubrics.RubricError, match="charge_blocked must be true or false"):
        rubrics.parse('charge_blocked = "no"')


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


def test_grades_csv_writes_na_and_blocked_not_zero():
    rubric = rubrics.load(None)
    grade = _graded([_row("scale-sqrt-dk", "fail"), _row("matches-reference", "fail", blocked_by="scale-sqrt-dk"),
                     _row("gqa-equivalence", "n/a")], rubric)
    header, row = grades_csv([grade]).splitlines()
    cells = dict(zip(header.split(","), row.split(",")))
    assert cells["function:scale-sqrt-dk"] == "0" and cells["function:gqa-equivalence"] == "n/a"
    assert cells["function:matches-reference"] == "blocked"


def test_the_summary_diagnoses_from_root_failures_only():
    """A blocked failure's own guess ("your custom backward is wrong") is not the class's diagnosis."""
    rubric = rubrics.load(None)
    guess = "a custom autograd.Function computes the wrong backward"
    grades = [_graded([_row("scale-sqrt-dk", "fail", cause="scores are not scaled by 1/sqrt(d_k)"),
                       _row("gradients", "fail", blocked_by="scale-sqrt-dk", cause=guess)], rubric, name)
              for name in ("alice", "bob")]
    summary = summary_markdown(grades, rubric)
    assert guess not in summary
    assert "| gradients | function | 2 of 2 | blocked by scale-sqrt-dk |" in summary
    assert "| scale-sqrt-dk | function | 2 of 2 | scores are not scaled by 1/sqrt(d_k) |" in summary


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
