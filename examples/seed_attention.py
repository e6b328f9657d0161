"""The seed's attention, as a learner would write it: a function and a multi-head module.

Check both with:  attn-spec check examples/seed_attention.py:attention examples/seed_attention.py:MultiHeadAttention

Written once: examples/tutorial.py imports it, and the kit's tests import or copy this file where they need the
seed (nothing in attn_spec/ does: a wheel has no examples/).
"""
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
        assert d_model % n_heads == 0
        self.h, self.d_k = n_heads, d_model // n_heads
        self.W_Q = torch.nn.Linear(d_model, d_model, bias=False)
        self.W_K = torch.nn.Linear(d_model, d_model, bias=False)
        self.W_V = torch.nn.Linear(d_model, d_model, bias=False)
        self.W_O = torch.nn.Linear(d_model, d_model, bias=False)

    def split(self, t):  # [n, d_model] -> [h, n, d_k]
        return t.view(t.size(0), self.h, self.d_k).transpose(0, 1)

    def forward(self, x_q, x_kv, mask=None):
        Q = self.split(self.W_Q(x_q))  # [h, n_q, d_k]
        K = self.split(self.W_K(x_kv))  # [h, n_kv, d_k]
        V = self.split(self.W_V(x_kv))  # [h, n_kv, d_k]
        heads = attention(Q, K, V, mask)  # [h, n_q, d_k]
        concat = heads.transpose(0, 1).reshape(x_q.size(0), -1)  # [n_q, d_model]
        return self.W_O(concat)  # [n_q, d_model]
