"""Causes read from the numbers a property measured: the scale law, a factor on every weight, the
weight masked keys share. Each returns a plain sentence (never "undefined" or "no standard form")."""
from __future__ import annotations

import math

import torch


def scale_law(found: dict[int, float]) -> tuple[float, float] | None:
    """(c, p) with scale = c * d_k^p, from the scale recovered at two key widths; None if unreadable."""
    (d1, s1), (d2, s2) = sorted(found.items())[:2]
    if not all(math.isfinite(s) and s > 0 for s in (s1, s2)) or d1 == d2:
        return None
    p = math.log(s1 / s2) / math.log(d1 / d2)
    return s1 / d1**p, p


def _close(x: float, y: float, tol: float = 1e-3) -> bool:
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def name_scale(found: dict[int, float], n_heads: int = 1) -> str:
    """What the recovered scales say, e.g. '1/d_k', '1/(2 d_k)', '1/sqrt(d_model)', '1.11/sqrt(d_k)'."""
    values = list(found.values())
    if any(not math.isfinite(s) for s in values):
        return ("unreadable: the probe's weight on the larger key was 0 or 1 (a saturated or inverted softmax, "
                "or weights that are not a softmax of the scores)")
    if any(s <= 0 for s in values):
        return "negative: the larger score gets the smaller weight (the scores are negated, or not a softmax over keys)"
    law = scale_law(found) if len(found) > 1 else None
    if law is None:
        (d, s), = found.items()
        return f"{s:.4g} at d_k={d}"
    c, p = law
    named = [(1.0, -0.5, "1/sqrt(d_k)"), (1.0, -1.0, "1/d_k"), (0.5, -1.0, "1/(2 d_k)"), (1.0, 0.0, "1 (no scaling)"),
             (1.0, 0.5, "sqrt(d_k) (multiplied instead of divided)"), (1.0, -1.5, "1/d_k^1.5 (scaled twice)")]
    if n_heads > 1:
        named.append((1 / math.sqrt(n_heads), -0.5, f"1/sqrt(d_model) = 1/sqrt({n_heads} d_k): the whole width, not one head's"))
    for cc, pp, label in named:
        if _close(c, cc) and _close(p, pp, 2e-3):
            return label
    if _close(p, 0.0, 2e-3):
        width = 1 / c**2
        if _close(width, round(width), 1e-3) and round(width) > 1:
            return f"1/sqrt({round(width)}) at every width: a hard-coded d_k of {round(width)}"
        return f"{c:.4g} at every width: a constant, not computed from d_k"
    if _close(p, -0.5, 2e-3):
        return f"{c:.4g}/sqrt(d_k): an extra factor {c:.4g} (a temperature of {1 / c:.4g} left in?)"
    return f"{c:.4g} · d_k^{p:.3g}"


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
