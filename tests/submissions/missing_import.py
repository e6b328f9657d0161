"""Imports a module that is not installed where it is graded."""
import torch
import flash_attn_unavailable_module  # noqa: F401


def attention(Q, K, V, mask=None):
    return torch.softmax(Q @ K.transpose(-2, -1), dim=-1) @ V
