"""The mask applied after the softmax, by multiplying: masked weights are zeroed but rows no longer sum to one."""
import math

import torch


def attention(Q, K, V, mask=None):
    weights = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1)), dim=-1)
    if mask is not None:
        weights = weights * mask
    return weights @ V
