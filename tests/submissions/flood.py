"""Correct, but prints a flood of output at import and on every call."""
import math

import torch

for i in range(20000):
    print(f"loading line {i} " + "x" * 40)


def attention(Q, K, V, mask=None):
    print("called with", tuple(Q.shape), "#" * 2000)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
