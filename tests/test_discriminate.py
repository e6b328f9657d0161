"""A second probe where one probe cannot tell mistake models apart (``attn_spec.diagnosis.discriminate``)."""
import math

import pytest
import torch
from attn_spec.properties import catalog
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
    case = next(c for c in catalog()["scale-sqrt-dk"].examples if getattr(c, "d_v", None) == 1)
    with pytest.raises(Failure):  # run once, as the check did: what it probes once per target is not replayed
        catalog()["scale-sqrt-dk"].fn(target, case)
    evidences = {"scale-sqrt-dk": gather("scale-sqrt-dk", catalog()["scale-sqrt-dk"].fn, target, case)}
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


# ---------------------------------------------------------------- modules: heads, projections, widths


class _Heads(torch.nn.Module):
    """A multi-head module, Cls(d_model, n_heads) with nn.Linear W_Q, W_K, W_V, W_O; ``attend`` is its one bug."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def split(self, t):  # [n, d_model] -> [h, n, d_k]
        return t.view(t.size(0), self.h, self.d_k).transpose(0, 1)

    def merge(self, heads):  # [h, n, d_k] -> [n, d_model]
        return heads.transpose(0, 1).reshape(heads.size(1), -1)

    def attend(self, q, k, v, mask):  # [h, Tq, Dh], [h, Tk, Dh], [h, Tk, Dh] -> [h, Tq, Dh]
        return _attend(q, k, v, mask, 1 / math.sqrt(self.d_k))

    def forward(self, x_q, x_kv, mask=None):
        q, k, v = self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv))
        return self.W_O(self.merge(self.attend(q, k, v, mask)))


class ScaledByModelWidth(_Heads):
    def attend(self, q, k, v, mask):
        return _attend(q, k, v, mask, 1 / math.sqrt(self.h * self.d_k))  # bug: d_model, not the head's d_k


class ScaledByHeadWidth(_Heads):
    def attend(self, q, k, v, mask):
        return _attend(q, k, v, mask, 1 / self.d_k)  # bug: 1/d_k, no square root


class SoftmaxOverTheHeads(_Heads):
    def attend(self, q, k, v, mask):
        s = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)  # [h, Tq, Tk]
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.softmax(s, dim=0) @ v  # bug: over the heads


class SplitAndMergedByView(_Heads):
    def split(self, t):
        return t.reshape(self.h, t.size(0), self.d_k)  # bug: no transpose

    def merge(self, heads):
        return heads.reshape(heads.size(1), -1)  # bug: no transpose


class SplitByView(_Heads):
    def split(self, t):
        return t.reshape(self.h, t.size(0), self.d_k)  # bug: no transpose


def _module_root(cls, only, monkeypatch, *, probe=True, shrunk=False):
    """The one root of a module checked on ``only`` (the first pass alone when ``probe`` is False). The ties are
    those of the property's examples as written: unless ``shrunk``, the kit's shrinking of a failing example
    (checking.shrink) is left out, since it changes which call the diagnosis reads."""
    import attn_spec
    import attn_spec.checking.runner as runner
    import attn_spec.diagnosis.run as run

    if not probe:
        monkeypatch.setattr(run, "separate_all", lambda roots, evidences, target: roots)
    if not shrunk:
        monkeypatch.setattr(runner, "shrink", lambda prop, target, failure, options, fit: failure)
    report = attn_spec.check(cls, name=cls.__name__, convention="module", profile="quick", seed=20261129, only=[only])
    roots = report.targets[0].diagnoses
    assert len(roots) == 1, [(d.mistake, d.explains) for d in roots]
    return roots[0]


# module bug, the property it is checked on, the model it is, the models the first pass ties with it there
MODULE_TIES = [
    (ScaledByModelWidth, "head-concat-equivalence", "scale-d-model", {"scale-one-over-dk", "scale-hard-coded"}),
    (ScaledByHeadWidth, "head-concat-equivalence", "scale-one-over-dk", {"scale-d-model", "scale-hard-coded"}),
    (SoftmaxOverTheHeads, "scale-sqrt-dk", "softmax-over-heads", {"uniform-weights"}),
    (SplitAndMergedByView, "scale-sqrt-dk", "heads-split-and-merged-without-transpose",
     {"relu-normalised", "returns-values"}),
]


@pytest.mark.parametrize("cls, only, named, tie", MODULE_TIES, ids=[c[0].__name__ for c in MODULE_TIES])
def test_a_module_tie_exists_on_the_first_pass(cls, only, named, tie, monkeypatch):
    """d_model = 4 with 2 heads makes 1/sqrt(d_model), 1/d_head and 1/sqrt(4) one number; the scale probe's
    identity projections and two tokens make the heads' plumbing look like other softmax mistakes."""
    root = _module_root(cls, only, monkeypatch, probe=False)
    assert {named, *tie} <= {root.mistake, *(mid for mid, _ in root.tied)}, (root.mistake, root.tied)


