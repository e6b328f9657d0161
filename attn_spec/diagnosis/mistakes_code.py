"""The catalog of mistakes in the code around a right formula: batching, memory layout, dtypes,
inputs written in place, long rows, grouped K/V heads, and the sdpa keyword arguments."""
from __future__ import annotations

import math

import torch

from attn_spec.diagnosis.model import NEG_INF, correct, masked, mistake, scale_of, scores, softmax_keys
from attn_spec.targets.layouts import broadcast_shapes


def _batch(*tensors):
    return broadcast_shapes(*(t.shape[:-2] for t in tensors))


# ---------------------------------------------------------------- batching


@mistake("batch-sequence-first", family="batching", caught_by=("batch-independence",),
         sentence="K and V are read sequence-first: a reshape turns [B, T, D] into [T, B, D] without a transpose, "
                  "so batch elements swap keys",
         fix="keep the batch dims first (transpose, do not reshape, between layouts)")
def batch_sequence_first(q, k, v, mask, scale):
    if q.dim() < 3:
        return correct(q, k, v, mask, scale)
    batch = _batch(q, k, v)

    def seq_first(t):
        t = t.expand(*batch, *t.shape[-2:])
        return t.reshape(t.shape[-2], -1, t.shape[-1]).transpose(0, 1).reshape(t.shape)

    return correct(q, seq_first(k), seq_first(v), mask, scale)


@mistake("batch-flattened-with-view", family="batching", exact=True, caught_by=("batch-independence",),
         sentence="the batch dims are flattened with .view(), which fails on broadcast (stride-0) K/V or masks",
         fix="use .reshape() (or flatten()) instead of .view()")
def batch_flattened_with_view(q, k, v, mask, scale):
    batch = _batch(q, k, v)
    q, k, v = (t.expand(*batch, *t.shape[-2:]).view(-1, *t.shape[-2:]) for t in (q, k, v))  # [B, T, D]
    if mask is not None:
        mask = mask.expand(*batch, *mask.shape[-2:]).view(-1, *mask.shape[-2:])
    return correct(q, k, v, mask, scale).view(*batch, q.shape[-2], v.shape[-1])


# ---------------------------------------------------------------- memory layout


@mistake("assumes-contiguous", family="memory layout", exact=True, caught_by=("non-contiguous",),
         sentence="the code reads the inputs as if they were contiguous (a kernel indexing [i, j] at i * D + j): "
                  "transposed or sliced inputs are read wrong",
         fix="call .contiguous() on the inputs first, or index with the tensors' strides")
def assumes_contiguous(q, k, v, mask, scale):
    def as_if_contiguous(t):
        return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride())
    return correct(*(as_if_contiguous(t) for t in (q, k, v)), mask, scale)


@mistake("view-on-strided-keys", family="memory layout", exact=True, caught_by=("non-contiguous",),
         sentence="K goes through .view() (to fold the scale or split heads), which fails on transposed or "
                  "expanded K",
         fix="use .reshape() instead of .view()")
def view_on_strided_keys(q, k, v, mask, scale):
    k = (k.view(-1, k.shape[-1]) * scale_of(q, scale)).view(k.shape)
    return correct(q, k, v, mask, 1.0)


# ---------------------------------------------------------------- dtypes


@mistake("computes-in-float32", family="dtype", precision="float32", caught_by=("matches-reference",),
         cause="float64 inputs computed at float32 precision: error {err:.1g}, budget {budget:.1g}",
         sentence="float64 inputs are computed at float32 precision (a cast, a float32 buffer, or a float32 softmax)",
         fix="compute in the inputs' dtype (or wider); if float32 is deliberate, declare it: --dtypes float32")
def computes_in_float32(q, k, v, mask, scale):
    return correct(q.float(), k.float(), v.float(), mask if mask is None or mask.dtype == torch.bool
                   else mask.float(), scale)


@mistake("softmax-float32-not-cast-back", family="dtype", exact=True, caught_by=("dtype-device",),
         sentence="the softmax is upcast to float32 and the result is never cast back to the inputs' dtype",
         fix="cast the weights back: torch.softmax(scores.float(), dim=-1).to(Q.dtype) @ V")
