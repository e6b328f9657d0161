"""A target in the kit's own process cannot game ``attn-spec check`` (issue 33.3): each attack below is written
as a small target and must fail with a cause that names it; the same check of a correct target is unchanged.

Monkeypatching (attn_spec.targets.integrity): torch's functions and the kit's own objects replaced at import
or during a call are put back and fail the ``integrity:untouched`` row."""
from __future__ import annotations

import textwrap

import pytest
import torch

import attn_spec
from attn_spec.report.results import TargetReport
from attn_spec.targets.integrity import Snapshot

RUN = dict(profile="quick", seed=20261203, only=["matches-reference"], diagnose=False)

CORRECT = '''
import math
import torch

def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
'''
WRONG = '''
import torch

def attention(Q, K, V, mask=None):
    return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)  # wrong everywhere
'''


def _check(tmp_path, source: str, **options):
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return attn_spec.check(f"{path}:attention", **{**RUN, **options}).targets[0]


def _integrity(report: TargetReport):
    return next((p for p in report.properties if p.id == "integrity:untouched"), None)


PATCHES_AT_IMPORT = {  # what a target replaces at import -> the name the report gives it
    "torch.softmax = lambda x, dim=-1, **kw: torch.ones_like(x) / x.shape[dim]": "torch.softmax",
    "import torch.nn.functional as F\nF.scaled_dot_product_attention = lambda *a, **k: a[2]":
        "torch.nn.functional.scaled_dot_product_attention",
    "torch.Tensor.__matmul__ = lambda a, b: torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)":
        "torch.Tensor.__matmul__",
    "torch.allclose = lambda *a, **k: True": "torch.allclose",
    "torch.testing.assert_close = lambda *a, **k: None": "torch.testing.assert_close",
    "torch.matmul = lambda a, b: torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)": "torch.matmul",
    "torch.exp = lambda x: x": "torch.exp",
    "import attn_spec.report.results as r\nr.TargetReport.conforms = property(lambda self: True)":
        "attn_spec.report.results.TargetReport.conforms",
    "import attn_spec.checking.tolerance as t\nt.budget = lambda *a, **k: float('inf')":
        "attn_spec.checking.tolerance.budget",
    "import attn_spec.reference as r\nr.attention = lambda q, k, v, *a, **kw: torch.zeros(1)": "attn_spec.reference.attention",
    "import attn_spec.checking.catalog as c\nobject.__setattr__(c.REGISTRY['matches-reference'], 'fn', lambda t, c: None)":
        "attn_spec.checking.catalog.REGISTRY['matches-reference'].fn",
}


@pytest.mark.parametrize("patch", list(PATCHES_AT_IMPORT))
def test_a_patch_at_import_is_undone_and_fails_naming_what_it_replaced(tmp_path, patch):
    """The wrong target patches what would make it pass; the kit undoes it before any property runs, so the
    target's own bug is found too, and the integrity row says what it replaced, at import."""
    before = Snapshot()
    report = _check(tmp_path, WRONG + "\n" + patch)
    assert not report.conforms and "DOES NOT CONFORM" in report.verdict
    row = _integrity(report)
    assert row is not None and row.status == "fail"
    assert f"replaced {PATCHES_AT_IMPORT[patch]}" in row.message and "at import" in row.message, row.message
    assert next(p for p in report.properties if p.id == "matches-reference").status == "fail"
    assert before.restore() == []  # everything is as it was before the target was loaded


def test_a_patch_made_during_a_call_fails_the_property_it_ran_in(tmp_path):
    """Replacing torch.allclose and torch.softmax on the first call (the kit's probe of the layout): the
    integrity row says when it happened; torch is whole again afterwards."""
    allclose = torch.allclose
    report = _check(tmp_path, '''
        import torch
        def attention(Q, K, V, mask=None):
            torch.allclose = lambda *a, **k: True
            torch.softmax = lambda x, dim=-1, **kw: torch.ones_like(x) / x.shape[dim]
            return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)
    ''')
    assert torch.allclose is allclose and not report.conforms
    row = _integrity(report)
    assert "replaced torch.allclose, torch.softmax during the layout probe" in row.message, row.message
    assert next(p for p in report.properties if p.id == "matches-reference").status == "fail"


def test_a_correct_target_has_no_integrity_row(tmp_path):
    report = _check(tmp_path, CORRECT)
    assert report.conforms and _integrity(report) is None
