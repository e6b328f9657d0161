"""Correct variants and classic bugs for the robustness and gradient properties."""
import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from attn_spec.targets.module_adapters import TorchMhaAdapter
from gallery import buggy, correct
from gallery.core import SeedMultiHead, seed_function

NEG_INF = float("-inf")


def _scores(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]


def _masked(scores, mask):
    return scores if mask is None else scores.masked_fill(~mask, NEG_INF)


def _softmax_backward(A, dO, V):
    """dS = A * (dA - rowsum(A * dA)), dA = dO V^T: the softmax backward, given the weights A."""
    dA = dO @ V.transpose(-2, -1)  # [..., Tq, Tk]
    return A * (dA - (A * dA).sum(dim=-1, keepdim=True))


class _Attention(torch.autograd.Function):
    """softmax(Q K^T / sqrt(d_k)) V with a hand-written backward; the buggy subclasses rewrite the backward."""

    @staticmethod
    def forward(ctx, Q, K, V, mask):
        A = torch.softmax(_masked(_scores(Q, K), mask), dim=-1)  # [..., Tq, Tk]
        ctx.save_for_backward(Q, K, V, A)
        return A @ V

    @staticmethod
    def backward(ctx, dO):
        Q, K, V, A = ctx.saved_tensors
        dS = _softmax_backward(A, dO, V) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]
        return dS @ K, dS.transpose(-2, -1) @ Q, A.transpose(-2, -1) @ dO, None


# ---------------------------------------------------------------- correct variants


@correct()
def manual_backward(Q, K, V, mask=None):
    """A custom autograd.Function with the closed-form backward (dV = A^T dO, dS = A * (dA - rowsum(A * dA)))."""
    return _Attention.apply(Q, K, V, mask)


@correct()
def grouped_query_attention(Q, K, V, mask=None):
    """GQA without copies: query heads [..., Hkv * g, Tq, D] viewed as [..., Hkv, g, Tq, D] against
    K/V [..., Hkv, 1, Tk, D], so query head h reads KV head h // g."""
    if Q.dim() < 3 or K.dim() < 3 or K.shape[-3] in (1, Q.shape[-3]):
        return seed_function(Q, K, V, mask)
    n_q_heads, n_kv_heads = Q.shape[-3], K.shape[-3]
    group = n_q_heads // n_kv_heads
    if mask is not None and mask.dim() >= 3:
        mask = mask.unflatten(-3, (n_kv_heads, group)) if mask.shape[-3] == n_q_heads else mask.unsqueeze(-3)
    out = seed_function(Q.unflatten(-3, (n_kv_heads, group)), K.unsqueeze(-3), V.unsqueeze(-3), mask)
    return out.flatten(-4, -3)  # [..., Hq, Tq, Dv]


@correct()
def reentrant_checkpoint(Q, K, V, mask=None):
    """Activation checkpointing the old way: the backward recomputes the forward, and supports only
    .backward() (torch.autograd.grad raises inside it)."""
    return checkpoint(seed_function, Q, K, V, mask, use_reentrant=True)


