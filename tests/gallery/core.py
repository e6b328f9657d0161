"""Correct variants and classic bugs for the seed's properties."""
import math

import torch
import torch.nn.functional as F

from attn_spec import reference
from gallery import buggy, correct

NEG_INF = float("-inf")


def _scores(Q, K, scale=None):
    scale = 1 / math.sqrt(Q.size(-1)) if scale is None else scale
    return Q @ K.transpose(-2, -1) * scale  # [..., Tq, Tk]


def _masked(scores, mask):
    return scores if mask is None else scores.masked_fill(~mask, NEG_INF)


# ---------------------------------------------------------------- correct variants


@correct()
def seed_function(Q, K, V, mask=None):
    """The seed's four lines."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, NEG_INF)
    return scores.softmax(dim=-1) @ V


@correct()
def einsum_style(Q, K, V, mask=None):
    scores = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])  # [..., Tq, Tk]
    weights = torch.softmax(_masked(scores, mask), dim=-1)
    return torch.einsum("...qk,...kd->...qd", weights, V)  # [..., Tq, Dv]


@correct()
def online_softmax(Q, K, V, mask=None, block=3):
    """Flash-style: one pass over key blocks with a running max and running sum (in the input dtype)."""
    batch = torch.broadcast_shapes(Q.shape[:-2], K.shape[:-2], V.shape[:-2])
    n_q, n_kv = Q.shape[-2], K.shape[-2]
    if mask is not None:
        mask = mask.expand(*batch, n_q, n_kv)
    run_max = torch.full((*batch, n_q, 1), NEG_INF, dtype=Q.dtype, device=Q.device)  # [..., Tq, 1]
    run_sum = torch.zeros((*batch, n_q, 1), dtype=Q.dtype, device=Q.device)  # [..., Tq, 1]
    acc = torch.zeros((*batch, n_q, V.shape[-1]), dtype=Q.dtype, device=Q.device)  # [..., Tq, Dv]
    for start in range(0, n_kv, block):
        s = _scores(Q, K[..., start:start + block, :])  # [..., Tq, b]
        if mask is not None:
            s = s.masked_fill(~mask[..., start:start + block], NEG_INF)
        new_max = torch.maximum(run_max, s.amax(dim=-1, keepdim=True))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        correction = torch.exp(run_max - safe_max)  # rescales what was accumulated so far
        p = torch.exp(s - safe_max)  # [..., Tq, b]
        run_sum = run_sum * correction + p.sum(dim=-1, keepdim=True)
        acc = acc * correction + p @ V[..., start:start + block, :]
        run_max = new_max
    return acc / run_sum


@correct()
def float64_inside(Q, K, V, mask=None):
    out = seed_function(Q.double(), K.double(), V.double(), mask)
    return out.to(Q.dtype)


@correct()
def sdpa(Q, K, V, mask=None):
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


@correct()
def logsumexp_style(Q, K, V, mask=None):
    """exp(s - logsumexp(s)); the log-sum-exp is kept in float32 for 16-bit inputs, as kernels do
    (in float16 its rounding at |s| ~ 1000 alone is 0.25, a 28% error in every weight)."""
    scores = _masked(_scores(Q, K), mask)  # [..., Tq, Tk]
    wide = scores.float() if Q.element_size() < 4 else scores
    return torch.exp(wide - torch.logsumexp(wide, dim=-1, keepdim=True)).to(Q.dtype) @ V


@correct()
def chunked_over_queries(Q, K, V, mask=None, chunk=2):
    rows = []
    for start in range(0, Q.shape[-2], chunk):
        m = None if mask is None else mask[..., start:start + chunk, :]
        rows.append(seed_function(Q[..., start:start + chunk, :], K, V, m))
    return torch.cat(rows, dim=-2)


@correct()
def additive_finfo_min_mask(Q, K, V, mask=None):
    """The Hugging Face style: the mask becomes an additive bias of finfo.min."""
    scores = _scores(Q, K)
    if mask is not None:
        bias = torch.zeros(mask.shape, dtype=Q.dtype, device=Q.device)
        scores = scores + bias.masked_fill(~mask, torch.finfo(Q.dtype).min)
    return torch.softmax(scores, dim=-1) @ V


@correct()
def scale_keys_first(Q, K, V, mask=None):
    """Folds the scale into K and computes (V^T A^T)^T."""
    weights = torch.softmax(_masked(Q @ (K / math.sqrt(K.size(-1))).transpose(-2, -1), mask), dim=-1)
    return (V.transpose(-2, -1) @ weights.transpose(-2, -1)).transpose(-2, -1)


correct()(reference.reference_attention)
correct("module")(reference.MultiHeadAttention)


@correct("module")
class SeedMultiHead(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def split(self, t):  # [n, d_model] -> [h, n, d_k]
        return t.view(t.size(0), self.h, self.d_k).transpose(0, 1)

    def merge(self, heads):  # [h, n, d_k] -> [n, d_model]
        return heads.transpose(0, 1).reshape(heads.size(1), -1)

    def forward(self, x_q, x_kv, mask=None):
        heads = seed_function(self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv)), mask)
        return self.W_O(self.merge(heads))


# ---------------------------------------------------------------- bugs: softmax axis and normalisation


@buggy("rows-sum-to-one", "matches-reference", mistake="softmax-over-queries", bug="softmax over the query axis")
def softmax_over_queries(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-2).nan_to_num(0.0) @ V


@buggy("rows-sum-to-one", "matches-reference", mistake="softmax-unnormalised", bug="exp without normalisation")
def unnormalised_exp(Q, K, V, mask=None):
    scores = _masked(_scores(Q, K), mask)
    return torch.exp(scores - scores.amax(dim=-1, keepdim=True)) @ V


@buggy("rows-sum-to-one", "matches-reference", mistake="sigmoid-weights", bug="sigmoid instead of softmax")
def sigmoid_weights(Q, K, V, mask=None):
    return torch.sigmoid(_masked(_scores(Q, K), mask)) @ V


@buggy("matches-reference", mistake="softmax-over-queries", bug="softmax(dim=2): the key axis of [B, n_q, n_kv] scores, but the query axis of "
       "[B, H, n_q, n_kv] (wrong only for 4-D inputs)")
def softmax_dim_2(Q, K, V, mask=None):
    unbatched = Q.dim() == 2  # 2-D inputs get a batch dim, so that dim 2 is the key axis
    if unbatched:
        Q, K, V, mask = Q[None], K[None], V[None], None if mask is None else mask[None]
    out = torch.softmax(_masked(_scores(Q, K), mask), dim=2).nan_to_num(0.0) @ V
    return out[0] if unbatched else out


# ---------------------------------------------------------------- bugs: masks


@buggy("matches-reference", mistake="keys-cut-to-queries",
       bug="one sequence length for queries and keys: only the first n_q keys are read")
def keys_cut_to_queries(Q, K, V, mask=None):
    n = Q.shape[-2]  # the bug: the key count taken from Q, as a self-attention loop would
    K, V = K[..., :n, :], V[..., :n, :]
    if mask is not None and mask.shape[-1] > 1:
        mask = mask[..., :n]
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-1).nan_to_num(0.0) @ V


@buggy("causal-mask", "matches-reference", mistake="mask-ignored", bug="the mask argument is ignored")
def ignores_mask(Q, K, V, mask=None):
    return torch.softmax(_scores(Q, K), dim=-1) @ V


@buggy("causal-mask", "matches-reference",
       mistake="mask-inverted", bug="mask polarity inverted (True taken as 'ignore')")
def inverted_mask(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(mask, NEG_INF)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ V


@buggy("causal-mask", "matches-reference", mistake="mask-transposed", bug="mask transposed")
def transposed_mask(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        m = mask.transpose(-2, -1)
        if m.shape[-2:] != scores.shape[-2:]:
            m = m[..., :scores.shape[-2], :scores.shape[-1]]
            pad = scores.shape[-1] - m.shape[-1]
            m = F.pad(m, (0, pad, 0, scores.shape[-2] - m.shape[-2]), value=True)
        scores = scores.masked_fill(~m, NEG_INF)
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ V


# ---------------------------------------------------------------- bugs: position dependence


@buggy("permutation-equivariance", "matches-reference",
       mistake="positional-bias", bug="a positional bias inside attention")
def positional_bias(Q, K, V, mask=None):
    bias = 0.5 * torch.arange(K.shape[-2], dtype=Q.dtype, device=Q.device)  # [Tk]
    return torch.softmax(_masked(_scores(Q, K) + bias, mask), dim=-1) @ V


@buggy("permutation-equivariance", "matches-reference",
       mistake="causal-hard-coded", bug="a causal mask hard-coded inside")
def hard_coded_causal(Q, K, V, mask=None):
    tril = reference.causal_mask(Q.shape[-2], K.shape[-2], device=Q.device)
    return torch.softmax(_masked(_masked(_scores(Q, K), tril), mask), dim=-1).nan_to_num(0.0) @ V


@buggy("permutation-equivariance", "matches-reference",
       mistake="values-cumsum", bug="values summed cumulatively over keys")
def cumulative_values(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ V.cumsum(dim=-2)


# ---------------------------------------------------------------- bugs: scale


@buggy("scale-sqrt-dk", "matches-reference", mistake="scale-one-over-dk", bug="divides by d_k")
def scale_one_over_dk(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K, 1 / Q.size(-1)), mask), dim=-1) @ V


@buggy("scale-sqrt-dk", "matches-reference", mistake="scale-missing", bug="no scaling")
def no_scale(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K, 1.0), mask), dim=-1) @ V


@buggy("scale-sqrt-dk", "matches-reference", mistake="scale-hard-coded", bug="sqrt(64) hard-coded")
def hard_coded_scale(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K, 1 / 8), mask), dim=-1) @ V


@buggy("scale-sqrt-dk", "matches-reference",
       mistake="scale-one-over-dk", bug="scale applied twice (Q prescaled, then 1/sqrt(d_k) again)")
def scale_twice(Q, K, V, mask=None):
    return sdpa(Q / math.sqrt(Q.size(-1)), K, V, mask)


# ---------------------------------------------------------------- bugs: rectangular shapes


@buggy("cross-attention-shapes", "matches-reference", mistake="keys-as-values", bug="K used as the values")
def keys_as_values(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ K


@buggy("cross-attention-shapes", mistake="default-mask-square", bug="default mask built from the query length")
def square_default_mask(Q, K, V, mask=None):
    if mask is None:
        mask = torch.ones(Q.shape[-2], Q.shape[-2], dtype=torch.bool, device=Q.device)
    return torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ V


@buggy("cross-attention-shapes", mistake="output-truncated-to-dk", bug="output truncated to the query width")
def output_as_wide_as_queries(Q, K, V, mask=None):
    out = torch.softmax(_masked(_scores(Q, K), mask), dim=-1) @ V
    return out[..., : Q.shape[-1]]


# ---------------------------------------------------------------- bugs: multi-head plumbing


class _BuggyMultiHead(SeedMultiHead):
    scale_width = False

    def forward(self, x_q, x_kv, mask=None):
        Q, K, V = self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv))
        scale = 1 / math.sqrt(self.h * self.d_k if self.scale_width else self.d_k)
        heads = torch.softmax(_masked(Q @ K.transpose(-2, -1) * scale, mask), dim=-1) @ V
        return self.W_O(self.merge(heads))


@buggy("head-concat-equivalence", "permutation-equivariance",
       mistake="heads-split-without-transpose", bug="heads split with view and no transpose",
       convention="module")
class SplitWithoutTranspose(_BuggyMultiHead):
    def split(self, t):
        return t.reshape(self.h, t.size(0), self.d_k)


@buggy("head-concat-equivalence",
       mistake="heads-merged-without-transpose", bug="heads merged with view and no transpose", convention="module")
class MergeWithoutTranspose(_BuggyMultiHead):
    def merge(self, heads):
        return heads.reshape(heads.size(1), -1)


@buggy("head-concat-equivalence", "scale-sqrt-dk",
       mistake="scale-d-model", bug="scale uses d_model, not the per-head d_k",
       convention="module")
class ScaleByModelWidth(_BuggyMultiHead):
    scale_width = True


@buggy("head-concat-equivalence",
       mistake="output-projection-missing", bug="W_O never applied", convention="module")
class MissingOutputProjection(_BuggyMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        Q, K, V = self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv))
        return self.merge(seed_function(Q, K, V, mask))


# ---------------------------------------------------------------- bugs: values only


@buggy("matches-reference", mistake="computes-in-float32", bug="float64 inputs computed in float32")
def float32_inside(Q, K, V, mask=None):
    return seed_function(Q.float(), K.float(), V.float(), mask).to(Q.dtype)


@buggy("matches-reference", mistake="scale-temperature", bug="softmax temperature 0.9 left in")
def temperature(Q, K, V, mask=None):
    return torch.softmax(_masked(_scores(Q, K) / 0.9, mask), dim=-1) @ V


# ---------------------------------------------------------------- the sdpa convention: scale and is_causal

correct("sdpa")(F.scaled_dot_product_attention)


@correct("sdpa")
def sdpa_bottom_right_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """FlashAttention >= 2.1's causal alignment (a convention, reported, not a bug); empty rows give 0.
    Masks are bool (True = may attend) or additive float, as SDPA's."""
    if is_causal:
        attn_mask = reference.causal_mask(query.shape[-2], key.shape[-2], alignment="bottom-right", device=query.device)
    if attn_mask is None:
        return F.scaled_dot_product_attention(query, key, value, scale=scale)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")  # [..., Tq, Tk]
    has_key = allowed.any(dim=-1, keepdim=True)  # [..., Tq, 1]
    attn_mask = attn_mask | ~has_key if attn_mask.dtype == torch.bool else attn_mask.masked_fill(~has_key, 0.0)
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)
    return out * has_key


