"""Correct, by calling the forbidden torch.nn.functional.scaled_dot_product_attention."""
import torch.nn.functional as F


def attention(Q, K, V, mask=None):
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
