"""The diagnosis on bugs the mistake catalog has no model for (``tests/gallery/unseen.py``): each gets one root,
named by a measured fit (the scale against the shapes, the normaliser, batch mixing) or honestly
"unexplained", with the numbers measured; no root contradicts a property that passed."""
import pytest

import attn_spec
from gallery.unseen import UNSEEN

SEED = 20261129


def test_the_unseen_gallery_is_large_enough_and_not_catalogued():
    from attn_spec.diagnosis import MISTAKES

    assert len(UNSEEN) >= 15 and len({e.name for e in UNSEEN}) == len(UNSEEN)
    assert not {e.name.replace("_", "-") for e in UNSEEN} & set(MISTAKES)


@pytest.mark.slow
@pytest.mark.parametrize("entry", UNSEEN, ids=str)
def test_an_uncatalogued_bug_gets_one_root_named_by_a_fit_or_unexplained(entry):
    from attn_spec.diagnosis import MISTAKES

    report = attn_spec.check(entry.obj, name=entry.name, profile=entry.profile, seed=SEED)
    target = report.targets[0]
    failed = {p.id for p in target.properties if p.status == "fail"}
    assert failed and not report.conforms, f"{entry.name} ({entry.bug}) was not caught"
    roots = target.diagnoses
    assert len(roots) == 1, [(d.sentence, d.explains) for d in roots]
    d = roots[0]
    assert set(d.explains) == failed and d.consistent_with_passing and entry.says in d.sentence, d.sentence
    if entry.expect in MISTAKES:  # a catalogued cause whose symptoms look like other bugs: folded into one root
        assert d.mistake == entry.expect and d.named and not d.fit, (d.sentence, d.evidence)
        return
    assert d.mistake is None
    if entry.expect == "unexplained":
        assert d.sentence.startswith("unexplained") and not d.fit and d.evidence, d.sentence
    else:
        assert d.fit and d.fit["quantity"] == entry.expect, (d.sentence, d.fit)
        assert d.fit["formula"] and d.fit["values"] and "measured" in d.evidence
        assert d.to_dict()["fit"] == d.fit