@correct("module")
class ReentrantCheckpointModule(SeedMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        return checkpoint(super().forward, x_q, x_kv, mask, use_reentrant=True)


# ---------------------------------------------------------------- bugs: gradients


class _NoDeltaBackward(_Attention):
    @staticmethod
    def backward(ctx, dO):
        Q, K, V, A = ctx.saved_tensors
        dS = A * (dO @ V.transpose(-2, -1)) / math.sqrt(Q.size(-1))  # BUG: no - rowsum(A * dA) term
        return dS @ K, dS.transpose(-2, -1) @ Q, A.transpose(-2, -1) @ dO, None


@buggy("gradients",
       mistake="backward-missing-rowsum", bug="custom backward: the softmax backward misses the - rowsum(A * dA) term")
def wrong_softmax_backward(Q, K, V, mask=None):
    return _NoDeltaBackward.apply(Q, K, V, mask)


class _UnscaledBackward(_Attention):
    @staticmethod
    def backward(ctx, dO):
        Q, K, V, A = ctx.saved_tensors
        dS = _softmax_backward(A, dO, V)  # BUG: the forward divides by sqrt(d_k), the backward forgets to
        return dS @ K, dS.transpose(-2, -1) @ Q, A.transpose(-2, -1) @ dO, None


@buggy("gradients", mistake="backward-missing-scale", bug="custom backward: dQ and dK miss the 1/sqrt(d_k) factor")
def backward_missing_scale(Q, K, V, mask=None):
    return _UnscaledBackward.apply(Q, K, V, mask)


@buggy("gradients", mistake="values-detached", bug="V detached: no gradient reaches the values")
def detached_values(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ V.detach()


@buggy("gradients", bug="computed under torch.no_grad() (copied from an inference script): it cannot be trained",
       mistake="output-detached")
def computed_under_no_grad(Q, K, V, mask=None):
    with torch.no_grad():
        return seed_function(Q, K, V, mask)


@buggy("gradients", bug="the output .detach()ed: it cannot be trained", mistake="output-detached")
def detached_output(Q, K, V, mask=None):
    return seed_function(Q, K, V, mask).detach()


@buggy("gradients", bug="computed on Q.data, K.data, V.data: autograd never sees the inputs",
       mistake="output-detached")
def computed_on_data(Q, K, V, mask=None):
    return seed_function(Q.data, K.data, V.data, mask)


@buggy("gradients", bug="a NumPy round trip (torch -> numpy -> torch): the graph is lost", mistake="output-detached")
def numpy_round_trip(Q, K, V, mask=None):
    out = seed_function(Q, K, V, mask)  # [..., Tq, Dv]
    as_numpy = out.detach().cpu().double().numpy()  # e.g. to post-process with NumPy
    return torch.from_numpy(as_numpy).to(device=Q.device, dtype=Q.dtype)


@buggy("gradients", bug="forward under torch.no_grad() (copied from an inference script)", convention="module",
       mistake="output-detached")
class NoGradModule(SeedMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        with torch.no_grad():
            return super().forward(x_q, x_kv, mask)


@buggy("gradients", bug="an adapter that runs nn.MultiheadAttention under torch.no_grad()", convention="adapter",
       mistake="output-detached")
class NoGradMhaAdapter(TorchMhaAdapter):
    def __init__(self):
        super().__init__(torch.nn.MultiheadAttention)

    def forward(self, module, x_q, x_kv, mask):
        with torch.no_grad():
            return super().forward(module, x_q, x_kv, mask)


class _PaddedBackward(_Attention):
    @staticmethod
    def backward(ctx, dO):
        Q, K, V, A = ctx.saved_tensors
        pad = -V.shape[-2] % 4  # the backward works on key blocks of 4; the tail is uninitialised memory
        V_pad = torch.cat([V, V.new_full((*V.shape[:-2], pad, V.shape[-1]), float("nan"))], dim=-2)
        A_pad = F.pad(A, (0, pad))  # BUG: padded keys get weight 0, but 0 * NaN is NaN in the row sum
        dS = _softmax_backward(A_pad, dO, V_pad)[..., :K.shape[-2]] / math.sqrt(Q.size(-1))
        return dS @ K, dS.transpose(-2, -1) @ Q, A.transpose(-2, -1) @ dO, None


@buggy("gradients",
       mistake="backward-unmasked-padding", bug="custom backward pads keys to a block of 4 and never masks the padding: NaN in dQ, dK "
       "(FlashAttention #334)")
def nan_gradients_from_padding(Q, K, V, mask=None):
    return _PaddedBackward.apply(Q, K, V, mask)


class _UnmaskedBackward(_Attention):
    @staticmethod
    def backward(ctx, dO):
        Q, K, V, _ = ctx.saved_tensors
        A = torch.softmax(_scores(Q, K), dim=-1)  # BUG: recomputed for the backward without the mask
        dS = _softmax_backward(A, dO, V) / math.sqrt(Q.size(-1))
        return dS @ K, dS.transpose(-2, -1) @ Q, A.transpose(-2, -1) @ dO, None


@buggy("gradients",
       mistake="backward-ignores-mask", bug="custom backward recomputes the weights without the mask: gradients leak to the future")
def causal_backward_leak(Q, K, V, mask=None):
    return _UnmaskedBackward.apply(Q, K, V, mask)


# ---------------------------------------------------------------- bugs: determinism


@buggy("determinism",
       mistake="dropout-at-inference", bug="dropout left on at inference (F.dropout defaults to training=True)")
def dropout_left_on(Q, K, V, mask=None):
    return F.dropout(torch.softmax(_masked(_scores(Q, K), mask), dim=-1), p=0.1) @ V


@buggy("determinism", mistake="noise-at-inference", bug="random jitter added to the scores to break ties")
def jittered_scores(Q, K, V, mask=None):
    scores = _scores(Q, K) + 1e-3 * torch.rand_like(_scores(Q, K))
    return torch.softmax(_masked(scores, mask), dim=-1) @ V


@buggy("determinism",
       mistake="dropout-at-inference", bug="F.dropout(weights, 0.1) ignores eval(): training defaults to True", convention="module")
class FunctionalDropoutInModule(SeedMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        Q, K, V = self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv))
        weights = F.dropout(torch.softmax(_masked(_scores(Q, K), mask), dim=-1), p=0.1)
        return self.W_O(self.merge(weights @ V))


@buggy("determinism",
       mistake="kv-cache-left-on", bug="a KV cache left on: every call also attends to the keys of earlier calls",
       convention="module")
class KVCacheLeftOn(SeedMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        Q, K, V = self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv))
        cached_k, cached_v = getattr(self, "cache", (K[..., :0, :], V[..., :0, :]))
        if cached_k.shape[-1] == K.shape[-1]:
            K, V = torch.cat([cached_k, K], dim=-2), torch.cat([cached_v, V], dim=-2)
            if mask is not None:  # cached keys are always visible
                mask = torch.cat([mask.new_ones(*mask.shape[:-1], cached_k.shape[-2]), mask], dim=-1)
        self.cache = (K, V)
        return self.W_O(self.merge(seed_function(Q, K, V, mask)))


# ---------------------------------------------------------------- bugs: inputs modified in place


@buggy("inputs-unchanged",
       mistake="queries-scaled-in-place", bug="Q scaled in place (Q.mul_(scale)) to save memory")
def scales_q_in_place(Q, K, V, mask=None):
    Q.mul_(1 / math.sqrt(Q.size(-1)))
    return torch.softmax(_masked(Q @ K.transpose(-2, -1), mask), dim=-1) @ V


@buggy("inputs-unchanged",
       mistake="mask-inverted-in-place", bug="the mask inverted in place (mask.logical_not_()) for masked_fill")
def inverts_mask_in_place(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(mask.logical_not_(), NEG_INF)
    return torch.softmax(scores, dim=-1) @ V


@buggy("inputs-unchanged",
       mistake="keys-transposed-in-place", bug="K transposed in place (K.transpose_) instead of K.transpose")
def transposes_k_in_place(Q, K, V, mask=None):
    K.transpose_(-2, -1)
    return torch.softmax(_masked(Q @ K / math.sqrt(Q.size(-1)), mask), dim=-1) @ V


@buggy("inputs-unchanged",
       mistake="mask-inverted-in-place", bug="converts the mask to True = ignore in place (mask.logical_not_())",
       convention="module")
class InvertsMaskInPlaceModule(SeedMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        Q, K, V = self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv))
        scores = _scores(Q, K)
        if mask is not None:
            scores = scores.masked_fill(mask.logical_not_(), NEG_INF)
        return self.W_O(self.merge(torch.softmax(scores, dim=-1) @ V))


# ---------------------------------------------------------------- bugs: dtype and device


@buggy("dtype-device",
       mistake="softmax-float32-not-cast-back", bug="the softmax upcast to float32 is never cast back")
def float32_softmax_not_cast_back(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K), mask).float(), dim=-1) @ V.float()


