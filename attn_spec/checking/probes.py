"""Black-box probes: recover what a property needs from a target's outputs alone.

Most targets return only ``softmax(scale * Q K^T) V``. Choosing V cleverly reads the inside:

- V = I (one-hot values, Dv = Tk): the output row i *is* weight row i;
- V = ones [Tk, 1]: the output is each row's total weight;
- two keys whose dot products with the query differ by a known gap g: the weight on the
  larger one is sigmoid(s * g), so s = logit(w) / g is the scale actually applied; read at two key widths, the
  scale's law c * d_k^p is named (:func:`name_scale`).

The scale probes read the *last* of two queries over two keys: under a causal mask it sees both
keys, so they work on causal-only modules too (given the causal mask) and on self-attention ones.
"""
from __future__ import annotations

import math

import torch

from attn_spec.reference import causal_mask
from attn_spec.targets.capabilities import supports


def plain_mask(target, n: int, device="cpu"):
    """No mask, or the causal [n, n] mask for a target that declines calls without one (a causal-only module)."""
    return None if "none" in supports(target, device=device).masks else causal_mask(n, n, device=device)


WEIGHTS_LIMIT = 2**20  # entries of one [Tq, Tk] weight matrix read with V = identity (1024 x 1024)


def weights_fit(n_q: int, n_kv: int) -> bool:
    """Whether reading the weights with V = identity is affordable: beyond, the probe's output
    [..., Tq, Tk] and the target's work on a Tk-wide V grow as n^2 and n^3."""
    return n_q * n_kv <= WEIGHTS_LIMIT


def sample_rows(n_q: int, count: int = 16) -> torch.Tensor:
    """[R] evenly spaced query rows, the first and the last among them: where a diagnosis looks at
    long lengths, so that each candidate mistake costs [R, Tk] scores instead of [Tq, Tk]."""
    return torch.linspace(0, n_q - 1, min(n_q, count)).round().long().unique()


# How a failure labels weights it shows (got, expected): the report hatches the masked cells of such matrices.
WEIGHT_LABELS = ("the weights, read with V = identity", "the reference's weights")


def weights(target, q, k, mask=None, **options) -> torch.Tensor:
    """The attention weights [..., Tq, Tk] the target applies, read with V = identity (``options``: attend's,
    such as window or softcap)."""
    n_kv = k.shape[-2]
    eye = torch.eye(n_kv, dtype=q.dtype, device=q.device).expand(*k.shape[:-2], n_kv, n_kv)  # [..., Tk, Tk]
    return target.attend(q, k, eye, mask, **options)  # [..., Tq, Tk]


def row_sums(target, q, k, mask=None) -> torch.Tensor:
    """Each query's total weight [..., Tq], read with V = ones."""
    ones = torch.ones(*k.shape[:-1], 1, dtype=q.dtype, device=q.device)  # [..., Tk, 1]
    return target.attend(q, k, ones, mask)[..., 0]  # [..., Tq]


def scale_function_inputs(d_k: int, dtype=torch.float64, device="cpu"):
    """(q, k, v) of the scale probe at key width d_k: both queries e_0 (the last one is read: under a
    causal mask it sees both keys), K = [0, sqrt(d_k) e_0], V = [[0], [1]]."""
    q = torch.zeros(2, d_k, dtype=dtype, device=device)  # [Tq=2, Dk]
    q[:, 0] = 1
    k = torch.zeros(2, d_k, dtype=dtype, device=device)  # [Tk=2, Dk]
    k[1, 0] = math.sqrt(d_k)
    v = torch.tensor([[0.0], [1.0]], dtype=dtype, device=device)  # [Tk=2, Dv=1]
    return q, k, v


def scale_function(target, d_k: int, dtype=torch.float64, device="cpu") -> float:
    """The scale s in softmax(s * Q K^T) of an attention function, at key width d_k.

    Query 1 is e_0 and the two keys are 0 and g * e_0 with g = sqrt(d_k): raw scores 0 and g, so
    a correct target puts weight sigmoid(1) on key 1. V = [[0], [1]] reads that weight.
    """
    w = target.attend(*scale_function_inputs(d_k, dtype, device), plain_mask(target, 2, device))[1, 0].item()
    return _logit(w) / math.sqrt(d_k)


def scale_module_input(d_head: int, n_heads: int, dtype=torch.float64, device="cpu"):
    """x [2, D] of the module scale probe: tokens (1 - sqrt(d_head)) e_0 and e_0 in each head's first column."""
    first = torch.arange(n_heads) * d_head  # first column of each head
    x = torch.zeros(2, d_head * n_heads, dtype=dtype, device=device)  # [T=2, D]
    x[0, first], x[1, first] = 1.0 - math.sqrt(d_head), 1.0
    return x


def scale_module(target, d_head: int, n_heads: int, dtype=torch.float64, device="cpu") -> list[float]:
    """The scale each head of a multi-head module applies, with identity projections.

    Self-attention over two tokens, a e_0 and b e_0 in every head's first column (a = 1 - g,
    b = 1, g = sqrt(d_head)): token 1's raw scores are ab and b^2, a gap of g, so a correct
    head puts weight w = sigmoid(1) on token 1 itself, and with W_V = W_O = I token 1's output
    in that column is a + w (b - a) = 1 - g + w g. Self-attention form, so one-input modules
    work too; token 1 sees both tokens under a causal mask, so causal-only modules work too.
    """
    d_model, g = d_head * n_heads, math.sqrt(d_head)
    eye = torch.eye(d_model, dtype=dtype, device=device)  # [D, D]
    x = scale_module_input(d_head, n_heads, dtype, device)
    weights = dict.fromkeys(("W_Q", "W_K", "W_V", "W_O"), eye)
    out = target.multihead(x, x, weights, n_heads, plain_mask(target, 2, device))  # [2, D]
    return [_logit((y - 1.0 + g) / g) / g for y in out[1, torch.arange(n_heads) * d_head].tolist()]


def _logit(w: float) -> float:
    if not 0.0 < w < 1.0:
        return math.inf if w >= 1.0 else -math.inf if w <= 0.0 else math.nan
    return math.log(w / (1.0 - w))


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
