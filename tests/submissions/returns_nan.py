"""Returns a tensor of the right shape, full of NaN."""
import math

import torch


def attention(Q, K, V, mask=None):
    out = torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1)), dim=-1) @ V
    return torch.full_like(out, float("nan"))
