"""Correct variants and classic bugs of the ecosystem's conventions: Hugging Face attention functions (hf),
[B, S, H, D] kernels (bshd), FlexAttention (flex) and its mask_mods and score_mods, sliding windows, softcap.

The correct flash-style kernel, a registered HF function, HF's own functions and flex_attention itself are
checked in tests/test_ecosystem.py (examples/flash_kernel.py, examples/hf_attention.py)."""
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from gallery import buggy, correct

NEG_INF = float("-inf")
GQA_CONFIG = str(Path(__file__).with_name("gqa_config.json"))  # a Llama-style config: 32 heads over 8 KV heads


def _repeat_kv(t, groups):  # [B, Hkv, S, D] -> [B, Hkv * groups, S, D], as transformers' repeat_kv
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _gemma_eager(module, query, key, value, attention_mask, scaling=None, softcap=None, *, cap_after_mask=False,
                 cap_factor=True):
    """Gemma 2's eager_attention_forward (softmax in float32), with two classic softcap bugs as switches."""
    scaling = module.head_dim ** -0.5 if scaling is None else scaling
    key, value = (_repeat_kv(t, module.num_key_value_groups) for t in (key, value))
    scores = query @ key.transpose(2, 3) * scaling  # [B, H, Sq, Skv]
    if attention_mask is not None and cap_after_mask:
        scores = scores + attention_mask
    if softcap is not None:
        scores = (softcap if cap_factor else 1.0) * torch.tanh(scores / softcap)
    if attention_mask is not None and not cap_after_mask:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights  # [B, Sq, H, Dv]


# ---------------------------------------------------------------- correct variants


