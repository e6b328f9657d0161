"""Correct: einsum attention and a multi-head module in the seed's form."""
import math

import torch
from torch import nn


def attention(Q, K, V, mask=None):
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("...qk,...kd->...qd", scores.softmax(dim=-1), V)


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.W_Q = nn.Linear(d_model, d_model, bias=False)
        self.W_K = nn.Linear(d_model, d_model, bias=False)
        self.W_V = nn.Linear(d_model, d_model, bias=False)
        self.W_O = nn.Linear(d_model, d_model, bias=False)

    def split(self, x):  # [T, D] -> [H, T, Dh]
        return x.view(x.shape[0], self.n_heads, self.d_head).transpose(0, 1)

    def forward(self, x_q, x_kv, mask=None):
        heads = attention(self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv)), mask)
        return self.W_O(heads.transpose(0, 1).reshape(x_q.shape[0], -1))
