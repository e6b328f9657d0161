"""Measured fits: what a target does, read from purpose-built calls, for bugs no mistake model catalogues.

Where no model reproduces a failure, the target is probed (as attn_spec.checking.probes does) and three
quantities are measured, each with the numbers it rests on:

- **batch mixing**: the output of batch element 0 with only element 1's inputs changed. Attention computes
  each element on its own, so any change is one element's inputs reaching another's output;
- **the normaliser**: each row's total weight, read with V = ones (1 for every row of a softmax). Totals that
  add up to 1 over a matrix or over the batch are a denominator shared by the rows or the batch elements;
- **the scale**: s in softmax(s Q Kᵀ), read on one query over keys 0, ..., 0, g e_0 (the last key's weight is
  e^(s g) / (n_kv - 1 + e^(s g))), on cases that vary d_k, n_q, n_kv, d_v and the heads, and fitted as
  c * d_k^a * n_q^b * n_kv^c * d_v^d * heads^e. What it depends on is named from the exponents.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attn_spec.errors import Failure, TargetRaised, Unsupported

F64 = torch.float64
BASE = {"d_k": 16, "n_q": 2, "n_kv": 2, "d_v": 2, "heads": 1}
VARIED = {"d_k": (4, 16, 64), "n_q": (2, 3, 5), "n_kv": (2, 3, 5), "d_v": (2, 8), "heads": (1, 2, 4)}
WORDS = {"d_k": "the key width d_k", "n_q": "the number of queries", "n_kv": "the number of keys",
         "d_v": "the value width d_v", "heads": "the number of heads"}


@dataclass
class Fit:
    """One measured quantity: what it is, what it depends on, its formula and the values it was fitted on."""

    quantity: str
    depends_on: list
    formula: str
    values: dict
    sentence: str
    fix: str
    numbers: str  # the measurements the sentence rests on, in words
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"quantity": self.quantity, "depends_on": list(self.depends_on), "formula": self.formula,
                "values": dict(self.values)}


def _call(target, q, k, v):
    try:
        out = target.attend(q, k, v, None)
    except (Failure, Unsupported, TargetRaised, RuntimeError, ValueError, TypeError, IndexError):
        return None
    return out.detach().to("cpu", F64) if isinstance(out, torch.Tensor) and out.shape[:-1] == q.shape[:-1] else None


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def batch_mixing(target) -> Fit | None:
    """One element's output with only the other's Q, K or V changed (both ways): any change is batch mixing."""
    q, k, v = (_randn(2, 3, 4, seed=s) for s in (1, 2, 3))  # [B=2, T=3, D=4]
    base = _call(target, q, k, v)
    if base is None:
        return None
    size = max(1.0, base.abs().max().item())
    for src, dst in ((1, 0), (0, 1)):
        moved = {}
        for name, i in (("Q", 0), ("K", 1), ("V", 2)):
            args = [q, k, v]
            args[i] = args[i].clone()
            args[i][src] = _randn(3, 4, seed=10 + i)  # element src only
            out = _call(target, *args)
            if out is None:
                return None
            moved[name] = (out[dst] - base[dst]).abs().max().item()
        through = [name for name, d in moved.items() if d > 1e-9 * size]
        if through:
            numbers = ", ".join(f"{name}: {d:.3g}" for name, d in moved.items())
            return Fit("cross-batch contribution", ["batch"],
                       f"out[{dst}] depends on {', '.join(f'{x}[{src}]' for x in through)}",
                       {name: round(d, 6) for name, d in moved.items()},
                       f"batch elements mix: element {dst}'s output changes when only element {src}'s "
                       f"{' and '.join(through)} change", "compute each element of the leading dims on its own: no "
                       "sum, mean or max over the batch dim, and no reshape that merges it with another dim",
                       f"element {dst}'s output moved by {numbers} when element {src}'s inputs changed")
    return None


def normaliser(target) -> Fit | None:
    """Each row's total weight (V = ones), unbatched and over a batch of 2: a softmax gives 1 in every row."""
    q, k = _randn(3, 4, seed=4), _randn(4, 4, seed=5)  # [Tq=3, Dk], [Tk=4, Dk]
    sums = _call(target, q, k, torch.ones(4, 1, dtype=F64))
    if sums is None:
        return None
    rows = sums[:, 0]
    if (rows - 1).abs().max().item() <= 1e-6:
        return None
    doubled = _call(target, q, k, torch.full((4, 1), 2.0, dtype=F64))  # weights @ V is linear in V
    if doubled is None or (doubled[:, 0] - 2 * rows).abs().max().item() > 1e-6 * max(1.0, rows.abs().max().item()):
        return None  # the output is not a weighting of V (a term beside it): its row sums say nothing of weights
    total = rows.sum().item()
    listed = ", ".join(f"{x:.3g}" for x in rows.tolist())
    numbers = f"row sums {listed} (total {total:.3g} over n_q = 3 rows; a softmax gives 1 each, total 3)"
    qb, kb = _randn(2, 3, 4, seed=6), _randn(2, 4, 4, seed=7)  # [B=2, ...]
    batched = _call(target, qb, kb, torch.ones(2, 4, 1, dtype=F64))
    if abs(total - 1) <= 1e-6:
        shared, depends = "all the rows of a matrix", ["n_q"]
    elif batched is not None and abs(batched.sum().item() - 1) <= 1e-6:
        shared, depends = "all the rows of every batch element", ["n_q", "batch"]
        numbers += f"; over a batch of 2 the row sums total {batched.sum().item():.3g}"
    elif _shared(q, k, rows) is not None:
        frame, how = _shared(q, k, rows)
        numbers += f"; each row's sum of exp(scores - {frame}) over its row sum is one number, {how}"
        return Fit("row normaliser", ["n_q"], f"one denominator for all the rows of a matrix: {how}",
                   {"rows": [round(x, 6) for x in rows.tolist()], "total": round(total, 6)},
                   f"one denominator is shared by all the rows of a matrix ({how}), so the rows' sums differ and "
                   f"total {total:.3g}", "softmax over the keys only: each row's exp divided by that row's own sum",
                   numbers)
    elif (rows - rows[0]).abs().max().item() <= 1e-6:
        return Fit("row normaliser", [], f"each row sums to {rows[0].item():.4g}", {"rows": [round(x, 6) for x in rows.tolist()]},
                   f"every row of weights sums to {rows[0].item():.4g}, not 1: the weights are scaled by a constant "
                   f"after the softmax", "divide each row's exp by that row's own sum: nothing else", numbers)
    else:
        return Fit("row normaliser", ["row"], "row sums differ from 1", {"rows": [round(x, 6) for x in rows.tolist()]},
                   "the rows of weights do not sum to 1 and do not share one denominator: the normalisation is "
                   "not softmax's", "softmax over the keys, dim=-1: each row's exp divided by that row's sum",
                   numbers)
    return Fit("row normaliser", depends, f"one denominator for {shared}", {"rows": [round(x, 6) for x in rows.tolist()],
                                                                           "total": round(total, 6)},
               f"one denominator is shared by {shared}: the exp is divided by a sum over more than the row's "
               f"keys", "softmax over the keys only: sum(dim=-1, keepdim=True), one denominator per row", numbers)