@correct("hf")
def gemma_eager(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Gemma 2's eager attention: float mask added after the cap, GQA through num_key_value_groups."""
    return _gemma_eager(module, query, key, value, attention_mask, scaling, softcap)


@correct("hf")
def mha_only_eager(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """BERT's eager attention: no repeat_kv, so it raises on H_kv != H, which its models never have (lacks gqa)."""
    scores = query @ key.transpose(2, 3) * scaling  # [B, H, Sq, Skv]
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights  # [B, Sq, H, Dv]


@correct("mask-mod", expect_mask="causal")
def causal_mod(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


@correct("mask-mod", expect_mask="sliding-window:3")
def sliding_window_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < 3)


@correct("mask-mod", expect_mask="prefix-lm:2")
def prefix_lm_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) | (kv_idx < 2)


DOCUMENTS = torch.tensor([0, 0, 1, 1, 1, 2, 2])


@correct("mask-mod", expect_mask="causal+document:0,0,1,1,1,2,2")
def causal_document_mod(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (DOCUMENTS[q_idx] == DOCUMENTS[kv_idx])


@correct("score-mod", expect_score="softcap:30")
def softcap_mod(score, b, h, q_idx, kv_idx):
    return 30 * torch.tanh(score / 30)


SLOPES = torch.exp2(-8.0 * torch.arange(1, 9) / 8)  # 8 heads


@correct("score-mod", expect_score="alibi")
def alibi_mod(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (kv_idx - q_idx)


RELATIVE = torch.linspace(-1.0, 1.0, 64).reshape(1, 64).expand(4, 64) * torch.arange(1, 5)[:, None]  # [H, distance]


@correct("score-mod", expect_score="relative-bias")
def relative_bias_mod(score, b, h, q_idx, kv_idx):
    return score + RELATIVE[h, (kv_idx - q_idx).clamp(-31, 31) + 32]  # T5-style: distances beyond 31 share a bias


# ---------------------------------------------------------------- bugs


@buggy("sliding-window", bug="sliding window off by one: kv_idx >= q_idx - w keeps w + 1 keys", convention="sdpa",
       mistake="window-off-by-one")
def window_off_by_one(q, k, v, attn_mask=None, is_causal=False, sliding_window=None):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool)
    if is_causal or sliding_window is not None:
        keep &= j <= i
    if sliding_window is not None:
        keep &= j >= i - sliding_window  # bug: > was meant
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = keep & attn_mask
    elif attn_mask is not None:  # SDPA's additive float mask
        scores = scores + attn_mask
    return torch.softmax(scores.masked_fill(~keep, NEG_INF), dim=-1) @ v


@buggy("softcap", bug="softcap applied after the mask: masked scores become -cap", convention="hf",
       mistake="softcap-after-mask")
def softcap_after_mask(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    return _gemma_eager(module, query, key, value, attention_mask, scaling, softcap, cap_after_mask=True)


@buggy("softcap", bug="tanh without the cap factor: tanh(s / cap)", convention="hf", mistake="softcap-without-factor")
def softcap_without_factor(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None,
                           **kwargs):
    return _gemma_eager(module, query, key, value, attention_mask, scaling, softcap, cap_factor=False)


@buggy("matches-reference", bug="a [B, S, H, D] kernel that transposes H and S (reads its inputs as [B, H, S, D])",
       convention="sdpa", mistake="heads-sequence-transposed")
def bshd_transposes_heads(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    return F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal)  # bug: no transpose(1, 2)


@buggy("gqa-equivalence", bug="an HF function that ignores num_key_value_groups (K/V heads never repeated), for a "
       "model whose config has num_key_value_heads < num_attention_heads", convention="hf",
       mistake="gqa-kv-not-repeated", hf_config=GQA_CONFIG)
def ignores_kv_groups(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    scores = query @ key.transpose(2, 3) * scaling  # bug: repeat_kv(key, module.num_key_value_groups) is missing
    if attention_mask is not None:
        scores = scores + attention_mask
    return (torch.softmax(scores, dim=-1) @ value).transpose(1, 2).contiguous(), None


@buggy("gqa-equivalence", bug="an HF function that tiles K/V heads (query head h reads KV head h % H_kv), not "
       "repeat_kv's h // g", convention="hf", mistake="gqa-tiled")
def tiles_kv_heads(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    groups = module.num_key_value_groups
    key, value = key.repeat(1, groups, 1, 1), value.repeat(1, groups, 1, 1)  # bug: repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * scaling  # [B, H, Sq, Skv]
    if attention_mask is not None:
        scores = scores + attention_mask
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


@buggy("mask-mod-statement", "mask-mod-rows", bug="a causal mask_mod with < for <=: the diagonal is masked",
       convention="mask-mod", diagnosis="diagonal is masked", expect_mask="causal")
def strict_causal_mod(b, h, q_idx, kv_idx):
    return kv_idx < q_idx


@buggy("mask-mod-statement", bug="a sliding-window mask_mod of w + 1 keys (q_idx - kv_idx <= w)",
       convention="mask-mod", diagnosis="off by one", expect_mask="sliding-window:3")
def window_mod_off_by_one(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx <= 3)


@buggy("score-mod-statement", bug="a softcap score_mod without the cap factor: tanh(score / C)", convention="score-mod",
       diagnosis="without the cap factor", expect_score="softcap:30")
def softcap_mod_without_factor(score, b, h, q_idx, kv_idx):
    return torch.tanh(score / 30)


@buggy("score-mod-statement", bug="ALiBi with the sign flipped: m_h (q_idx - kv_idx)", convention="score-mod",
       diagnosis="wrong sign", expect_score="alibi")
def alibi_sign_flipped(score, b, h, q_idx, kv_idx):
    return score + SLOPES[h] * (q_idx - kv_idx)


@buggy("causal-mask", bug="a flex_attention wrapper that drops the block_mask", convention="flex",
       mistake="mask-ignored")
def flex_drops_block_mask(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False):
    from torch.nn.attention.flex_attention import flex_attention
    return flex_attention(query, key, value, score_mod=score_mod, scale=scale, enable_gqa=enable_gqa)
