"""An attention kernel in flash-attn's layout and signature: [B, S, H, D] in and out.

    attn-spec check examples/flash_kernel.py:attention      # the layout is detected from the parameter names
"""
import torch


def attention(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0):
    """q [B, S_q, H, D], k and v [B, S_kv, H_kv, D]; causal and windows aligned bottom-right, like flash-attn."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, S, D]
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))  # grouped-query heads
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = q @ k.transpose(-2, -1) * scale  # [B, H, S_q, S_kv]
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    n_q, n_kv = scores.shape[-2:]
    i = torch.arange(n_q, device=q.device)[:, None] + n_kv - n_q  # the last query sees the last key
    j = torch.arange(n_kv, device=q.device)[None, :]
    keep = torch.ones(n_q, n_kv, dtype=torch.bool, device=q.device)
    if causal:
        keep &= j <= i
    if window_size[0] >= 0:
        keep &= j >= i - window_size[0]
    if window_size[1] >= 0:
        keep &= j <= i + window_size[1]
    weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1).nan_to_num(0.0)  # empty rows: 0
    return (weights @ v).transpose(1, 2)  # [B, S_q, H, D_v]
