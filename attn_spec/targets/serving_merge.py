"""The ``merge`` convention: a function that combines two partial attentions by their log-sum-exp, FlashInfer's
``merge_state`` style, detected from its parameter names.

    v, s = merge_state(v_a [T, H, D], s_a [T, H], v_b [T, H, D], s_b [T, H])

A partial attention over a set of keys K_i is (out_i, lse_i) with lse_i = log sum_{j in K_i} exp(score_j); over
the union, lse = log(exp(lse_a) + exp(lse_b)) and out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b. The
empty set of keys is (0, -inf): merging it with anything leaves that thing unchanged, and merging two of them
gives (0, -inf) again, not NaN (FlashInfer #4051). Split-KV decoding, cascade attention and ring attention
all rest on this merge.

The LSE's base is probed and reported in the header: e (flash-attn, vLLM, FlexAttention) or 2 (FlashInfer's
kernels: ``m + log2(d)``); the properties hand the kernel LSEs in the base it was found to use.
"""
from __future__ import annotations

import math

import torch

from attn_spec.failures import fail
from attn_spec.errors import Unsupported
from attn_spec.targets.base import Target, _call
from attn_spec.vocabulary import Traits

F64 = torch.float64
NAMES = (("v_a", "s_a", "v_b", "s_b"), ("out_a", "lse_a", "out_b", "lse_b"))


class MergeTarget(Target):
    """``fn(v_a, s_a, v_b, s_b) -> (v, s)``: two partial attentions [T, H, D] with their LSEs [T, H], merged."""

    traits = Traits("merge", "merge_state(v_a [T, H, D], s_a [T, H], v_b, s_b) -> (v, s): partial attentions merged "
                    "by their LSE", kind="serving", trained=False, masks=(), layout="v [T, H, D], s [T, H]",
                    detect_rank=36)

    @staticmethod
    def detects(obj, names) -> bool:
        return bool(names) and any(list(names[:4]) == list(n) for n in NAMES)

    def __init__(self, obj, name, masks=None, **kwargs):
        super().__init__(obj, name, masks, **kwargs)
        self.log = None  # a list while a failure is replayed (attn_spec.diagnosis.serving)
        self.probed = None

    def _attend(self, q, k, v, mask, **options):
        raise Unsupported("a merge kernel is checked by the merge properties (attn-spec list)", total=True)

    def lacks_option(self, key):
        return "a merge kernel is checked by the merge properties"

    def merge(self, v_a, s_a, v_b, s_b):
        """One call: (v [T, H, D], s [T, H])."""
        call = f"{self.name}(v_a, s_a, v_b, s_b)"
        before = [t.clone() for t in (v_a, s_a, v_b, s_b)] if self.log is not None else None
        self.calls += 1
        with torch.no_grad():
            result = _call(self.obj, (v_a, s_a, v_b, s_b), call, self.state)
        if not (isinstance(result, (tuple, list)) and len(result) == 2
                and all(isinstance(t, torch.Tensor) for t in result)
                and tuple(result[0].shape) == tuple(v_a.shape) and tuple(result[1].shape) == tuple(s_a.shape)):
            fail(f"{type(result).__name__}", what="the merge's result", call=call,
                 expected=f"(v {list(v_a.shape)}, s {list(s_a.shape)})",
                 cause="a merge returns the merged partial attention and its LSE, shaped like its inputs")
        v, s = result
        if self.log is not None:
            self.log.append({"inputs": before, "base": self.base, "v": v.detach().clone(), "s": s.detach().clone()})
        return v, s

    @property
    def base(self) -> float:
        return 2.0 if self.behaviour()["lse-base"] == "2" else math.e

    def behaviour(self) -> dict:
        """Probed once on tiny float64 states: the LSE's base and what two empty states merge to."""
        if self.probed is None:
            self.probed = {"lse-base": _probe(lse_base, self), "empty-merge": _probe(empty_merge, self)}
        return self.probed

    def notes(self):
        found = self.behaviour()
        return [f"merge: LSE base {found['lse-base']}, two empty states (0, -inf) merge to {found['empty-merge']}",
                "calls: v [T, H, D], s [T, H] (s strided where the property says so)"]


def _probe(probe, target) -> str:
    try:
        return probe(target)
    except Exception as exc:  # noqa: BLE001 - the target's exception, reported in the header
        return f"raises ({type(exc).__name__})"


def lse_base(target) -> str:
    """(1, 0) merged with (0, 1): the first weight is 1 / (1 + e) in base e, 1 / 3 in base 2 (within float32's
    rounding: a kernel may merge in float32 whatever it is given)."""
    one = torch.ones(1, 1, 1, dtype=F64)
    v, _ = target.merge(one, torch.zeros(1, 1, dtype=F64), 0 * one, torch.ones(1, 1, dtype=F64))
    weight = v.to(F64).item()
    for base, exact in (("e", 1 / (1 + math.e)), ("2", 1 / 3)):
        if abs(weight - exact) <= 1e-5:
            return base
    return f"other (weight {weight:.4g})"


def empty_merge(target) -> str:
    """(0, -inf) merged with (0, -inf): the empty state again, or NaN."""
    zero, empty = torch.zeros(1, 1, 1, dtype=F64), torch.full((1, 1), -math.inf, dtype=F64)
    v, s = target.merge(zero, empty, zero.clone(), empty.clone())
    return f"({v.item():g}, {s.item():g})"
