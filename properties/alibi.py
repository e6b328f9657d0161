"""ALiBi (``alibi_slopes``, flash-attn's argument): a linear position bias per head, read out and then applied.

A target that takes no ``alibi_slopes`` argument skips the property with that reason. The readout (q = 0, V = I:
the output row is softmax(bias), :func:`read`) is this module's; the diagnosis (attn_spec.diagnosis.mistakes_alibi)
recognises the mistakes in it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_spec import reference
from attn_spec.reference import key_offset
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget
from attn_spec.errors import Unsupported
from attn_spec.failures import because

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


@prop("alibi-slopes", family="alibi",
      statement="with alibi_slopes s, head h's scores gain -s_h |i + n_kv - n_q - j| before the softmax (or the "
                "signed -s_h (i + n_kv - n_q - j), reported)",
      cases={"masks": ("none",)}, after=("matches-reference",),
      examples=[Case(batch=(2,), n_q=3, n_kv=5, d_k=4, d_v=2, dtype="float32", seed=1)],
      at_scale="a bias per position pair does not depend on the length: checked at the drawn sizes",
      lesson=Lesson(unicode="attn(Q, K, V, alibi = s) = softmax(Q Kᵀ / √d_k − s_h |i + n_kv − n_q − j|) V",
                    latex=r"\mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}} - s_h\,|i + n_{kv} - n_q - j|\right)V",
                    check="Reads the bias out with q = 0 and V = I (the output is softmax(bias)), 4 heads, 5 queries "
                          "over 7 keys, then checks the case's own Q, K, V with slopes per head against the float64 "
                          "reference with that bias.",
                    example="alibi"))
def alibi_slopes(target, case):
    """attn(Q, K, V, alibi_slopes=s)_h = softmax(Q_h K_h^T / sqrt(d_k) + B_h) V_h, B_h[i, j] = -s_h |i + n_kv - n_q - j|.

    The distance is measured from the query's position in the key sequence (bottom-right, as flash-attn's causal
    mask), so the newest query is nearest the newest key; a signed form -s_h (i + n_kv - n_q - j) agrees with it
    under a causal mask and is reported, not failed. Why: ALiBi models (BLOOM, MPT, Baichuan) have no other
    position signal; a wrong bias still trains and generates, only worse. Catches: the slopes ignored, the bias
    sign flipped (ALiBi's classic bug), the slopes given to the wrong heads, the distance aligned top-left.
    """
    why = target.lacks_option("alibi")
    if why:
        raise Unsupported(why, total=True)
    reading = read(target, case.torch_dtype, case.device)
    found = form(reading)
    if found is None:
        want = bias(reading.slopes, N_Q, N_KV)[0, -1]
        fail(f"{[round(x, 3) for x in reading.measured[0, -1].tolist()]}",
             what=f"head 0's bias over the {N_KV} keys, read out for the last of {N_Q} queries (q = 0, V = I), "
                  "relative to its largest", expected=f"{[round(x, 3) for x in (want - want.max()).tolist()]}",
             call=f"{target.name}(q=0, k, V=I, alibi_slopes={[round(s, 4) for s in reading.slopes]})",
             got=reading.measured[0], expected_tensor=(bias(reading.slopes, N_Q, N_KV)[0] -
                                                        bias(reading.slopes, N_Q, N_KV)[0].max(-1, keepdim=True).values),
             labels=("the measured bias of head 0 (log weights minus each row's max)",
                     "-slope * |i + n_kv - n_q - j|, minus each row's max"),
             summary=f"the readout: q = 0 [1, 4, {N_Q}, 4], V = I [1, 4, {N_KV}, {N_KV}], {case.dtype}")
    q, k, v, _ = case.tensors()
    while q.dim() < 4:  # heads on dim -3: one slope per head
        q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    given = torch.tensor(slopes(q.shape[-3]), dtype=torch.float32, device=q.device)  # float32, as flash-attn takes
    exact = tuple(given.tolist())  # the float32 values the target got: the reference uses exactly those
    got = target.attend(q, k, v, None, alibi=given)
    added = bias(exact, case.n_q, case.n_kv, found)  # [H, Tq, Tk] float64, as an additive mask
    expected, _ = reference.attention(q, k, v, added)
    assert_close(got, expected, budget=budget(q, k, v, added.to(q.device, q.dtype), expected),
                 what=f"the output with alibi_slopes {[round(s, 3) for s in exact]} against the float64 reference "
                      f"with the {found} bias", call="attention(Q, K, V, alibi_slopes=s)",
                 cause=because("alibi-not-in-scores"))
