"""Trivial "attentions": outputs that ignore some or all of their inputs.

Each would satisfy most metamorphic relations trivially (zeros permute like attention, ignore
masked keys, are deterministic). None may pass any property, and each must fail at one clear root,
every other property failing as vacuous, explained by it (``tests/test_gallery.py``). The
diagnosis has mistake models for zeros, V and the mean of V; Q, a constant and random numbers have
none (yet), so their root names no model.
"""
import torch

from gallery import trivial


def _out(Q, V):
    return torch.broadcast_shapes(Q.shape[:-2], V.shape[:-2]) + (Q.shape[-2], V.shape[-1])  # [..., Tq, Dv]


@trivial(bug="returns zeros", mistake="returns-zeros")
def returns_zeros(Q, K, V, mask=None):
    return torch.zeros(_out(Q, V), dtype=Q.dtype, device=Q.device)


@trivial(bug="returns a constant")
def returns_constant(Q, K, V, mask=None):
    return torch.ones(_out(Q, V), dtype=Q.dtype, device=Q.device)


@trivial(bug="returns V unchanged (no attention over the keys)", mistake="returns-values")
def returns_values(Q, K, V, mask=None):
    return V.expand(_out(Q, V)[:-2] + V.shape[-2:])


@trivial(bug="returns Q unchanged")
def returns_queries(Q, K, V, mask=None):
    return Q.expand(_out(Q, V)[:-2] + Q.shape[-2:])


@trivial(bug="returns the mean of V over the keys (uniform weights: Q, K and the mask ignored)",
         mistake="uniform-weights")
def returns_mean_of_values(Q, K, V, mask=None):
    return V.mean(dim=-2, keepdim=True).expand(_out(Q, V))


@trivial(bug="returns random numbers")
def returns_random(Q, K, V, mask=None):
    return torch.randn(_out(Q, V), dtype=Q.dtype, device=Q.device)
