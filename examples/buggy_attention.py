"""A classic mistake, for trying the kit: the scores are divided by d_k instead of sqrt(d_k)."""
import torch


def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / Q.size(-1)  # bug: should be / sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
