"""Single-bug attentions of kinds the mistake catalog has no model for (``tests/test_unseen.py``).

Written to test the diagnosis on bugs nobody catalogued: each must get one root, named by a measured fit
(attn_spec.diagnosis.fits: the scale against the shapes, the normaliser, batch mixing) or honestly
"unexplained" with the measured numbers. No mistake model may be added to match one of them. A few are
catalogued mistakes whose symptoms look like other bugs (a missing scale saturating float16 to one-hot, an
inverted mask emptying a row into NaN): one root must name the cause, the symptoms folded into it.
``expect``: the fit's quantity that must name it, "unexplained", or the mistake id of the cause.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

UNSEEN: list["Unseen"] = []


@dataclass(frozen=True)
class Unseen:
    name: str
    obj: object
    bug: str
    expect: str  # "scale", "row normaliser", "cross-batch contribution", "unexplained", or a mistake id
    profile: str = "quick"  # the profile that draws the bug's telling case (float16 at d_k=128: default)
    says: str = ""  # words the root's sentence must hold (a fit that names the quantity but tells it wrong fails)

    def __str__(self) -> str:
        return self.name


def unseen(expect: str, bug: str, profile: str = "quick", says: str = ""):
    def register(fn):
        UNSEEN.append(Unseen(fn.__name__, fn, bug, expect, profile, says))
        return fn
    return register


def _masked(s, mask):
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def _attend(s, mask, v):
    return torch.softmax(_masked(s, mask), dim=-1) @ v  # [..., Tq, Dv]


def _qk(q, k):
    return q @ k.transpose(-2, -1)  # [..., Tq, Tk]


# ------------------------------------------------------------------ a scale taken from another shape


@unseen("scale", "the scale is taken from the sequence length: 1/sqrt(n_q)")
def scale_from_queries(q, k, v, mask=None):
    return _attend(_qk(q, k) / math.sqrt(q.shape[-2]), mask, v)


@unseen("scale", "the scale is taken from the number of keys: 1/sqrt(n_kv)")
def scale_from_keys(q, k, v, mask=None):
    return _attend(_qk(q, k) / math.sqrt(k.shape[-2]), mask, v)


@unseen("scale", "the scores are divided by the number of keys (a mean over keys): 1/n_kv")
def scale_mean_over_keys(q, k, v, mask=None):
    return _attend(_qk(q, k) / k.shape[-2], mask, v)


@unseen("scale", "the scale multiplies d_k by the number of queries: 1/sqrt(d_k n_q)")
def scale_from_width_and_queries(q, k, v, mask=None):
    return _attend(_qk(q, k) / math.sqrt(q.shape[-1] * q.shape[-2]), mask, v)


@unseen("scale", "the scale counts the heads: 1/sqrt(d_k H) with H = Q.shape[-3]")
def scale_from_heads(q, k, v, mask=None):
    heads = q.shape[-3] if q.dim() >= 3 else 1
    return _attend(_qk(q, k) / math.sqrt(q.shape[-1] * heads), mask, v)


@unseen("scale", "the scale is 1/sqrt(d_k) times the number of keys: scores grow with the sequence")
def scale_times_keys(q, k, v, mask=None):
    return _attend(_qk(q, k) * k.shape[-2] / math.sqrt(q.shape[-1]) / 4, mask, v)


@unseen("scale", "the scale is taken from both sequence lengths: 1/sqrt(n_q n_kv)")
def scale_from_both_lengths(q, k, v, mask=None):
    return _attend(_qk(q, k) / math.sqrt(q.shape[-2] * k.shape[-2]), mask, v)


@unseen("scale", "the queries are divided by the square root of the sequence length before Q K^T: 1/sqrt(n_q)")
def queries_over_sequence_length(q, k, v, mask=None):
    seq_len = q.size(-2)
    return _attend((q / seq_len ** 0.5) @ k.transpose(-2, -1), mask, v)


# ------------------------------------------------------------------ batch mixing


@unseen("cross-batch contribution", "the weights are averaged over the batch dim (a mean left in)")
def weights_mean_over_batch(q, k, v, mask=None):
    w = torch.softmax(_masked(_qk(q, k) / math.sqrt(q.shape[-1]), mask), dim=-1)  # [..., Tq, Tk]
    if w.dim() >= 3:
        w = w.mean(dim=0, keepdim=True).expand_as(w)
    return w @ v


@unseen("cross-batch contribution", "V is rolled along the batch dim: element b reads element b - 1's values")
def values_rolled_over_batch(q, k, v, mask=None):
    if v.dim() >= 3:
        v = v.roll(1, dims=0)
    return _attend(_qk(q, k) / math.sqrt(q.shape[-1]), mask, v)


@unseen("cross-batch contribution", "the softmax's max and sum are taken over the batch too (one denominator "
                                    "per query across the batch)")
def denominator_shared_by_batch(q, k, v, mask=None):
    s = _masked(_qk(q, k) / math.sqrt(q.shape[-1]), mask)  # [..., Tq, Tk]
    if s.dim() < 3:
        return torch.softmax(s, dim=-1) @ v
    e = torch.exp(s - s.amax(dim=(0, -1), keepdim=True))
    return e / e.sum(dim=(0, -1), keepdim=True) @ v


@unseen("cross-batch contribution", "element 0's keys are used for every batch element")
def first_element_keys(q, k, v, mask=None):
    if k.dim() >= 3:
        k = k[:1].expand_as(k)
    return _attend(_qk(q, k) / math.sqrt(q.shape[-1]), mask, v)


# ------------------------------------------------------------------ the normaliser


@unseen("row normaliser", "the denominator sums the exp over every entry of each matrix, the max per row")
def denominator_shared_by_rows(q, k, v, mask=None):
    s = _masked(_qk(q, k) / math.sqrt(q.shape[-1]), mask)  # [..., Tq, Tk]
    e = torch.exp(s - s.amax(dim=-1, keepdim=True)).nan_to_num(0.0)
    return e / e.sum(dim=(-2, -1), keepdim=True) @ v


@unseen("row normaliser", "the denominator is the row's sum plus the number of keys (a smoothing term)")
def denominator_plus_keys(q, k, v, mask=None):
    s = _masked(_qk(q, k) / math.sqrt(q.shape[-1]), mask)
    e = torch.exp(s - s.amax(dim=-1, keepdim=True))
    return e / (e.sum(dim=-1, keepdim=True) + 0.5) @ v


@unseen("row normaliser", "one denominator for every row of a matrix: the mean of the rows' sums of exp",
        says="one denominator is shared by all the rows of a matrix (the mean of the rows' sums)")
def denominator_mean_of_rows(q, k, v, mask=None):
    s = _masked(_qk(q, k) / math.sqrt(q.shape[-1]), mask)  # [..., Tq, Tk]
    e = torch.exp(s - s.amax(dim=-1, keepdim=True)).nan_to_num(0.0)
    return e / e.sum(dim=-1, keepdim=True).mean(dim=-2, keepdim=True) @ v


# ------------------------------------------------------------------ a catalogued mistake whose symptoms look like
# another's: one root, the cause, with the symptom folded into it (a mistake id as ``expect``)


@unseen("scale-missing", "no 1/sqrt(d_k) and the scores kept in the inputs' dtype: at float16 and d_k=128 the weights "
                         "saturate to one-hot, which looks like a mask bug", profile="default")
def unscaled_in_half_precision(q, k, v, mask=None):
    s = torch.einsum("...qd,...kd->...qk", q, k)  # [..., Tq, Tk], never scaled
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@unseen("mask-inverted", "masked_fill(mask, -inf) with True = may attend: a row whose every key is allowed is "
                         "emptied, and its softmax is NaN")
def inverted_mask_without_guard(q, k, v, mask=None):
    s = _qk(q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v


# ------------------------------------------------------------------ honestly unexplained (masks, tiles)
# (a mask applied to the first head only is no such case: mask-first-batch-only reproduces it)


@unseen("unexplained", "the last tile of 4 keys is masked with the previous tile's mask")
def last_tile_mask(q, k, v, mask=None):
    if mask is not None and mask.shape[-1] > 4 and mask.shape[-1] % 4:
        mask = mask.clone()
        cut = mask.shape[-1] - mask.shape[-1] % 4
        mask[..., cut:] = mask[..., cut - 1:cut]
    return _attend(_qk(q, k) / math.sqrt(q.shape[-1]), mask, v)


@unseen("unexplained", "masked scores are filled with the row's minimum instead of -inf")
def mask_fill_row_minimum(q, k, v, mask=None):
    s = _qk(q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        low = s.amin(dim=-1, keepdim=True).expand_as(s)
        s = torch.where(mask, s, low)
    return torch.softmax(s, dim=-1) @ v
