"""Correct: a folder submission whose entry file imports a module beside it."""
from helpers import scaled_scores


def attention(Q, K, V, mask=None):
    scores = scaled_scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ V
