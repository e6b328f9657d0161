"""A custom attention function for Hugging Face models, registered with AttentionInterface (needs transformers).

    model = AutoModelForCausalLM.from_pretrained(model_id, attn_implementation="my_attention")

and checked as Hugging Face calls it: ``attn-spec check examples/hf_attention.py:my_attention``.
"""
import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask


def my_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query [B, H, S_q, D], key/value [B, H_kv, S_kv, D]; returns ([B, S_q, H, D_v], weights)."""
    groups = module.num_key_value_groups  # grouped-query attention: H = groups * H_kv
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = query @ key.transpose(2, 3) * (query.shape[-1] ** -0.5 if scaling is None else scaling)  # [B, H, S_q, S_kv]
    if attention_mask is None and module.is_causal and query.shape[2] > 1:  # sdpa_mask left causality to is_causal
        n_q, n_kv = scores.shape[-2:]
        attention_mask = torch.ones(n_q, n_kv, dtype=torch.bool, device=query.device).tril(n_kv - n_q)
    if attention_mask is not None:  # bool, True = attend (sdpa_mask's form, registered below)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
    half = scores.dtype in (torch.float16, torch.bfloat16)
    weights = torch.softmax(scores.float() if half else scores, dim=-1).to(query.dtype)  # half precision: in float32
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


AttentionInterface.register("my_attention", my_attention)
AttentionMaskInterface.register("my_attention", sdpa_mask)  # the model builds bool masks for it, as for sdpa
