"""Targets for tests/test_attacks.py's --isolate tests: one that reports what it sees of a harness, one that
hangs and one that aborts its process above two keys, and a correct one."""
import inspect
import math
import os
import sys

import torch

HARNESS = ("attn_spec", "hypothesis", "pytest", "_pytest")


def correct(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ V


def raises_if_it_sees_a_harness(Q, K, V, mask=None):
    """Correct, unless a harness's frame is on its stack or its package is loaded: then it raises, naming what it saw."""
    frames = [f.filename for f in inspect.stack()[1:] if any(f"/{h}/" in f.filename for h in HARNESS)]
    modules = [m for m in sys.modules if m.split(".")[0] in HARNESS]
    if frames or modules:
        raise RuntimeError(f"it sees a harness: {(frames + modules)[:3]}")
    return correct(Q, K, V, mask)


def hangs_above_two_keys(Q, K, V, mask=None):
    while K.shape[-2] > 2:
        pass
    return correct(Q, K, V, mask)


def aborts_above_two_keys(Q, K, V, mask=None):
    if K.shape[-2] > 2:
        os.abort()
    return correct(Q, K, V, mask)