def softmax_float32_not_cast_back(q, k, v, mask, scale):
    return torch.softmax(masked(scores(q, k, scale), mask).float(), dim=-1) @ v.float()


@mistake("output-buffer-default-dtype", family="dtype", exact=True, caught_by=("dtype-device",),
         sentence="the output buffer is torch.zeros(shape): the default dtype (float32) and device, not the inputs'",
         fix="torch.zeros(shape, dtype=Q.dtype, device=Q.device), or torch.empty_like")
def output_buffer_default_dtype(q, k, v, mask, scale):
    out = torch.zeros(*_batch(q, k, v), q.shape[-2], v.shape[-1])
    out[...] = correct(q, k, v, mask, scale)
    return out


@mistake("float64-not-cast-back", family="dtype", exact=True, caught_by=("dtype-device",),
         sentence="the attention is computed in float64 for accuracy and returned as float64",
         fix="cast the result back: out.to(Q.dtype)")
def float64_not_cast_back(q, k, v, mask, scale):
    return correct(q.double(), k.double(), v.double(), mask if mask is None or mask.dtype == torch.bool
                   else mask.double(), scale)


# ---------------------------------------------------------------- inputs written in place


@mistake("queries-scaled-in-place", family="in place", exact=True, caught_by=("inputs-unchanged",),
         sentence="Q is scaled in place (Q.mul_(scale) or Q /= sqrt(d_k)): the caller's Q changes, and a second call "
                  "scales it again",
         fix="Q * scale (out of place)")
def queries_scaled_in_place(q, k, v, mask, scale):
    q.mul_(scale_of(q, scale))
    return correct(q, k, v, mask, 1.0)


@mistake("mask-inverted-in-place", family="in place", exact=True, caught_by=("inputs-unchanged",),
         sentence="the mask is inverted in place (mask.logical_not_()) to switch polarity: the caller's mask "
                  "flips on every call",
         fix="~mask or mask.logical_not() (out of place)")
def mask_inverted_in_place(q, k, v, mask, scale):
    s = scores(q, k, scale)
    if mask is not None:
        s = s.masked_fill(mask.logical_not_(), NEG_INF)
    return softmax_keys(s) @ v


@mistake("keys-transposed-in-place", family="in place", exact=True, caught_by=("inputs-unchanged",),
         sentence="K is transposed in place (K.transpose_) instead of K.transpose: the caller's K changes shape",
         fix="K.transpose(-2, -1) (out of place)")
def keys_transposed_in_place(q, k, v, mask, scale):
    k.transpose_(-2, -1)
    return softmax_keys(masked(q @ k * scale_of(q, scale), mask)) @ v


# ---------------------------------------------------------------- long rows and wide heads


@mistake("kv-buffer-truncated", family="long sequences", caught_by=("long-sequences",),
         cause="the last {dropped} keys are ignored: the loop over key blocks of {block} drops the partial block at the "
               "end (n_kv = {n_kv} is not a multiple of {block})",
         params=tuple({"slots": n} for n in (512, 256, 1024, 128, 2048, 4096, 64, 32, 16)),
         sentence="keys beyond the first {slots} are silently dropped: a fixed buffer of {slots} key slots, or a "
                  "loop over key blocks that skips the partial block at the end",
         fix="size buffers from the input (K.shape[-2]), or loop over all key blocks")
def kv_buffer_truncated(q, k, v, mask, scale, slots):
    return correct(q, k[..., :slots, :], v[..., :slots, :], None if mask is None else mask[..., :slots], scale)


@mistake("kv-buffer-overflow", family="long sequences", caught_by=("long-sequences",),
         params=tuple({"slots": n} for n in (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)),
         sentence="a fixed buffer of {slots} key slots: more keys than that crash the copy into it",
         fix="size buffers from the input (K.shape[-2])")
def kv_buffer_overflow(q, k, v, mask, scale, slots):
    buffer = torch.zeros(*k.shape[:-2], slots, k.shape[-1], dtype=k.dtype)
    buffer[..., :k.shape[-2], :] = k  # raises once there are more keys than slots
    return correct(q, k, v, mask, scale)


