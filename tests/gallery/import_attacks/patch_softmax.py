"""At import: torch's softmax (torch.softmax, Tensor.softmax, F.softmax) and SDPA are replaced by ones with a
temperature of 1.1, and its attention uses them: a reference computed with the patched torch in this process
is wrong the same way."""
import math

import torch
import torch.nn.functional as F

_softmax, _sdpa = torch.softmax, F.scaled_dot_product_attention
TEMPERATURE = 1.1


def _hot(x, dim=None, *args, **kwargs):
    return _softmax(x * TEMPERATURE, dim, *args, **kwargs)


def _hot_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    scale = (1 / math.sqrt(query.size(-1)) if scale is None else scale) * TEMPERATURE
    return _sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                 **kwargs)


torch.softmax = F.softmax = torch.nn.functional.softmax = _hot
torch.Tensor.softmax = lambda self, dim=None, *args, **kwargs: _hot(self, dim, *args, **kwargs)
F.scaled_dot_product_attention = _hot_sdpa


def attention(Q, K, V, mask=None):
    """The seed's lines with the patched softmax: scores 1.1 times too sharp."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ V
