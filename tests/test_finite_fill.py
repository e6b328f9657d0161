"""A finite mask fill is judged at the scores attention really reaches (|score| <= 65504, what float16 holds), and
how far it stays exact is reported as the ``finite-fill`` behaviour, never punished beyond that range."""
import math

import torch

import attn_spec
from attn_spec.properties.inputs import SCORE_RANGE, sink_levels
from attn_spec.targets.behaviours import probe_behaviours
from attn_spec.targets.conventions import make_target
from gallery.contracts import d2l_masked_softmax, fill_replaces_finfo_min, fill_replaces_minus_1e4
from gallery.masking import additive_minus_1e4

ONLY = dict(only=["mask-semantics"], profile="quick", seed=3)


def _scores(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])  # [..., Tq, Tk]


def masked_fill_minus_1e6(Q, K, V, mask=None):
    """d2l's fill through masked_fill: float16 cannot hold -1e6 there (masked_fill raises), so float32 and float64."""
    scores = _scores(Q, K)
    return torch.softmax(scores if mask is None else scores.masked_fill(~mask, -1e6), dim=-1) @ V


def additive_minus_1e9(Q, K, V, mask=None):
    scores = _scores(Q, K)
    return torch.softmax(scores if mask is None else scores + (~mask) * -1e9, dim=-1) @ V


def test_the_score_range_is_what_half_precision_holds():
    assert SCORE_RANGE == torch.finfo(torch.float16).max
    assert sink_levels(torch.float32) == (SCORE_RANGE, math.sqrt(SCORE_RANGE))  # no longer -1e8
    assert sink_levels(torch.float16)[0] == torch.finfo(torch.float16).max / 2


def test_finite_fill_reports_how_far_a_fill_stays_exact():
    found = {fn.__name__: probe_behaviours(make_target(fn))["finite-fill"]
             for fn in (d2l_masked_softmax, masked_fill_minus_1e6, additive_minus_1e4, fill_replaces_minus_1e4,
                        additive_minus_1e9, fill_replaces_finfo_min)}
    assert found == {"d2l_masked_softmax": "exact below 1e6", "masked_fill_minus_1e6": "exact below 1e6",
                     "additive_minus_1e4": "exact below 1e4", "fill_replaces_minus_1e4": "exact below 1e4",
                     "additive_minus_1e9": "exact below 1e9", "fill_replaces_finfo_min": "exact"}, found


def test_an_additive_minus_1e4_mask_fails_mask_semantics_with_its_root():
    """Hugging Face's old BERT mask (a bug seen training T5 in float16): allowed scores 1e4 apart hand weight to
    masked keys, well within the range attention reaches."""
    (t,) = attn_spec.check(additive_minus_1e4, dtypes=["float32"], **ONLY).targets
    assert not t.conforms and t.properties[0].status == "fail"
    assert [(d.mistake, d.params) for d in t.diagnoses] == [("mask-bias-finite", {"bias": -1e4})]


def test_fills_beyond_the_range_conform_and_report_the_behaviour():
    for fn, dtypes in ((masked_fill_minus_1e6, ["float32", "float64"]), (additive_minus_1e9, ["float32", "float64"]),
                       (d2l_masked_softmax, None)):
        report = attn_spec.check(fn, dtypes=dtypes, **ONLY)
        (t,) = report.targets
        assert t.conforms and t.verdict == "CONFORMS", str(report)
        assert t.behaviours["finite-fill"] == ("exact below 1e9" if fn is additive_minus_1e9 else "exact below 1e6")
        assert f"finite-fill={t.behaviours['finite-fill']}" in str(report)


def test_finite_fill_can_be_required():
    report = attn_spec.check(d2l_masked_softmax, require=["finite-fill=exact"], **ONLY)
    (req,) = [p for p in report.targets[0].properties if p.id == "convention:finite-fill"]
    assert req.status == "fail" and req.message == "required finite-fill=exact, found finite-fill=exact below 1e6"
