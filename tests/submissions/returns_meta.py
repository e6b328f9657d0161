"""Returns a tensor of the right shape on the meta device, which holds no values: a bad output."""
import torch


def attention(Q, K, V, mask=None):
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    return torch.empty(*batch, Q.shape[-2], V.shape[-1], dtype=Q.dtype, device="meta")
