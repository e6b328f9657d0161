"""What real code declares about itself: rows a causal mask leaves without keys ([B, S, H, D] kernels aligned
bottom-right, as flash-attn >= 2.1), a largest length (modules with a fixed position buffer), key-padding masks,
and finite fills that replace masked scores."""
import torch

from gallery import buggy, correct
from gallery.libraries import CausalSelfAttention, NanoGPTAdapter


def _flash(q, k, v, softmax_scale, causal, *, empty="zeros", diagonal=True):
    """flash-attn's layout and causal alignment: q [B, S_q, H, D], k and v [B, S_kv, H, D]; the last query sees the
    last key. ``empty``: what a query without keys gives (flash-attn: zeros); ``diagonal=False``: the bug."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = q @ k.transpose(-2, -1) * scale  # [B, H, S_q, S_kv]
    n_q, n_kv = scores.shape[-2:]
    if causal:
        i = torch.arange(n_q, device=q.device)[:, None] + n_kv - n_q  # [S_q, 1] bottom-right
        j = torch.arange(n_kv, device=q.device)[None, :]  # [1, S_kv]
        scores = scores.masked_fill(~((j <= i) if diagonal else (j < i)), float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # a row without keys: softmax(-inf, ..., -inf) = NaN
    if empty == "zeros":
        weights = weights.nan_to_num(0.0)
    return (weights @ v).transpose(1, 2)  # [B, S_q, H, D_v]


# ---------------------------------------------------------------- rows without keys (bottom-right causal)


@correct("sdpa")
def flash_empty_rows_zeros(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """flash-attn's own choice: a query that may attend no key gives a zero row."""
    return _flash(q, k, v, softmax_scale, causal, empty="zeros")


@correct("sdpa")
def flash_empty_rows_nan(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """softmax over no key left as NaN: fully-masked=nan, a convention like zeros."""
    return _flash(q, k, v, softmax_scale, causal, empty="nan")


@buggy("is-causal", convention="sdpa", mistake="is-causal-diagonal-masked",
       bug="a bottom-right causal [B, S, H, D] kernel with j < i for j <= i: no query sees its own key")
def flash_diagonal_masked(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    return _flash(q, k, v, softmax_scale, causal, empty="zeros", diagonal=False)


# ---------------------------------------------------------------- finite fills that replace masked scores


def _scores(Q, K):
    return Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5  # [..., Tq, Tk]


@buggy("mask-semantics", mistake="mask-fill-finite",
       bug="masked scores replaced by -1e4 (masked_fill(~mask, -1e4), as older Hugging Face models did): rows whose "
           "allowed scores are below -1e4 hand their weight to the masked keys")
def fill_replaces_minus_1e4(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, -1e4)
    return torch.softmax(scores, dim=-1) @ V


@correct()
def fill_replaces_finfo_min(Q, K, V, mask=None):
    """masked_fill(~mask, finfo(dtype).min): no allowed score lies below it, in any dtype."""
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ V


@correct()
def d2l_masked_softmax(Q, K, V, mask=None):
    """d2l.ai's masked_softmax: masked scores replaced by -1e6 (X[~mask] = -1e6). No score attention reaches lies
    below it (finite-fill=exact below 1e6), and float16 stores it as -inf."""
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.clone()
        scores[~mask.expand(scores.shape)] = -1e6
    return torch.softmax(scores, dim=-1) @ V


@correct()
def fill_replaces_minus_inf(Q, K, V, mask=None):
    """masked_fill(~mask, -inf): the textbook fill."""
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


# ---------------------------------------------------------------- a fixed position buffer: a largest length


class _BufferedCausalAdapter(NanoGPTAdapter):
    """nanoGPT's causal self-attention with a ``bias`` buffer of ``block_size`` positions, called as published:
    beyond block_size it crashes at its own shape check (the size of tensor a must match the size of tensor b)."""

    block_size = 1024

    def build(self, d_model, n_heads):
        return CausalSelfAttention(d_model, n_heads, block_size=self.block_size)

    def forward(self, module, x_q, x_kv, mask):
        n = x_q.shape[0]
        if mask is None or not torch.equal(mask, torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()):
            raise NotImplementedError("causal self-attention only: the module applies its own causal mask")
        return module(x_q[None])[0]  # [T, D]


class BlockSize1024(_BufferedCausalAdapter):
    block_size = 1024


class BlockSize256(_BufferedCausalAdapter):
    block_size = 256


correct("adapter", "block_size_1024")(BlockSize1024)
correct("adapter", "block_size_256")(BlockSize256)


# ---------------------------------------------------------------- key-padding masks: every query row the same


def _key_padding(mask):
    """An encoder's padding mask: which keys exist, the same for every query ([..., 1, n_kv]); others declined."""
    if mask.shape[-2] != 1:
        raise NotImplementedError("key-padding masks only: [..., 1, n_kv], the same for every query")
    return mask


@correct()
def key_padding_only(Q, K, V, mask=None):
    """Takes key-padding masks alone: the kit probes them and checks its masked path with them."""
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~_key_padding(mask), float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


@buggy("mask-semantics", mistake="mask-inverted",
       bug="a key-padding-only attention that masks the keys that exist (masked_fill(mask, -inf))")
def key_padding_inverted(Q, K, V, mask=None):
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(_key_padding(mask), float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


@correct("module")
class KeyPaddingMultiHead(torch.nn.Module):
    """An encoder layer whose mask says which keys exist ([..., 1, n_kv], as BERT's padding mask): others declined."""

    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def forward(self, x_q, x_kv, mask=None):
        def split(t):  # [n, d_model] -> [h, n, d_k]
            return t.view(t.size(0), self.h, self.d_k).transpose(0, 1)
        out = key_padding_only(split(self.W_Q(x_q)), split(self.W_K(x_kv)), split(self.W_V(x_kv)), mask)  # [h, n, d_k]
        return self.W_O(out.transpose(0, 1).reshape(x_q.size(0), -1))  # [n, d_model]


@buggy("mask-semantics", mistake="mask-inverted", convention="module",
       bug="a key-padding-only encoder layer that masks the keys that exist (masked_fill(mask, -inf))")
class KeyPaddingMultiHeadInverted(KeyPaddingMultiHead):
    def forward(self, x_q, x_kv, mask=None):
        def split(t):  # [n, d_model] -> [h, n, d_k]
            return t.view(t.size(0), self.h, self.d_k).transpose(0, 1)
        out = key_padding_inverted(split(self.W_Q(x_q)), split(self.W_K(x_kv)), split(self.W_V(x_kv)), mask)
        return self.W_O(out.transpose(0, 1).reshape(x_q.size(0), -1))  # [n, d_model]
