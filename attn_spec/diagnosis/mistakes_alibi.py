"""Mistake models of ALiBi (``alibi_slopes``), recognised from a readout of the bias (``level="alibi"``).

With q = 0 every score is 0, so the weights are softmax(bias) and, with V = I, the output row is the weight
row: log w_ij - max_j log w_ij is the bias of row i up to its row constant (:func:`read`). flash-attn's bias
is -slope_h * |i + n_kv - n_q - j| (aligned bottom-right, like its causal mask); under a causal mask a signed
form -slope_h * (i + n_kv - n_q - j) is the same on the allowed keys. Each model is ``fn(reading) -> params
or None`` on the measured bias; the first that recognises it names the root of alibi-slopes' failures.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_spec.diagnosis.model import mistake
from attn_spec.reference import key_offset

F64 = torch.float64
H, N_Q, N_KV = 4, 5, 7  # heads, queries and keys of the readout: n_q != n_kv shows the alignment


def slopes(heads: int) -> tuple:
    """The ALiBi paper's geometric slopes 2^(-8 (h + 1) / heads), one per head."""
    return tuple(2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads))


SLOPES = slopes(H)  # the readout's (exact in float32)


def distance(n_q: int, n_kv: int, offset: int | None = None) -> torch.Tensor:
    """i + offset - j [n_q, n_kv], offset = n_kv - n_q (bottom-right) unless given."""
    offset = key_offset(n_q, n_kv, "bottom-right") if offset is None else offset
    return (torch.arange(n_q)[:, None] + offset - torch.arange(n_kv)[None, :]).to(F64)


def bias(slopes, n_q: int, n_kv: int, form: str = "symmetric", offset: int | None = None) -> torch.Tensor:
    """[H, n_q, n_kv]: -slope_h * |d| (symmetric) or -slope_h * d (signed), d = i + offset - j."""
    d = distance(n_q, n_kv, offset)
    d = d.abs() if form == "symmetric" else d
    return -torch.as_tensor(slopes, dtype=F64)[:, None, None] * d  # [H, n_q, n_kv]


def relative(scores: torch.Tensor) -> torch.Tensor:
    """Each row up to its own constant: minus its max (the only part softmax sees)."""
    return scores - scores.max(dim=-1, keepdim=True).values


@dataclass
class Reading:
    """The bias the unmasked readout measured, [H, N_Q, N_KV], each row minus its max; the slopes given."""

    measured: torch.Tensor
    slopes: tuple
    tol: float = 1e-5  # in log-weight units: the readout dtype's rounding

    def matches(self, expected: torch.Tensor) -> bool:
        return bool(torch.allclose(self.measured, relative(expected), atol=self.tol, rtol=0.0))


def readout_inputs(dtype, device):
    """q = 0 [1, H, N_Q, 4], k = 1 [1, H, N_KV, 4], V = I [1, H, N_KV, N_KV], the slopes [H] (float32)."""
    q = torch.zeros(1, H, N_Q, 4, dtype=dtype, device=device)
    k = torch.ones(1, H, N_KV, 4, dtype=dtype, device=device)
    v = torch.eye(N_KV, dtype=dtype, device=device).expand(1, H, N_KV, N_KV)
    return q, k, v, torch.tensor(SLOPES, dtype=torch.float32, device=device)


def read(target, dtype=torch.float32, device="cpu") -> Reading:
    q, k, v, slopes = readout_inputs(dtype, device)
    weights = target.attend(q, k, v, None, alibi=slopes).detach().to("cpu", F64)[0]  # [H, N_Q, N_KV]
    tol = max(1e-5, 16 * torch.finfo(dtype).eps)  # a weight's relative rounding is its log's absolute one
    return Reading(relative(weights.clamp(min=1e-300).log()), SLOPES, tol)


def form(reading: Reading) -> str | None:
    """"symmetric" or "signed" when the readout is one of the correct forms, else None."""
    return next((f for f in ("symmetric", "signed") if reading.matches(bias(reading.slopes, N_Q, N_KV, f))), None)


@mistake("alibi-ignored", level="alibi", family="alibi", caught_by=("alibi-slopes",),
         sentence="alibi_slopes is ignored: no position bias is added to the scores",
         fix="add -slope_h * |i + n_kv - n_q - j| to head h's scores before the softmax")
def alibi_ignored(r: Reading):
    return {} if r.matches(torch.zeros_like(r.measured)) else None


@mistake("alibi-sign-flipped", level="alibi", family="alibi", caught_by=("alibi-slopes",),
         sentence="the ALiBi bias has the wrong sign: distant keys get more weight, not less",
         fix="the bias is -slope * distance: subtract it (scores - slope * |i + n_kv - n_q - j|)")
def alibi_sign_flipped(r: Reading):
    return {} if any(r.matches(-bias(r.slopes, N_Q, N_KV, f)) for f in ("symmetric", "signed")) else None


@mistake("alibi-heads-reversed", level="alibi", family="alibi", caught_by=("alibi-slopes",),
         sentence="head h gets another head's slope (the slopes reversed or indexed from the wrong end)",
         fix="give head h the slope alibi_slopes[h] (the slopes are per query head, in head order)")
def alibi_heads_reversed(r: Reading):
    flipped = tuple(reversed(r.slopes))
    return {} if any(r.matches(bias(flipped, N_Q, N_KV, f)) for f in ("symmetric", "signed")) else None


@mistake("alibi-top-left", level="alibi", family="alibi", caught_by=("alibi-slopes",),
         sentence="the ALiBi distance is i - j (aligned top-left), not i + n_kv - n_q - j: with more keys than "
                  "queries the last query is biased away from the last key",
         fix="measure the distance from the query's position in the key sequence: i + n_kv - n_q - j")
def alibi_top_left(r: Reading):
    return {} if any(r.matches(bias(r.slopes, N_Q, N_KV, f, offset=0)) for f in ("symmetric", "signed")) else None


def judge(target, mistakes) -> tuple[tuple | None, str]:
    """((mistake, params) of the first model that recognises ``target``'s bias readout, or None; the numbers)."""
    from attn_spec.errors import Failure, TargetRaised, Unsupported

    try:
        reading = read(target)
    except (Failure, TargetRaised, Unsupported) as exc:
        return None, f"the readout could not be taken ({exc})"
    row = reading.measured[0, -1]  # head 0's last query: the bias of each key relative to the largest
    numbers = f"head 0, last query: bias {[round(x, 3) for x in row.tolist()]} (slope {SLOPES[0]:.3g})"
    for m in mistakes:
        params = m.fn(reading)
        if params is not None:
            return (m, params), numbers
    return None, numbers