@buggy("dtype-device",
       mistake="output-buffer-default-dtype", bug="the output buffer is torch.zeros(shape): default dtype (float32) and device")
def default_dtype_output_buffer(Q, K, V, mask=None):
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    out = torch.zeros(*batch, Q.shape[-2], V.shape[-1])  # [..., Tq, Dv]
    out[...] = torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ V
    return out


@buggy("dtype-device", mistake="float64-not-cast-back", bug="computed in float64 for accuracy and never cast back")
def float64_not_cast_back(Q, K, V, mask=None):
    return seed_function(Q.double(), K.double(), V.double(), mask)


# ---------------------------------------------------------------- bugs: strides


def _as_if_contiguous(t):
    """What a kernel sees when it indexes element [..., i, j] at i * D + j from the data pointer."""
    return t.as_strided(t.shape, torch.empty(t.shape, device="meta").stride())


@buggy("non-contiguous",
       mistake="assumes-contiguous", bug="assumes contiguous inputs (a kernel indexing [i, j] at i * D + j)")
def assumes_row_major(Q, K, V, mask=None):
    Q, K, V = (_as_if_contiguous(t) for t in (Q, K, V))
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ V


@buggy("non-contiguous",
       mistake="view-on-strided-keys", bug="folds the scale into K through K.view(-1, d_k): fails on transposed or expanded K")
