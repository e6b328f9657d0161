"""Roots the recorded calls name by themselves (``attn_spec.diagnosis.measured``), before any mistake model
is fitted: an output that is no tensor, named by its type; K transposed over the wrong pair of axes, named
from where the calls crashed against K's shapes. Each target is a newcomer's code, not a gallery entry."""
from __future__ import annotations

import math

import pytest
import torch

import attn_spec

SEED = 7
FEW = ["rows-sum-to-one", "matches-reference", "batch-independence", "determinism", "gradients"]


def _attention(q, k, v, mask=None, *, keys=lambda k: k.transpose(-2, -1)):
    s = q @ keys(k) / math.sqrt(q.shape[-1])  # [..., Tq, Tk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v  # [..., Tq, Dv]


def returns_numpy(q, k, v, mask=None):
    return _attention(q, k, v, mask).detach().numpy()


def returns_list(q, k, v, mask=None):
    return _attention(q, k, v, mask).tolist()


def returns_float(q, k, v, mask=None):
    return float(_attention(q, k, v, mask).sum())


def returns_none(q, k, v, mask=None):
    _attention(q, k, v, mask)  # the return statement forgotten


def keys_transposed_0_1(q, k, v, mask=None):
    return _attention(q, k, v, mask, keys=lambda k: k.transpose(0, 1))  # right on 2-D K only


def _roots(fn, only=FEW):
    report = attn_spec.check(fn, profile="quick", seed=SEED, only=only)
    target = report.targets[0]
    return target, target.diagnoses


@pytest.mark.parametrize("fn, words", [(returns_numpy, "returns a numpy.ndarray: return a torch.Tensor (NumPy "
                                                       "also leaves the autograd graph)"),
                                       (returns_list, "returns a list"), (returns_float, "returns a float"),
                                       (returns_none, "returns None")])
def test_an_output_that_is_no_tensor_is_one_root_named_by_its_type(fn, words):
    target, roots = _roots(fn)
    failed = [p.id for p in target.properties if p.status == "fail"]
    assert len(roots) == 1 and roots[0].sentence.startswith(words), [d.sentence for d in roots]
    assert sorted(roots[0].explains) == sorted(failed) and "determinism" in failed
    assert "call to call" not in roots[0].sentence and "random" not in roots[0].fix
    assert all(words.split(":")[0] in p.cause for p in target.properties if p.status == "fail")


@pytest.mark.slow
def test_keys_transposed_over_the_wrong_axes_is_one_root_named_from_the_shapes():
    target, roots = _roots(keys_transposed_0_1, only=None)
    failed = {p.id for p in target.properties if p.status == "fail"}
    assert len(roots) == 1, [(d.sentence, d.explains) for d in roots]
    d = roots[0]
    assert "K.transpose(0, 1)" in d.sentence and d.mistake != "queries-keys-swapped"
    assert set(d.explains) == failed and "dims 0 and 1 differ" in d.evidence
    assert d.to_dict()["mistake"] is None and d.named


def test_the_transpose_is_not_named_for_code_that_is_right_on_batches():
    """The measurement replays the wrong pair on every call: a correct target, or one with another bug
    (a missing scale), gets no transpose root."""
    def unscaled(q, k, v, mask=None):
        return _attention(q * math.sqrt(q.shape[-1]), k, v, mask)

    _, roots = _roots(unscaled, only=["matches-reference", "batch-independence"])
    assert roots and not any("transpose" in d.sentence for d in roots)