@buggy("scale-argument", mistake="scale-argument-ignored", bug="the scale argument is ignored", convention="sdpa")
def ignores_scale_argument(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, is_causal=is_causal)


@buggy("scale-argument",
       mistake="scale-argument-sqrt-split", bug="sqrt(scale) applied to Q and K separately (breaks negative scales)", convention="sdpa")
def split_sqrt_scale(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    s = math.sqrt(scale if scale is not None else 1 / math.sqrt(query.size(-1)))  # NaN... raises for scale < 0
    return F.scaled_dot_product_attention(query * s, key * s, value, attn_mask=attn_mask, is_causal=is_causal, scale=1.0)


@buggy("is-causal", mistake="is-causal-ignored", bug="is_causal is ignored", convention="sdpa")
def ignores_is_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)


@buggy("is-causal",
       mistake="is-causal-diagonal-masked", bug="is_causal masks the diagonal too (triu diagonal=0)", convention="sdpa")
def is_causal_off_by_one(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    if is_causal:
        attn_mask = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril(-1)
        attn_mask[..., 0] = True  # keep row 0 alive
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, scale=scale)


# ---------------------------------------------------------------- the torch-mha convention

correct("torch-mha")(torch.nn.MultiheadAttention)
correct("torch-mha", name="MultiheadAttention_instance_batch_first")(torch.nn.MultiheadAttention(8, 2, batch_first=True))
