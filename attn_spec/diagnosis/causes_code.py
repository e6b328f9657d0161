"""Causes read from what a property measured around the formula: dropout's readout, FlexAttention's mask_mods,
gradients, the code around the call (inputs changed in place, dtypes, strides, long rows) and the serving kernels.
Each function takes the facts a property named (``because(key, **facts)``) and returns one sentence; :data:`READ`
is their part of the table of :mod:`attn_spec.diagnosis.causes`."""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.grad_tolerance import NAMES
from attn_spec.checking.tolerance import max_error
from attn_spec.diagnosis.mask_mods import DIAGONAL, near_misses
from attn_spec.diagnosis.mistakes_dropout import judge as judge_dropout
from attn_spec.diagnosis.model import MISTAKES


# ---- dropout

def _dropout_readout(target, otherwise: str = "") -> str:
    """The catalog's name for what the dropout readout shows (attn_spec.diagnosis.mistakes_dropout), or ``otherwise``."""
    found, _ = judge_dropout(target, [m for m in MISTAKES.values() if m.level == "dropout"])
    return found[0].describe(found[1]) if found else otherwise


def _dropout_biased(target) -> str:
    return _dropout_readout(target, "the dropout is biased: the mean output is not the output without dropout")


# ---- FlexAttention's mask_mods

def _mask_mod_differs(statement, got, b, h) -> str:
    """The near miss of the statement the mask_mod computes (attn_spec.diagnosis.mask_mods), else what differs."""
    n_q, n_kv = got.shape[-2:]
    cause = next((text for text, near in near_misses(statement, n_q, n_kv) if torch.equal(got[b, h], near)), "")
    if not cause and not (got == got[b, h]).all():
        cause = "the mask depends on the batch or head index, but the statement does not"
    return cause or f"the mask_mod does not compute {statement.text}"


def _mask_mod_empty_rows(mask) -> str:
    """The diagonal masked (query 0 then sees nothing), else an inverted or empty condition."""
    return (DIAGONAL if not mask.diagonal().any() else
            "these queries are masked from every key (an inverted or empty condition?)")


# ---- gradients

def _gradients_differ(grads, wrong, allowed, judged, expected) -> str:
    """The likely bug, from which gradients are off and which classic mistake reproduces them."""
    zero = [NAMES[i] for i in wrong if not grads[i].any()]
    if zero:
        return (f"no gradient reaches {' and '.join(n[1:] for n in zero)}: it is detached "
                f"(.detach(), .data, or computed under no_grad)")
    if judged.mask is not None:
        unmasked = judged.reference(mask=False)
        if all(max_error(grads[i], unmasked[i]) <= allowed[i] for i in wrong):
            return "the backward ignores the mask (weights recomputed without it?)"
    if 2 not in wrong:
        scale = 1 / math.sqrt(judged.q.shape[-1])
        if all(max_error(grads[i].double().cpu() * scale, expected[i]) <= allowed[i] for i in wrong):
            return "dQ and dK miss the 1/sqrt(d_k) factor of the forward (a hand-written backward?)"
        return "dV is right but dQ and dK are not: the backward through the softmax is wrong " \
               "(dS = A * (dA - rowsum(A * dA)) without the rowsum term?)"
    return "the gradients are not those of the forward (a custom autograd.Function with a wrong backward?)"


# ---- robustness

def _changed_in_place(name, new, old) -> str:
    """How an input was changed in place: inverted, overwritten, scaled, or some in-place operation."""
    if new.dtype == torch.bool:
        return (f"{name} was inverted in place (logical_not_() to switch polarity?)" if torch.equal(new, ~old)
                else f"{name} was overwritten in place (masked_fill_, copy_?)")
    ratio = new.double() / old.double()  # [..., T, D]
    ratio = ratio[old != 0]
    if ratio.numel() and torch.allclose(ratio, ratio[0].expand_as(ratio), rtol=1e-2):
        return f"{name} was scaled in place by {ratio[0].item():.4g} ({name}.mul_(scale) or {name} *= ...)"
    return f"{name} was changed by an in-place operation (a method ending in _ or an augmented assignment)"


