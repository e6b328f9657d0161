"""Mistake models of ALiBi (``alibi_slopes``), recognised from a readout of the bias (``level="alibi"``).

With q = 0 every score is 0, so the weights are softmax(bias) and, with V = I, the output row is the weight
row: log w_ij - max_j log w_ij is the bias of row i up to its row constant (:func:`read`). flash-attn's bias
is -slope_h * |i + n_kv - n_q - j| (aligned bottom-right, like its causal mask); under a causal mask a signed
form -slope_h * (i + n_kv - n_q - j) is the same on the allowed keys. Each model is ``fn(reading) -> params
or None`` on the measured bias; the first that recognises it names the root of alibi-slopes' failures. The
readout itself (:func:`attn_spec.properties.alibi.read`) is the property's.
"""
from __future__ import annotations

import torch

from attn_spec.diagnosis.model import mistake
from attn_spec.properties.alibi import N_KV, N_Q, SLOPES, Reading, bias, read  # the readout, the property's own


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