def scales_keys_through_view(Q, K, V, mask=None):
    K = (K.view(-1, K.shape[-1]) / math.sqrt(K.shape[-1])).view(K.shape)
    return torch.softmax(_masked(Q @ K.transpose(-2, -1), mask), dim=-1) @ V


# ---------------------------------------------------------------- bugs: long sequences


@buggy("long-sequences",
       mistake="kv-buffer-truncated", bug="a fixed KV buffer of 512 slots: keys beyond it are silently dropped")
def truncated_kv_buffer(Q, K, V, mask=None):
    K, V = K[..., :512, :], V[..., :512, :]
    return seed_function(Q, K, V, None if mask is None else mask[..., :512])


@buggy("long-sequences",
       mistake="exp-without-max", bug="exp(s) / sum(exp(s)) without subtracting the max: the float16 sum overflows "
       "once a row has thousands of keys")
def unstabilised_softmax(Q, K, V, mask=None):
    e = torch.exp(_masked(_scores(Q, K), mask))  # [..., Tq, Tk]
    return e / e.sum(dim=-1, keepdim=True) @ V


@buggy("long-sequences",
       mistake="kv-buffer-overflow", bug="keys read through a hard-coded block of 16 positions: IndexError from 17 "
       "keys on, a crash no refusal or position buffer declares (the length probe bisects it; long-sequences fails)")
def hard_coded_block_of_16(Q, K, V, mask=None):
    idx = torch.arange(16, device=K.device)[torch.arange(K.shape[-2], device=K.device)]  # IndexError past 16 keys
    return seed_function(Q, K[..., idx, :], V[..., idx, :], mask)


@buggy("long-sequences",
       mistake="head-dim-tile", bug="scores use only the first 128 dims of Q and K (a kernel tile limit)")
def head_dim_tile_128(Q, K, V, mask=None):
    scores = Q[..., :128] @ K[..., :128].transpose(-2, -1) / math.sqrt(Q.size(-1))
    return torch.softmax(_masked(scores, mask), dim=-1) @ V


# ---------------------------------------------------------------- bugs: grouped-query attention


def _gqa(Q, K, V, mask, repeat_kv):
    if Q.dim() >= 3 and K.dim() >= 3 and K.shape[-3] not in (1, Q.shape[-3]):
        K, V = repeat_kv(K, Q.shape[-3]), repeat_kv(V, Q.shape[-3])
    return seed_function(Q, K, V, mask)


@correct()
def gqa_tile_grouped(Q, K, V, mask=None):
    """GQA with K/V heads tiled as einops' repeat(k, 'b h n d -> b (g h) n d') does: query head h reads
    KV head h % Hkv. A convention (gqa-grouping=tile in the header), not a bug."""
    def tile(t, n_heads):  # [..., Hkv, T, D] -> [..., g * Hkv, T, D]: heads [h0, h1, h0, h1]
        g = n_heads // t.shape[-3]
        return t.unsqueeze(-4).expand(*t.shape[:-3], g, *t.shape[-3:]).flatten(-4, -3)
    return _gqa(Q, K, V, mask, tile)


@buggy("gqa-equivalence",
       mistake="gqa-first-kv-head", bug="the MQA path applied to GQA: every query head reads KV head 0")
def gqa_first_kv_head_only(Q, K, V, mask=None):
    return _gqa(Q, K, V, mask, lambda t, n: t[..., :1, :, :])
