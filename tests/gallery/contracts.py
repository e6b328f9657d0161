"""What real code declares about itself: rows a causal mask leaves without keys ([B, S, H, D] kernels aligned
bottom-right, as flash-attn >= 2.1), a largest length (modules with a fixed position buffer), key-padding masks,
and finite fills that replace masked scores."""
import torch

from gallery import buggy, correct


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
def fill_replaces_minus_inf(Q, K, V, mask=None):
    """masked_fill(~mask, -inf): the textbook fill."""
    scores = _scores(Q, K)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
