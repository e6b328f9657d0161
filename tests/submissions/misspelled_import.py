"""Imports a submodule of torch that does not exist: a typo for torch.nn.functional."""
import torch
import torch.nn.functinal as F  # noqa: F401


def attention(Q, K, V, mask=None):
    return torch.softmax(Q @ K.transpose(-2, -1), dim=-1) @ V
