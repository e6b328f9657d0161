"""Correct: computes in float64 with torch.where and casts back."""
import torch


def attention(Q, K, V, mask=None):
    q, k, v = Q.double(), K.double(), V.double()
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = torch.where(mask, scores, torch.tensor(float("-inf"), dtype=torch.float64))
    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights @ v).to(Q.dtype)
