"""A second probe where one probe cannot tell mistake models apart (``attn_spec.diagnosis.discriminate``)."""
import math

import pytest
import torch

import attn_spec.properties  # noqa: F401 - registers the catalog
from attn_spec.checking.catalog import REGISTRY
from attn_spec.diagnosis.discriminate import separate, variants
from attn_spec.diagnosis.evidence import gather
from attn_spec.diagnosis.model import MISTAKES
from attn_spec.diagnosis.roots import group
from attn_spec.errors import Failure
from attn_spec.targets.capabilities import supports
from attn_spec.targets.conventions import make_target


def _attend(q, k, v, mask, scale):
    s = q @ k.transpose(-2, -1) * scale  # [..., Tq, Tk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def unscaled(q, k, v, mask=None):
    return _attend(q, k, v, mask, 1.0)


def scaled_by_value_width(q, k, v, mask=None):
    return _attend(q, k, v, mask, 1 / math.sqrt(v.shape[-1]))


def _root(fn):
    """The one root of the scale probe's failure at d_v = 1 (the property's own example case)."""
    target = make_target(fn, fn.__name__, "function")
    supports(target, ["float64"], "cpu")
    case = next(c for c in REGISTRY["scale-sqrt-dk"].examples if getattr(c, "d_v", None) == 1)
    with pytest.raises(Failure):  # run once, as the check did: what it probes once per target is not replayed
        REGISTRY["scale-sqrt-dk"].fn(target, case)
    evidences = {"scale-sqrt-dk": gather("scale-sqrt-dk", REGISTRY["scale-sqrt-dk"].fn, target, case)}
    roots = group(["scale-sqrt-dk"], evidences, order=["scale-sqrt-dk"], after={}, mistakes=list(MISTAKES.values()))
    assert len(roots) == 1
    return roots[0], evidences, target


@pytest.mark.parametrize("fn, named", [(unscaled, "scale-missing"), (scaled_by_value_width, "scale-d-v")])
def test_the_scale_probe_at_d_v_1_is_told_apart_by_a_second_probe(fn, named):
    root, evidences, target = _root(fn)
    tied = {root.mistake, *(mid for mid, _ in root.tied)}
    assert {"scale-missing", "scale-d-v"} <= tied  # at d_v = 1 both give the target's numbers
    separate(root, evidences, target)
    assert root.mistake == named and root.second_probe["picked"] == named, root.evidence
    assert "d_v = 3 instead of 1" in root.evidence and "ambiguous" not in root.evidence
    assert not {"scale-missing", "scale-d-v"} - {named} & set(root.ambiguous)


def test_when_the_second_probe_matches_none_the_root_says_ambiguous():
    root, evidences, target = _root(unscaled)
    target = make_target(lambda q, k, v, mask=None: _attend(q, k, v, mask, 0.3), "other", "function")
    separate(root, evidences, target)  # the second probe asks a target that is neither
    assert "ambiguous" in root.evidence and "none of them" in root.evidence and root.ambiguous
    assert root.second_probe is None


def test_the_variants_change_one_thing_each():
    from attn_spec.targets.record import Call

    q, k, v = torch.ones(2, 4, dtype=torch.float64), torch.ones(3, 4, dtype=torch.float64), torch.ones(3, 1,
                                                                                                        dtype=torch.float64)
    shapes = {words: tuple(tuple(x[n].shape) for n in "qkv") for words, x in variants(Call("attend", {"q": q, "k": k,
                                                                                                       "v": v}))}
    assert shapes["d_v = 3 instead of 1"] == ((2, 4), (3, 4), (3, 3))
    assert shapes["n_q = 4 instead of 2"] == ((4, 4), (3, 4), (3, 1))
    assert shapes["n_kv = 5 instead of 3"] == ((2, 4), (5, 4), (5, 1))
    assert shapes["d_k = 8 instead of 4"] == ((2, 8), (3, 8), (3, 1))
    assert shapes["a batch of two"] == ((2, 2, 4), (2, 3, 4), (2, 3, 1))
