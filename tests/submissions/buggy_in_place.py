"""Buggy: scales Q in place, so the caller's Q changes."""
import math

import torch


def attention(Q, K, V, mask=None):
    Q /= math.sqrt(Q.size(-1))
    scores = Q @ K.transpose(-2, -1)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
