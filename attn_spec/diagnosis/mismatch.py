"""Name the likely bug behind one mismatch (a property's own cause, before any replay) by asking the catalog
which classic mistake reproduces the output: each model (attn_spec.diagnosis, ``MISTAKES``) is run on the
mismatched call's inputs (:func:`output`, through :func:`attn_spec.diagnosis.predict.predict`), and the first that
reproduces it names the cause in the model's own words (``Mistake.cause_for``). Properties whose mismatch has its own
candidates (a key shift, a softcap) ask :func:`output` the same way.

A convention's own misreading comes first (a [B, S, H, D] kernel that reads its inputs as [B, H, S, D]); the
report's roots come from the same models replayed on every call of the failure (attn_spec.diagnosis.run).
What no model computes is said from the numbers themselves: NaN, Q returned as it is, a constant."""
from __future__ import annotations

import torch

from attn_spec import reference
from attn_spec.checking import chunked, probes
from attn_spec.checking.tolerance import earned, max_error
from attn_spec.diagnosis import MISTAKES
from attn_spec.diagnosis.mistakes import QUERY_AXIS
from attn_spec.diagnosis.predict import predict
from attn_spec.targets.layouts import Heads
from attn_spec.targets.record import Call

F64 = torch.float64
BLOCKS = (16, 32, 64, 128, 256, 512, 1024)  # the key blocks of a blocked kernel that may drop its partial block


def output(mistake_id: str, q, k, v, mask, params=None, **options):
    """What the catalog's model ``mistake_id`` computes on these inputs (float64, or their own dtype where the
    model is ``exact``), or None where it raises; ``options``: the call's own (``softcap=cap``, ...)."""
    pred = predict(MISTAKES[mistake_id], Call("attend", {"q": q, "k": k, "v": v, "mask": mask, **options}), params)
    return None if pred is None or pred.error is not None else pred.out


def _reproduces(got, candidate, budget: float) -> bool:
    """``candidate`` (broadcast to ``got``'s shape) equals ``got`` within ``budget``."""
    if not isinstance(candidate, torch.Tensor):
        return False
    try:
        candidate = torch.broadcast_to(candidate, got.shape)
    except RuntimeError:
        return False
    return max_error(got, candidate) <= budget


def explain(target, got, q, k, v, mask, allowed) -> str:
    """The cause of ``got`` != the reference: the target convention's own misreadings first, then the
    classic mistakes (:func:`diagnose_mismatch`), or ''."""
    got64 = got.detach().cpu().double()
    if getattr(target, "layout", "bhsd") == "bshd" and _transposed_reading(got64, q, k, v, mask, allowed):
        return MISTAKES["heads-sequence-transposed"].cause_for()
    return diagnose_mismatch(got64, q, k, v, mask, allowed)


def _transposed_reading(got, q, k, v, mask, allowed) -> bool:
    """Does a [B, S, H, D] kernel that attends over the heads (heads-sequence-transposed) give ``got``? Asked only
    where those shapes can occur: no mask, as many keys as queries, no grouped heads."""
    h = Heads(q, k, v, mask)
    if mask is not None or h.q.shape[-2] != h.k.shape[-2] or h.heads != h.kv_heads:
        return False
    out = output("heads-sequence-transposed", h.q, h.k, h.v, None)  # [B, H, S, Dv]
    return out is not None and _reproduces(got, h.restore(out), allowed)


def _mistakes(q, k, v, mask, *, all_rows=True):
    """(mistake id, its parameters, the words' numbers) for each classic mistake a mismatch is compared with.

    ``all_rows=False``: q holds some of the queries only (a long case), so mistakes that mix the queries (a
    softmax over them) cannot be reproduced and are left out."""
    d_k = q.shape[-1]
    yield "scale-missing", {}, {}
    yield "scale-one-over-dk", {}, {}
    yield "scale-multiplied", {}, {}
    yield "scale-temperature", {"temperature": d_k}, {}  # 1/sqrt(d_k), then divided by d_k again
    if v.shape[-1] != d_k:
        yield "scale-d-v", {}, {}
    if q.shape[-2] > 1 and all_rows:
        yield "softmax-over-queries", {"dim": -2, "over": QUERY_AXIS}, {}
    if mask is not None and not bool(mask.all()):
        yield "mask-ignored", {}, {}
        if bool((~mask).any(dim=-1).all()):  # inverting leaves every row some key
            yield "mask-inverted", {}, {}
    n_kv = k.shape[-2]
    for block in BLOCKS:  # keys beyond the last full block ignored: a loop over n_kv // block blocks
        kept = n_kv - n_kv % block
        if 0 < kept < n_kv:
            yield "kv-buffer-truncated", {"slots": kept}, {"dropped": n_kv - kept, "block": block, "n_kv": n_kv}


def _no_attention(got, q, k, v, budget: float) -> str:
    """The cause of an output that is no attention at all (the catalog's zeros, V, uniform weights; Q or a
    constant, which no model computes), or ''."""
    for mistake_id in ("returns-zeros", "returns-values"):
        if _reproduces(got, output(mistake_id, q, k, v, None), budget):
            return MISTAKES[mistake_id].cause_for()
    if q.shape[-1] == v.shape[-1] and _reproduces(got, q, budget):
        return "the output is Q itself: the queries are returned as they are"
    if _reproduces(got, output("uniform-weights", q, k, v, None), budget):  # the mask ignored too
        return MISTAKES["uniform-weights"].cause_for()
    if got.numel() > 1 and bool((got == got.flatten()[0]).all()):
        return f"the output is the constant {got.flatten()[0].item():.4g} everywhere: it ignores its inputs"
    return ""


def diagnose_mismatch(got, q, k, v, mask, budget: float) -> str:
    """One sentence naming the mistake that reproduces ``got``, or '' if none does.

    At long lengths (the scores do not fit in one chunk) the mistakes are reproduced on a few
    query rows only (probes.sample_rows), each at the cost of [rows, n_kv] scores."""
    if not torch.isfinite(got).all():
        return "the output has NaN or inf where the reference is finite"
    trivial = _no_attention(got, q, k, v, budget)
    if trivial:
        return trivial
    all_rows = chunked.fits(q, k, v, mask)
    if not all_rows:
        rows = probes.sample_rows(q.shape[-2])
        q, got = q[..., rows.to(q.device), :], got[..., rows.to(got.device), :]
        if mask is not None and mask.shape[-2] > 1:
            mask = mask[..., rows.to(mask.device), :]
    for mistake_id, params, numbers in _mistakes(q, k, v, mask, all_rows=all_rows):
        out = output(mistake_id, q, k, v, mask, params)
        if out is not None and max_error(got, out) <= max(budget, 1e-3 * max(1.0, out.abs().max().item())):
            return MISTAKES[mistake_id].cause_for(**params, **numbers)
    if q.dtype == F64:  # a float64 target that secretly computes in float32
        ref = reference.attention(q, k, v, mask)[0]
        err = max_error(got, ref)
        err32 = max_error(output("computes-in-float32", q, k, v, mask), ref)
        floor32 = torch.finfo(torch.float32).eps * max(1.0, ref.abs().max().item())
        if err > floor32 / 16 and err <= earned(err32, 4 * floor32):  # float32's own error earns the budget
            return MISTAKES["computes-in-float32"].cause_for(err=err, budget=budget)
    return ""