@pytest.mark.parametrize("cls, only, named, tie", MODULE_TIES, ids=[c[0].__name__ for c in MODULE_TIES])
def test_a_module_tie_is_told_apart_by_calling_it_with_other_heads_or_widths(cls, only, named, tie, monkeypatch):
    root = _module_root(cls, only, monkeypatch)
    assert root.mistake == named and root.second_probe and root.second_probe["picked"] == named, root.evidence
    assert tie <= set(root.second_probe["ruled_out"]) and not tie & set(root.ambiguous) and named not in root.ambiguous
    assert "second probe was run: the failing call's inputs with n_heads = 1 instead of 2" in root.evidence
    assert "ambiguous" not in root.evidence


@pytest.mark.parametrize("cls, only, named, tie", MODULE_TIES, ids=[c[0].__name__ for c in MODULE_TIES])
def test_a_module_bug_is_named_when_its_example_is_shrunk(cls, only, named, tie, monkeypatch):
    """As a user runs it: the failing example shrunk first, then diagnosed (with the probe where a tie is left)."""
    assert _module_root(cls, only, monkeypatch, shrunk=True).mistake == named


def test_a_first_pass_pick_the_probe_rules_out_gives_way_to_a_survivor(monkeypatch):
    """The scale probe's calls fit batch-sequence-first as well as a split without transpose; 4 heads rule it out.
    What is left is two names for one computation (a split without transpose reads the heads' memory as if
    contiguous), so the root stays ambiguous between them, and names the module's own plumbing."""
    first = _module_root(SplitByView, "scale-sqrt-dk", monkeypatch, probe=False)
    assert first.mistake == "batch-sequence-first"
    monkeypatch.undo()
    root = _module_root(SplitByView, "scale-sqrt-dk", monkeypatch)
    assert root.mistake == "heads-split-without-transpose" and root.ambiguous == ["assumes-contiguous"]
    assert "n_heads = 4 instead of 2 (assumes-contiguous, heads-split-without-transpose reproduce" in root.evidence
    assert root.second_probe is None


def test_the_module_variants_change_one_thing_each():
    from attn_spec.diagnosis.discriminate import module_variants
    from attn_spec.targets.record import Call

    x = torch.randn(3, 4, dtype=torch.float64)
    W = {n: torch.randn(4, 4, dtype=torch.float64) for n in ("W_Q", "W_K", "W_V", "W_O")}
    mask = torch.ones(3, 3, dtype=torch.bool).tril()
    found = dict(module_variants(Call("multihead", {"x_q": x, "x_kv": x.clone(), "weights": W, "n_heads": 2,
                                                   "mask": mask})))
    assert [found[w]["n_heads"] for w in ("n_heads = 1 instead of 2", "n_heads = 4 instead of 2")] == [1, 4]
    assert all(not torch.equal(found["random W_Q, W_K, W_V, W_O"]["weights"][n], W[n]) for n in W)
    wide = found["d_model = 6 instead of 4 (each head one column wider)"]
    at = [0, 1, 3, 4]  # head 0 keeps columns 0, 1 and gains 2; head 1 keeps 3, 4 and gains 5
    assert torch.equal(wide["weights"]["W_Q"][at][:, at], W["W_Q"]) and not wide["weights"]["W_Q"][2].any()
    assert torch.equal(wide["x_q"][:, at], x) and not wide["x_q"][:, [2, 5]].any()
    for v in found.values():  # self-attention stays self-attention: a module may take nothing else
        assert v["x_kv"] is v["x_q"]
    more = found["n = 5 tokens instead of 3"]
    assert more["x_q"].shape == (5, 4) and torch.equal(more["mask"], torch.ones(5, 5, dtype=torch.bool).tril())
