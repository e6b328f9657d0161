"""The kit judged by the gallery: every bug caught by the properties that exist for it, no
false alarm on any correct variant (``tests/gallery``)."""
import pytest

import attn_spec
from gallery import BUGGY, CORRECT

SEED = 20261129
KILLS: dict[str, bool] = {}  # buggy entry -> caught; read by conftest's summary
ALARMS: dict[str, list[str]] = {}  # correct entry -> properties that failed


@pytest.mark.parametrize("profile", ["quick", "default"])
@pytest.mark.parametrize("entry", CORRECT, ids=str)
def test_correct_variant_conforms(entry, profile):
    report = attn_spec.check(entry.obj, name=entry.name, convention=entry.convention, profile=profile, seed=SEED)
    failed = [p.id for p in report.targets[0].properties if p.status not in ("pass", "skip")]
    ALARMS.setdefault(entry.name, []).extend(failed)
    assert report.conforms, str(report)


@pytest.mark.parametrize("entry", BUGGY, ids=str)
def test_bug_is_caught(entry):
    report = attn_spec.check(entry.obj, name=entry.name, convention=entry.convention, profile="quick",
                             seed=SEED, only=list(entry.catches))
    results = {p.id: p for p in report.targets[0].properties}
    missed = [pid for pid in entry.catches if results[pid].status != "fail"]
    KILLS[entry.name] = not missed
    assert not missed, f"{entry.name} ({entry.bug}) was not caught by {missed}\n{report}"
    for pid in entry.catches:  # a failure must teach: message, counterexample and reproduction
        r = results[pid]
        assert r.message
        if not r.blocked_by:
            assert r.counterexample and "attn_spec.reproduce" in r.counterexample["reproduce"]
