"""Serving kernels (the decode convention): correct ones that must conform, and the classic kernel bugs, each
caught by the properties made for it and named by one root (attn_spec.diagnosis.serving)."""
import math
from pathlib import Path

import torch

from attn_spec.targets.loading import load_target
from gallery import buggy, correct

KERNELS = Path(__file__).resolve().parents[2] / "examples" / "serving_kernels.py"


def _decode(q, k_cache, v_cache, k, v, cache_seqlens, *, causal, attended=None, write_at=None, top_left=False):
    """A decode kernel with one thing changeable: the rows attended ([0, end) by default, end = seqlens + S),
    where the new rows are written, and the causal alignment."""
    B, S, H, D = q.shape
    out = torch.zeros_like(q)
    for b in range(B):
        start = int(cache_seqlens[b]) if write_at is None else write_at(int(cache_seqlens[b]))
        if k is not None:
            k_cache[b, start:start + S], v_cache[b, start:start + S] = k[b], v[b]
        end = int(cache_seqlens[b]) + (S if k is not None else 0)
        end = end if attended is None else attended(end, k_cache.shape[1])
        keys, values = k_cache[b, :end].transpose(0, 1), v_cache[b, :end].transpose(0, 1)  # [H, L, D]
        scores = q[b].transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(D)  # [H, S, L]
        if causal:
            offset = 0 if top_left else end - S
            scores = scores.masked_fill(torch.arange(end)[None, :] > torch.arange(S)[:, None] + offset, -math.inf)
        out[b] = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)  # [S, H, D]
    return out


correct("decode", name="decode_reference_kernel")(load_target(f"{KERNELS}:decode_kernel"))
correct("decode", name="sdpa_causal_lower_right_decode")(load_target(f"{KERNELS}:sdpa_decode"))


@buggy("decode-equals-full-causal", bug="SDPA's is_causal (top-left) used for decoding", mistake="decode-causal-top-left",
       convention="decode")
def decode_top_left(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    return _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, top_left=True)


@buggy("cache-outside-invariance", "decode-equals-full-causal", bug="attends every cache row (cache_seqlens ignored)",
       mistake="cache-tail-read", convention="decode")
def decode_tail_read(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    return _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, attended=lambda end, size: size)


@buggy("append-writes-exactly", "cache-outside-invariance", "decode-equals-full-causal", bug="appends one row late and attends one row further",
       mistake="cache-append-off-by-one", convention="decode")
def decode_append_off_by_one(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
    return _decode(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, write_at=lambda start: start + 1,
                   attended=lambda end, size: end + 1 if k is not None else end)


correct("merge", name="merge_state_reference")(load_target(f"{KERNELS}:merge_state"))
correct("merge", name="merge_state_base2")(load_target(f"{KERNELS}:merge_state_base2"))


@buggy("merge-empty-neutral", bug="max-subtraction without a guard: two empty states give NaN (FlashInfer #4051)",
       mistake="merge-empty-nan", convention="merge")
def merge_nan_on_empty(v_a, s_a, v_b, s_b):
    m = torch.maximum(s_a, s_b)  # [T, H]
    w_a, w_b = torch.exp(s_a - m), torch.exp(s_b - m)  # NaN where both are -inf
    d = w_a + w_b
    return (w_a[..., None] * v_a + w_b[..., None] * v_b) / d[..., None], m + torch.log(d)


@buggy("merge-equals-union", bug="the merged LSE is the max of the two, the log of the rescaled sum forgotten",
       mistake="merge-lse-max", convention="merge")
def merge_lse_is_max(v_a, s_a, v_b, s_b):
    s = torch.logaddexp(s_a, s_b)
    safe = torch.where(torch.isneginf(s), 0.0, s)
    w_a, w_b = torch.exp(s_a - safe)[..., None], torch.exp(s_b - safe)[..., None]
    return (w_a * v_a + w_b * v_b).to(v_a.dtype), torch.maximum(s_a, s_b)


correct("decode", name="cpu_flash_op_decode")(load_target(f"{KERNELS}:flash_cpu_decode"))
