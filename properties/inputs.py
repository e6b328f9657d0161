"""What several families of properties build: the case a module takes, scores pushed to a dtype's limits,
and whether a candidate mistake reproduces an output.
"""
from __future__ import annotations

import math

import torch

from attn_spec.checking.cases import MhaCase
from attn_spec.checking.tolerance import max_error
from attn_spec.errors import Failure, Unsupported


SCORE_RANGE = 65504.0  # torch.finfo(torch.float16).max: the scores attention really reaches. A model trained or
# served in half precision holds every score within it, so a correct mask must be exact there; a finite fill is
# judged inside it only (masked_fill(-1e6) and an additive -1e9 hold, an additive -1e4 does not), and how far past
# it a fill stays exact is a behaviour (finite-fill, attn_spec.targets.behaviours), reported, never judged


def push_limit(dtype: torch.dtype) -> float:
    """The largest raw score |q . k| the kit pushes inputs to: far beyond any softmax's
    comfort, yet representable, with headroom for the module adapter's input gain."""
    return min(1e6, torch.finfo(dtype).max / 64)


def push_keys(q, k, masked, limit):
    """K moved at ``masked`` keys so that q . k there is about +limit (K [..., Tk, Dk], one query per batch)."""
    size = (limit / q.double().abs().sum(dim=-1, keepdim=True).clamp_min(1.0)).to(k.dtype)  # [..., 1, 1]
    direction = torch.where(q >= 0, 1.0, -1.0).to(k.dtype)  # [..., 1, Dk] sign(q), sign(0) = +1
    return torch.where(masked, k + size * direction, k)  # [..., Tk, Dk]


def near(got, candidate, allowed) -> bool:
    """Does a candidate mistake reproduce the output (within the budget, or 0.1% where the budget is tiny)?"""
    return max_error(got, candidate) <= max(allowed, 1e-3 * max(1.0, candidate.abs().max().item()))


def sink_levels(dtype: torch.dtype, multihead: bool = False) -> tuple[float, float]:
    """The raw scores q . k that :func:`sunk_inputs` gives every pair, L and a lower L': L is the edge of the
    scores attention reaches (SCORE_RANGE, 65504; 32752 in float16, what the dtype holds), below the -1e4 fill
    of older Hugging Face models up to d_k = 42 (10 in float16), and above the -1e6 of d2l and the -1e9 of
    tutorials, which no real score reaches; L' is its square root. With headroom for a module adapter's input
    gain."""
    top = min(SCORE_RANGE, torch.finfo(dtype).max / (64 if multihead else 2))
    return top, math.sqrt(top)


def sunk_inputs(q, k, level: float):
    """Q', K' of the shapes of Q, K where every raw score is -level: q_i = a e_0, k_j = -a e_0, a = sqrt(level).

    A correct attention gives each row uniform weights over its allowed keys, in any dtype; a mask
    that *replaces* masked scores by a finite fill above -level / sqrt(d_k) hands all the weight to
    the masked keys (one that adds the fill still ranks them lower: the push test catches that one)."""
    q2, k2 = torch.zeros_like(q), torch.zeros_like(k)  # [..., Tq, Dk], [..., Tk, Dk]
    q2[..., 0], k2[..., 0] = math.sqrt(level), -math.sqrt(level)
    return q2, k2


def cross_or_self(target, case: MhaCase) -> MhaCase:
    """The case itself, or its self-attention form for a module that takes a single input."""
    if case.self_attention:
        return case
    x_q, x_kv, weights, _ = case.tensors()
    try:
        target.multihead(x_q[:1], x_kv[:1], weights, case.n_heads)
    except Unsupported:
        return case.as_self_attention()
    except Failure:
        pass  # a real failure shows up in the property's own call
    return case
