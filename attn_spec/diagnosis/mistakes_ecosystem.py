"""The catalog of mistakes in the ecosystem's options and layouts: a sliding window off by one, soft-capping
applied after the mask or without its factor, a [B, S, H, D] kernel that reads heads as the sequence, and
grouped K/V heads that are never repeated (an HF function ignoring ``module.num_key_value_groups``).

The window and softcap models take ``window`` and ``softcap`` themselves (``options=True``): the others get
the window folded into their mask and the cap applied by ``scores``, as the correct formula does (so here
``scores`` is not capped: the model caps, or miscaps, itself).
Each function is the wrong code, written plainly (see :mod:`attn_spec.diagnosis.model`).
"""
from __future__ import annotations

import torch

from attn_spec.diagnosis.model import correct, masked, mistake, scale_of, scores, softmax_keys
from attn_spec.reference import fold_causal, softcapped


def _windowed(mask, n_q, n_kv, window):
    """The caller's mask with a causal window of ``window`` keys folded in (top-left, as predict folds it)."""
    return mask if window is None else fold_causal(mask, n_q, n_kv, max(window, 1))


# ---------------------------------------------------------------- sliding window


@mistake("window-off-by-one", family="windows", options=True, caught_by=("sliding-window",),
         params=({"off": 1}, {"off": -1}),
         sentence="the sliding window keeps w{off:+d} keys, not w: off by one at its far end "
                  "(j >= i - w where j > i - w was meant, or the reverse)",
         fix="keep the keys i - w < j <= i: (kv_idx <= q_idx) & (q_idx - kv_idx < w)")
def window_off_by_one(q, k, v, mask, scale, window, softcap, off):
    width = None if window is None else max(window + off, 1)
    return correct(q, k, v, mask, scale, window=width, softcap=softcap)


# ---------------------------------------------------------------- softcap


@mistake("softcap-after-mask", family="softcap", options=True, caught_by=("softcap",),
         sentence="the softcap is applied after the mask: a masked score of -inf (or finfo.min) becomes -cap, "
                  "so masked keys keep a weight of exp(-cap - max)",
         cause="softcap applied after the mask: masked scores become -cap instead of -inf, so masked keys keep weight",
         fix="cap the scores first, then mask: cap * tanh(scores / cap), and only then add the mask")
def softcap_after_mask(q, k, v, mask, scale, window, softcap):
    s = masked(scores(q, k, scale), _windowed(mask, q.shape[-2], k.shape[-2], window))  # [..., Tq, Tk]
    return torch.softmax(softcapped(s, softcap), dim=-1) @ v


@mistake("softcap-without-factor", family="softcap", options=True, caught_by=("softcap",),
         sentence="the softcap lacks its factor: tanh(scores / cap), every score squeezed into (-1, 1)",
         cause="tanh without the cap factor: tanh(s / cap) squashes every score into (-1, 1); multiply by cap",
         fix="cap * tanh(scores / cap)")
def softcap_without_factor(q, k, v, mask, scale, window, softcap):
    s = scores(q, k, scale)
    if softcap is not None:
        s = torch.tanh(s / softcap)
    return softmax_keys(masked(s, _windowed(mask, q.shape[-2], k.shape[-2], window))) @ v


# ---------------------------------------------------------------- layouts and grouped heads


def _swap(t):
    """[..., H, S, D] -> [..., S, H, D] (a 2-D input is one head of a batch of one)."""
    return (t if t.dim() > 2 else t[None]).transpose(-3, -2)


@mistake("heads-sequence-transposed", family="layout", arguments=True, grouped=True,
         cause="the kernel reads its [B, S, H, D] inputs as [B, H, S, D]: it attends over the heads instead of the "
               "sequence (heads and sequence transposed)",
         caught_by=("matches-reference",),
         sentence="heads and sequence are transposed: a [B, S, H, D] kernel reads its inputs as [B, H, S, D] "
                  "and attends over the heads instead of the sequence",
         fix="transpose(1, 2) to [B, H, S, D] inside the kernel (and back for the output), or check it with "
             "--layout bhsd if that is its layout")
def heads_sequence_transposed(q, k, v, mask, scale, is_causal):
    q_, k_, v_ = _swap(q), _swap(k), _swap(v)  # the kit's [..., H, S, D] as the kernel reads them
    out = correct(q_, k_, v_, mask, scale_of(q, scale), causal=is_causal)  # causal over the heads (top-left, as SDPA's)
    out = out.transpose(-3, -2)  # [..., S, H, Dv] -> [..., H, S, Dv]
    return out if q.dim() > 2 else out[0]


@mistake("gqa-kv-not-repeated", family="grouped-query", grouped=True, caught_by=("gqa-equivalence",),
         sentence="grouped K/V heads are never repeated to the query heads (module.num_key_value_groups or "
                  "enable_gqa ignored): H query heads meet H_kv key heads and the scores do not broadcast",
         fix="repeat_kv: K.repeat_interleave(H // H_kv, dim=-3), V likewise (or SDPA's enable_gqa=True)")
def gqa_kv_not_repeated(q, k, v, mask, scale):
    return correct(q, k, v, mask, scale)  # [..., H, Tq, Dk] @ [..., H_kv, Dk, Tk]: raises unless H_kv is 1 or H
