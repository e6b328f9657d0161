"""Mistake models of dropout on the attention weights, recognised from a readout (``level="dropout"``).

A dropped call cannot be replayed: its mask is random. It can be read, though: with q = k = 0 every allowed
key of row i has weight 1/n_i, and with V = [I | I] the output row is the dropped weight row, twice
(:func:`read`). Each model is ``fn(reading) -> params or None``: it recognises what the reading looks like
for that wrong kernel; the first that does names the root of the dropout properties' failures. One readout
call (:func:`attn_spec.properties.dropout.dropped`) is the property's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_spec import reference
from attn_spec.diagnosis.model import mistake
from attn_spec.properties.dropout import N, Z, dropped  # the readout, the property's own

F64 = torch.float64


@dataclass
class Reading:
    """The dropped weights of one readout: ``free`` (no mask) and ``causal`` [B, H, N, 2N] in float64, the
    same seeds read again (``again``), another seed (``other``); ``causal`` is None for a kernel that takes
    neither a mask nor is_causal."""

    p: float
    free: torch.Tensor
    again: torch.Tensor
    other: torch.Tensor
    causal: torch.Tensor | None

    def halves(self, which="free"):
        w = getattr(self, which)
        return w[..., :N], w[..., N:]  # [B, H, N, N] each: both read the same weights

    def kept_ratio(self) -> torch.Tensor:
        """Each kept weight times n_i (every row of the unmasked readout has N keys): 1/(1 - p) if right."""
        w = self.halves()[0]
        return (w * N)[w != 0]

    def kept_fraction(self) -> tuple[float, float]:
        """(fraction of the unmasked readout's weights kept, Z standard deviations of a correct kernel's)."""
        w = self.halves()[0]
        return (w != 0).to(F64).mean().item(), Z * math.sqrt(self.p * (1 - self.p) / w.numel())


def read(target, p: float, seed: int, dtype=torch.float32, device="cpu", causal=False) -> Reading:
    """The readout of ``target`` at dropout ``p``, under causality too (``causal``: see :func:`dropped`)."""
    def once(s, causal=False):
        got = dropped(target, p, s, causal=causal, dtype=dtype, device=device)
        return None if got is None else got[0]
    under = once(seed, causal=True) if causal else None
    return Reading(p, once(seed), once(seed), once(seed + 1), under)


def _near(values: torch.Tensor, target: float) -> bool:
    return values.numel() > 0 and torch.allclose(values, torch.full_like(values, target), rtol=1e-2)


@mistake("dropout-unseeded", level="dropout", family="dropout", caught_by=("dropout-mean", "dropout-mask"),
         sentence="the dropout mask is not drawn from torch's seeded generator: the same seed gives different outputs",
         fix="draw the mask with torch's default generator (torch.rand / torch.bernoulli, or the kernel's Philox "
             "state taken from torch.cuda's generator), so torch.manual_seed reproduces a training step")
def dropout_unseeded(r: Reading):
    return {} if not torch.equal(r.free, r.again) else None


@mistake("dropout-same-mask", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="the dropout mask does not change with the seed: every step drops the same weights",
         fix="draw a fresh mask per call from torch's generator (not a generator seeded once with a constant)")
def dropout_same_mask(r: Reading):
    return {} if torch.equal(r.free, r.other) and (r.free == 0).any() else None


@mistake("dropout-on-output", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="dropout is applied to the output (or to V), not to the attention weights",
         fix="drop the weights: out = dropout(softmax(scores), p) @ V, not dropout(softmax(scores) @ V, p)")
def dropout_on_output(r: Reading):
    first, second = r.halves()
    return {} if not torch.equal(first, second) else None


@mistake("dropout-masked-keys", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="masked keys get weight under dropout: the mask is applied as something dropout undoes",
         fix="mask the scores with -inf before the softmax, then drop the weights; never add weight after the mask")
def dropout_masked_keys(r: Reading):
    if r.causal is None:
        return None
    allowed = reference.causal_mask(N, N)  # [N, N]
    return {} if (r.causal[..., :N][..., ~allowed] != 0).any() else None


@mistake("dropout-renormalised", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="the weights are renormalised after dropout: each row sums to 1 over the kept keys, which "
                  "biases the output",
         fix="drop the weights after the softmax and scale the kept ones by 1/(1 - p); do not divide by their sum "
             "or take the softmax over the kept scores")
def dropout_renormalised(r: Reading):
    w = r.halves()[0]
    kept = (w != 0).sum(-1, keepdim=True)  # [B, H, N, 1]
    return {} if (kept < N).any() and _near((w * kept)[w != 0], 1.0) else None


@mistake("dropout-not-rescaled", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="the kept weights are not rescaled by 1/(1 - p): dropout shrinks every activation by (1 - p)",
         fix="scale the kept weights by 1/(1 - p) (inverted dropout), as F.dropout does")
def dropout_not_rescaled(r: Reading):
    return {} if _near(r.kept_ratio(), 1.0) else None


@mistake("dropout-scaled-by-p", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="the kept weights are divided by p instead of (1 - p)",
         fix="scale the kept weights by 1/(1 - p): p is the probability of dropping, 1 - p of keeping")
def dropout_scaled_by_p(r: Reading):
    return {} if abs(r.p - 0.5) > 1e-9 and _near(r.kept_ratio(), 1.0 / r.p) else None


@mistake("dropout-keep-inverted", level="dropout", family="dropout", caught_by=("dropout-mask",),
         sentence="the keep test is inverted: a weight is kept with probability p, not 1 - p",
         fix="keep where rand >= p (or bernoulli(1 - p)), not where rand < p")
def dropout_keep_inverted(r: Reading):
    fraction, spread = r.kept_fraction()
    return {} if abs(r.p - 0.5) > 4 * spread and abs(fraction - r.p) <= spread else None


@mistake("dropout-keep-fraction", level="dropout", family="dropout", caught_by=("dropout-mask",),
         params=({"kept": 0.977},),
         sentence="the kernel keeps a fraction {kept:.3f} of the weights, not 1 - p (the keep threshold is computed "
                  "or compared wrongly)",
         fix="compare a uniform draw in [0, 1) with p in the same units (a Philox integer against p * 2^32, "
             "not p * 2^8)")
def dropout_keep_fraction(r: Reading):
    fraction, spread = r.kept_fraction()
    return {"kept": fraction} if abs(fraction - (1 - r.p)) > spread else None


def judge(target, mistakes) -> tuple[tuple | None, str]:
    """((mistake, params) of the first model that recognises ``target``'s readout, or None; the numbers read)."""
    from attn_spec.errors import Failure, TargetRaised, Unsupported

    try:
        try:
            reading = read(target, 0.1, seed=0, causal=True)
        except Unsupported:
            reading = read(target, 0.1, seed=0)
    except (Failure, TargetRaised, Unsupported) as exc:
        return None, f"the readout could not be taken ({exc})"
    fraction, spread = reading.kept_fraction()
    ratio = reading.kept_ratio()
    numbers = (f"kept {fraction:.4f} of {reading.halves()[0].numel()} weights (1 - p = 0.9 +- {spread:.4f}), kept "
               f"weights x n_keys {ratio.min():.4g} to {ratio.max():.4g} (1/(1 - p) = 1.111)" if ratio.numel() else
               f"kept {fraction:.4f} of the weights")
    for m in mistakes:
        params = m.fn(reading)
        if params is not None:
            return (m, params), numbers
    return None, numbers