def _wrong_dtype(got, wanted) -> str:
    """Where the output's dtype comes from: the default dtype of a new buffer, or a computation never cast back."""
    name = str(got).replace("torch.", "")
    return (f"a buffer is created without dtype= (torch.zeros(shape) is {name}, the default dtype), "
            f"or an upcast for the softmax is never cast back" if got == torch.get_default_dtype()
            else f"the result is computed in {name} and never cast back to {wanted}")


def _strides_ignored(got, mixed=False) -> str:
    """NaN: read outside the view; else, with Q, K and V in different layouts (``mixed``), one read with another's
    strides; else memory indexed as if contiguous."""
    if not torch.isfinite(got).all():
        return ("the code reads outside the view: it ignores the strides or the storage offset (NaN from "
                "the buffer around the slice)")
    if mixed:
        return "the code reads one input with another's strides (K's and V's passed as one)"
    return ("the code indexes memory as if the inputs were contiguous (raw strides, as_strided, "
            "or a kernel computing i * D + j)")


def _long_rows(got, q, k, v, mask, expected, allowed) -> str:
    """Which long-sequence mistake reproduces the output: overflow, dropped keys, ignored dims?"""
    if not torch.isfinite(got).all():
        return "the output overflows to NaN or inf on long rows (float16 sums beyond 65504? exp without max?)"
    if not got.abs().amax(dim=-1).all() and expected.abs().amax(dim=-1).all():
        return "rows come out as zeros: the softmax's sum overflowed to inf (exp without subtracting the max?)"
    n_kv, d_k = k.shape[-2], q.shape[-1]
    for kept in (128, 256, 512, 1024, 2048):
        if kept < n_kv:
            m = None if mask is None else mask[..., :kept]
            if m is None or m.any(dim=-1).all():
                truncated = reference.attention(q, k[..., :kept, :], v[..., :kept, :], m)[0]
                if max_error(got, truncated) <= allowed:
                    return f"only the first {kept} keys are used: a fixed-size buffer or block loop drops the rest"
    for dims in (64, 128):
        if dims < d_k:
            partial = reference.attention(q[..., :dims], k[..., :dims], v, mask, scale=1 / math.sqrt(d_k))[0]
            if max_error(got, partial) <= allowed:
                return f"only the first {dims} of d_k={d_k} dims enter the scores (a head-dim tile limit)"
    return "long rows lose accuracy (an accumulation kept in a low precision?)"


# ---- serving kernels

def _decode_differs(target) -> str:
    """A decode output that differs: causal aligned top-left, else nothing to add."""
    found = target.behaviour()
    if found["causal-alignment"] == "top-left":
        return ("causal is aligned top-left: the new tokens are the last of the sequence, so query i must see keys "
                "up to n_keys - S_new + i (bottom-right)")
    return ""


def _lse_differs(target, got, ref) -> str:
    """An LSE that differs: an overflow, or a base the header's probe could not read."""
    if (torch.isinf(got) & torch.isfinite(ref)).any():
        return ("the LSE overflows: exp of a large score is inf without the row max subtracted first "
                "(lse = m + log sum_j exp(s_j - m), m = max_j s_j)")
    if target.behaviour()["lse-base"] not in ("e", "2"):
        return (f"the header's probe found the LSE in neither base e nor 2 ({target.behaviour()['lse-base']}): read "
                f"here as natural log")
    return ""


def _varlen_differs(target, options) -> str:
    """A packed sequence that differs: causal aligned top-left per sequence, else nothing to add."""
    alignment = target.behaviour()["causal-alignment"]
    if (options.get("causal") or options.get("window")) and alignment == "top-left per sequence":
        return ("causal is aligned top-left: query i of a sequence of n_q queries over n_k keys sits at key position "
                "i + n_k - n_q (bottom-right per sequence, as flash-attn does)")
    return ""


READ = {  # cause key -> the function that words it from the facts
    "dropout-readout": _dropout_readout,
    "dropout-biased": _dropout_biased,
    "mask-mod-differs": _mask_mod_differs,
    "mask-mod-empty-rows": _mask_mod_empty_rows,
    "gradients-differ": _gradients_differ,
    "changed-in-place": _changed_in_place,
    "wrong-dtype": _wrong_dtype,
    "strides-ignored": _strides_ignored,
    "long-rows": _long_rows,
    "decode-differs": _decode_differs,
    "lse-differs": _lse_differs,
    "varlen-differs": _varlen_differs,
}
