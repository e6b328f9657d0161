"""Folding symptoms into their cause (``attn_spec.diagnosis.fold``): each root's model replayed on the other
roots' failures at the target's own dtype and with the mask's emptied rows left NaN."""
from attn_spec.checking.cases import Case
from attn_spec.properties import catalog
from attn_spec.diagnosis.evidence import gather
from attn_spec.diagnosis.fold import fold, reproduced
from attn_spec.diagnosis.model import MISTAKES
from attn_spec.diagnosis.roots import generic, group
from attn_spec.targets.capabilities import supports
from attn_spec.targets.conventions import make_target
from gallery.unseen import unscaled_in_half_precision

# float16 at d_k=128 with entries of size 60: unscaled scores overflow float16 and saturate to one-hot
SATURATING = Case(n_q=4, n_kv=4, d_k=128, d_v=2, dtype="float16", mask="causal", seed=0, values="normal",
                  magnitude=60.0)


def test_a_missing_scale_that_saturates_float16_is_one_root_not_a_mask_bug():
    target = make_target(unscaled_in_half_precision, "unscaled", "function")
    supports(target, ["float64", "float16"], "cpu")  # probed first, as a check does: the replays are the properties' own
    cases = {"scale-sqrt-dk": Case(n_q=1, n_kv=2, d_k=16, d_v=2), "causal-mask": SATURATING,
             "matches-reference": SATURATING}
    evidences, shortlist = {}, []
    for pid, case in cases.items():
        evidences[pid] = gather(pid, catalog()[pid].fn, target, case, shortlist=shortlist)
        shortlist += [f.mistake.id for f in evidences[pid].fits]
    assert evidences["scale-sqrt-dk"].fits[0].mistake.id == "scale-missing"
    # as first replayed (float64 copies), the saturated cases are no missing scale: other stories, or none
    assert not any(f.mistake.id == "scale-missing" for pid in ("causal-mask", "matches-reference")
                   for f in evidences[pid].fits)
    order = list(cases)
    first = group(order, evidences, order=order, after={}, mistakes=list(MISTAKES.values()))
    assert len(first) > 1
    roots = fold(first, evidences, order, generic)
    assert len(roots) == 1 and roots[0].mistake == "scale-missing", [(d.mistake, d.explains) for d in roots]
    assert roots[0].explains == order and roots[0].root == "scale-sqrt-dk"
    assert {p for f in roots[0].folded for p in f["explains"]} == {"causal-mask", "matches-reference"}
    assert "at the target's own dtype" in roots[0].evidence
    assert reproduced("scale-missing", {}, evidences["causal-mask"]) == "at the target's own dtype"
    assert reproduced("mask-inverted", {}, evidences["causal-mask"]) is None


def test_an_uncertain_fold_is_said_not_made():
    """Root B (named on its own) has two failures and A's model reproduces only one: the roots stay apart."""
    from attn_spec.diagnosis.roots import Diagnosis
    from gallery.unseen import inverted_mask_without_guard

    unscaled = make_target(unscaled_in_half_precision, "unscaled", "function")
    inverted = make_target(inverted_mask_without_guard, "inverted", "function")
    for t in (unscaled, inverted):
        supports(t, ["float64"], "cpu")
    small = Case(n_q=3, n_kv=3, d_k=4, d_v=2, values="normal", mask="causal", seed=1)
    evidences = {"scale-sqrt-dk": gather("scale-sqrt-dk", catalog()["scale-sqrt-dk"].fn, unscaled,
                                         Case(n_q=1, n_kv=2, d_k=16, d_v=2)),
                 "matches-reference": gather("matches-reference", catalog()["matches-reference"].fn, unscaled, small),
                 "causal-mask": gather("causal-mask", catalog()["causal-mask"].fn, inverted, small)}
    order = ["scale-sqrt-dk", "causal-mask", "matches-reference"]
    a = Diagnosis("scale-sqrt-dk", "scale-missing", "no scale", "", ["scale-sqrt-dk"], "")
    b = Diagnosis("causal-mask", "mask-inverted", "inverted", "", ["causal-mask", "matches-reference"], "")
    assert reproduced("scale-missing", {}, evidences["matches-reference"]) is not None
    assert reproduced("scale-missing", {}, evidences["causal-mask"]) is None
    roots = fold([a, b], evidences, order, generic)
    assert roots == [a, b] and a.explains == ["scale-sqrt-dk"] and not a.folded
    assert "not folded" in b.evidence and b.explains == ["causal-mask", "matches-reference"]
