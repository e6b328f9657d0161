"""Causes read from the numbers a property measured: a factor on every weight, the weight masked keys share
(the scale law is named beside its probe, attn_spec.checking.probes.name_scale). Each returns a plain sentence
(never "undefined" or "no standard form")."""
from __future__ import annotations

import math

import torch


def weight_factor(w: torch.Tensor, ref: torch.Tensor) -> str:
    """Compare weights [..., Tq, Tk] with the reference's: one factor on every weight, or per row."""
    w, ref = w.detach().to("cpu", torch.float64), ref.detach().to("cpu", torch.float64)
    live = ref > 1e-9
    if not live.any() or not torch.isfinite(w).all() or w.shape != ref.shape:
        return ""
    ratio = torch.where(live, w / torch.where(live, ref, torch.ones_like(ref)), torch.nan)  # [..., Tq, Tk]
    per_row = ratio.nanmean(dim=-1, keepdim=True)  # [..., Tq, 1]
    spread = (ratio - per_row).abs().nan_to_num(0.0).max().item()
    if spread > 1e-6 * max(1.0, per_row.abs().nan_to_num(0.0).max().item()):
        return ""  # not a factor: the weights are shaped differently, not just scaled
    rows = per_row.flatten()
    rows = rows[~rows.isnan()]
    lo, hi = rows.min().item(), rows.max().item()
    if math.isclose(lo, hi, rel_tol=1e-6):
        why = ("an extra term in the softmax's denominator (a padded key with score 0, or a +1?)" if hi < 1
               else "a sum over fewer keys than it weights (normalised before masking?)")
        return f"every weight is ×{hi:.4g} the reference's: {why}"
    return (f"each row's weights are the reference's times a factor of its own (×{lo:.3g} to ×{hi:.3g}): the "
            f"weights are divided by the wrong sum")


def masked_share(w: torch.Tensor, allowed: torch.Tensor) -> str:
    """Masked keys of a row all getting the same weight means a finite fill value, not -inf."""
    w = w.detach().to("cpu", torch.float64)
    allowed = allowed.cpu().expand(w.shape)
    masked = ~allowed
    rows = masked.sum(dim=-1) >= 2  # [..., Tq] rows where an equal share can be seen
    if not rows.any() or not torch.isfinite(w).all():
        return ""
    leak = w.masked_fill(allowed, math.nan)  # [..., Tq, Tk]
    top, bottom = leak.nan_to_num(-math.inf).amax(dim=-1), leak.nan_to_num(math.inf).amin(dim=-1)
    equal = (top - bottom)[rows].abs().max().item() <= 1e-9 * max(1.0, top[rows].abs().max().item())
    if equal and top[rows].min().item() > 0:
        return ("masked keys share one equal weight in each row: they all get the same finite score (masked_fill "
                "with 0 or another number, not -inf)")
    return ""
