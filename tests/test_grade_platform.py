"""A platform defect is never charged to a student (issue 26, item 2).

The defect is injected on both sides, as on a machine whose torch has it: in the grader (monkeypatched, the
kit's plain formulas see it) and in the submission's own sandboxed process (the file patches its torch at
import, as the platform would). bfloat16 ``@`` then gives NaN on strided views with gaps, as torch 2.13's
oneDNN does on some CPUs (tests/test_platform.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attn_spec.grading import rubric as rubrics
from attn_spec.grading.grader import Grade, PropertyGrade, _score
from attn_spec.grading.pool import grade_all
from attn_spec.grading.submissions import discover
from grading_run import HERE
from test_platform import _broken

INJECT = '''
import math
import torch

def _gaps(t):
    return (isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_contiguous()
            and not t.transpose(-2, -1).is_contiguous() and t.stride(-1) == 1)

_matmul = torch.Tensor.__matmul__

def _platform(a, b):  # the platform's defect, not the student's code
    out = _matmul(a, b)
    return torch.full_like(out, math.nan) if out.dtype == torch.bfloat16 and (_gaps(a) or _gaps(b)) else out

torch.Tensor.__matmul__ = _platform
'''


@pytest.fixture
def graded(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.Tensor, "__matmul__", _broken(torch.Tensor.__matmul__))  # the grader's torch
    monkeypatch.setattr(F, "linear", _broken(F.linear))
    seed = (HERE / "submissions" / "correct_seed.py").read_text()
    (tmp_path / "on_a_broken_platform.py").write_text(seed + INJECT)
    (tmp_path / "correct.py").write_text(seed)
    rubric = rubrics.parse('dtypes = ["bfloat16"]\nseed = 3\n[module]\npolicy = "when-defined"\n')
    return {g.name: g for g in grade_all(discover(str(tmp_path), rubric), rubric, jobs=1)}


@pytest.mark.slow
def test_a_platform_defect_costs_a_correct_submission_nothing(graded):
    hit, clean = graded["on_a_broken_platform"], graded["correct"]
    assert hit.outcome == clean.outcome == "graded"
    assert hit.score == hit.max_score == clean.max_score > 0, [(p.id, p.status, p.message[:80])
                                                               for p in hit.properties if p.points < p.max_points]
    row = next(p for p in hit.properties if p.id == "non-contiguous")  # the kit's reference lost its cases too
    assert row.status == "n/a" and "lost to a platform defect" in row.message
    assert any(p.platform and p.status == "pass" for p in hit.properties)  # cases drawn again, then passed


def test_a_property_the_platform_kept_from_being_checked_is_not_charged():
    """When only the student's run lost every case to the platform (the kit's reference was spared), the
    property is a skip of nobody's doing: its points are kept, the total is everyone's."""
    note = {"what": "bfloat16 @ gives NaN on strided inputs"}
    lost = PropertyGrade("non-contiguous", "skip", convention="function", max_points=1.0, platform=[note, note],
                         message="not checked: 2 cases lost to a platform defect (see the header), "
                                 "each drawn again where it could be")
    declined = PropertyGrade("mask-semantics", "skip", convention="function", max_points=1.0, platform=[note],
                             message="not checked: the submission declines bfloat16")  # its own doing
    grade = Grade("s", "graded", properties=[lost, declined])
    _score(grade, rubrics.load(None))
    assert (lost.points, declined.points, grade.score, grade.max_score) == (1.0, 0.0, 1.0, 2.0)