def _shared(q, k, rows) -> tuple[str, str] | None:
    """(the shift, what the denominator is) when row i's total weight is S_i / D for one D shared by the rows,
    S_i = sum_j exp(s_ij - shift) with the row max or the matrix max as the shift; None otherwise."""
    s = q @ k.T / math.sqrt(q.shape[-1])  # [Tq, Tk] at the right scale
    if rows.min().item() <= 0:
        return None
    for frame, shift in (("the row max", s.amax(-1, keepdim=True)), ("the matrix max", s.max())):
        sums = torch.exp(s - shift).sum(-1)  # [Tq]
        d = sums / rows  # [Tq]: the effective denominator of each row
        if (d / d[0] - 1).abs().max().item() > 1e-6:
            continue
        for words, value in (("the mean of the rows' sums", sums.mean()), ("the sum over every row", sums.sum()),
                             ("the largest row's sum", sums.max())):
            if abs(d[0].item() / value.item() - 1) <= 1e-6:
                return frame, words
        return frame, f"{d[0].item():.4g}"
    return None


def _scale_inputs(d_k, n_q, n_kv, d_v, heads):
    """Q: every query e_0; K: keys 0, ..., 0, sqrt(d_k) e_0; V: column 0 is 1 on the last key (the weight read)."""
    lead = (1, heads) if heads > 1 else ()
    q = torch.zeros(*lead, n_q, d_k, dtype=F64)
    q[..., 0] = 1
    k = torch.zeros(*lead, n_kv, d_k, dtype=F64)
    k[..., -1, 0] = math.sqrt(d_k)
    v = torch.zeros(*lead, n_kv, d_v, dtype=F64)
    v[..., -1, 0] = 1
    return q, k, v