@mistake("head-dim-tile", family="long sequences", caught_by=("long-sequences",),
         params=tuple({"dims": n} for n in (128, 64, 256, 32)),
         sentence="only the first {dims} dims of Q and K enter the scores (a kernel tile limit)",
         fix="loop over every tile of the head dim, or reject d_k > {dims} with NotImplementedError")
def head_dim_tile(q, k, v, mask, scale, dims):
    return correct(q[..., :dims], k[..., :dims], v, mask, scale_of(q, scale))  # scaled for the whole d_k


# ---------------------------------------------------------------- grouped-query attention


def _grouped(q, k):
    return q.dim() >= 3 and k.dim() >= 3 and 1 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0


@mistake("gqa-tiled", family="grouped-query", grouped=True, caught_by=("gqa-equivalence",),
         sentence="K/V heads are tiled with repeat ([h0, h1, h0, h1]) instead of repeat_interleave: query head h "
                  "reads KV head h % H_kv, not h // g",
         fix="K.repeat_interleave(g, dim=-3) (or SDPA's enable_gqa=True)")
def gqa_tiled(q, k, v, mask, scale):
    if _grouped(q, k):
        n = q.shape[-3] // k.shape[-3]
        k, v = (t.repeat(*[1] * (t.dim() - 3), n, 1, 1) for t in (k, v))
    return correct(q, k, v, mask, scale)


@mistake("gqa-first-kv-head", family="grouped-query", grouped=True, caught_by=("gqa-equivalence",),
         sentence="every query head reads KV head 0 (a multi-query path applied to grouped heads)",
         fix="query head h reads KV head h // g: K.repeat_interleave(g, dim=-3)")
def gqa_first_kv_head(q, k, v, mask, scale):
    if _grouped(q, k):
        k, v = k[..., :1, :, :], v[..., :1, :, :]
    return correct(q, k, v, mask, scale)


# ---------------------------------------------------------------- the sdpa keyword arguments


@mistake("scale-argument-ignored", family="arguments", arguments=True, caught_by=("scale-argument",),
         sentence="the scale argument is ignored: the default 1/sqrt(d_k) is always used",
         fix="use scale when it is not None: scores * (scale if scale is not None else 1 / math.sqrt(d_k))")
def scale_argument_ignored(q, k, v, mask, scale, is_causal):
    return correct(q, k, v, mask, None, causal=is_causal)


@mistake("scale-argument-sqrt-split", family="arguments", arguments=True, caught_by=("scale-argument",),
         sentence="sqrt(scale) is applied to Q and K separately: a negative scale has no square root",
         fix="multiply the scores (or Q alone) by scale")
def scale_argument_sqrt_split(q, k, v, mask, scale, is_causal):
    s = math.sqrt(scale_of(q, scale))  # raises ValueError for scale < 0
    return correct(q * s, k * s, v, mask, 1.0, causal=is_causal)


@mistake("is-causal-ignored", family="arguments", arguments=True, caught_by=("is-causal",),
         sentence="is_causal is ignored: queries see the future",
         fix="when is_causal, mask keys j > i (torch.ones(n_q, n_kv, dtype=torch.bool).tril())")
def is_causal_ignored(q, k, v, mask, scale, is_causal):
    return correct(q, k, v, mask, scale)


@mistake("is-causal-diagonal-masked", family="arguments", arguments=True, caught_by=("is-causal",),
         params=({"first_key": True}, {"first_key": False}, {"first_key": False, "alignment": "bottom-right"}),
         sentence="the causal triangle is off by one: it masks the diagonal too (triu(diagonal=0) or tril(-1)), "
                  "so no query sees its own key",
         fix="keep j <= i: torch.ones(n_q, n_kv, dtype=torch.bool).tril() (or masked_fill(triu(diagonal=1)))")
def is_causal_diagonal_masked(q, k, v, mask, scale, is_causal, first_key, alignment="top-left"):
    if is_causal:
        offset = 0 if alignment == "top-left" else k.shape[-2] - q.shape[-2]  # bottom-right: the last query, the last key
        tril = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(offset - 1)  # [Tq, Tk], the diagonal masked
        if first_key:
            tril[:, 0] = True  # ... with key 0 kept so that row 0 is not empty
        mask = tril if mask is None else tril & mask
    return correct(q, k, v, mask, scale)
