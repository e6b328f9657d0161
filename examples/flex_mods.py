"""FlexAttention mask_mods and score_mods, each checked against what it claims to compute:

    attn-spec check examples/flex_mods.py:sliding_window_mask --expect-mask sliding-window:4
    attn-spec check examples/flex_mods.py:document_mask --expect-mask causal+document:0,0,0,1,1,2
    attn-spec check examples/flex_mods.py:off_by_one_window --expect-mask sliding-window:4   # fails: 5 keys
    attn-spec check examples/flex_mods.py:tanh_softcap --expect-score softcap:50
    attn-spec check examples/flex_mods.py:alibi --expect-score alibi
"""
import torch

WINDOW = 4


def sliding_window_mask(b, h, q_idx, kv_idx):
    """The last WINDOW keys, the query's own included."""
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def off_by_one_window(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= WINDOW)  # WINDOW + 1 keys


DOCUMENT_IDS = torch.tensor([0, 0, 0, 1, 1, 2])  # three packed documents


def document_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (DOCUMENT_IDS[q_idx] == DOCUMENT_IDS[kv_idx])


def tanh_softcap(score, b, h, q_idx, kv_idx):
    return 50.0 * torch.tanh(score / 50.0)


SLOPES = torch.exp2(-8.0 * torch.arange(1, 9) / 8)  # ALiBi's slopes for 8 heads


def alibi(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)