def _scale_at(target, shape) -> float | None:
    out = _call(target, *_scale_inputs(**shape))
    if out is None:
        return None
    w = out[..., 0]
    if (w - w.flatten()[0]).abs().max().item() > 1e-9 or not 0 < w.flatten()[0].item() < 1:
        return None  # rows that differ, or a saturated weight: no one scale to read
    w = w.flatten()[0].item()
    return math.log(w * (shape["n_kv"] - 1) / (1 - w)) / math.sqrt(shape["d_k"])


def scale(target) -> Fit | None:
    """The applied scale on cases varying one shape at a time from BASE, fitted as c * prod(x^e)."""
    at_base = _scale_at(target, BASE)
    if at_base is None or at_base <= 0:
        return None
    exponents, values = {}, {}
    for name, sizes in VARIED.items():
        read = {x: _scale_at(target, {**BASE, name: x}) for x in sizes}
        if any(s is None or s <= 0 for s in read.values()):
            if name == "heads":
                continue  # a target that takes no batch dims: the heads are not varied
            return None
        values[name] = {x: round(s, 6) for x, s in read.items()}
        xs, ys = [math.log(x) for x in read], [math.log(s) for s in read.values()]
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)
        if max(abs(my + slope * (a - mx) - b) for a, b in zip(xs, ys)) > 1e-3:
            return None  # not a power law in this shape
        exponents[name] = round(slope * 4) / 4 if abs(slope * 4 - round(slope * 4)) < 1e-2 else round(slope, 3)
    c = at_base / math.prod(BASE[n] ** e for n, e in exponents.items())
    c = round(c, 3) if abs(c - round(c, 3)) < 1e-3 * max(1.0, abs(c)) else c
    depends = [n for n, e in exponents.items() if e]
    if depends == ["d_k"] and exponents["d_k"] == -0.5 and abs(c - 1) < 1e-3:
        return None  # 1/sqrt(d_k): the scale is right
    formula = _formula(c, {n: exponents[n] for n in depends})
    shown = [n for n in depends if n != "d_k"] or depends or ["d_k"]
    numbers = "; ".join(", ".join(f"{s:.3g} at {n}={x}" for x, s in values[n].items()) for n in shown)
    if depends:
        said = " and ".join(WORDS[n] for n in depends)
        sentence = f"the scale follows {said}: {formula} (expected 1/sqrt(d_k))"
    else:
        sentence = f"the scale is the constant {formula}, whatever the shapes (expected 1/sqrt(d_k))"
    return Fit("scale", depends, formula, {n: {str(x): s for x, s in v.items()} for n, v in values.items()},
               sentence, "scale the scores by 1 / math.sqrt(d_k), d_k = Q.shape[-1]: no other shape",
               f"scale {numbers}", extra={"exponents": exponents, "c": c})


def _formula(c: float, exponents: dict) -> str:
    """``1/sqrt(n_q)``, ``0.5 * d_k^-1``, ``1/(d_k sqrt(n_kv))``: the fitted law in words a reader checks."""
    def term(n, e):
        if abs(e) == 0.5:
            return f"sqrt({n})"
        return n if abs(e) == 1 else f"{n}^{abs(e):g}"
    num = [term(n, e) for n, e in exponents.items() if e > 0]
    den = [term(n, e) for n, e in exponents.items() if e < 0]
    lead = "" if c == 1 else f"{c:.4g}"
    top = " ".join(([lead] if lead else []) + num) or "1"
    if not den:
        return top
    bottom = den[0] if len(den) == 1 else f"({' '.join(den)})"
    return f"{top}/{bottom}"


def measure(target) -> Fit | None:
    """The first measured fit that finds something: batch mixing, then the normaliser, then the scale."""
    from attn_spec.diagnosis.evidence import one_thread

    target.fresh_instances()
    with one_thread():
        for probe in (batch_mixing, normaliser, scale):
            found = probe(target)
            if found is not None:
                return found
    return None
