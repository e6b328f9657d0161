"""The project's attention: a function and a multi-head module, both gated in CI."""
import math

import torch


def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., n_q, n_kv]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ V  # [..., n_q, d_v]


class MultiHeadAttention(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x_q, x_kv, mask=None):
        def split(t):  # [n, d_model] -> [h, n, d_k]
            return t.view(t.size(0), self.h, self.d_k).transpose(0, 1)

        heads = attention(split(self.W_Q(x_q)), split(self.W_K(x_kv)), split(self.W_V(x_kv)), mask)  # [h, n_q, d_k]
        return self.W_O(heads.transpose(0, 1).reshape(x_q.size(0), -1))  # [n_q, d_model]
