"""Checking a third-party module through a ModuleAdapter: Hugging Face's ViT attention.

    pip install transformers
    attn-spec check examples/hf_vit_adapter.py:ViTAdapter
"""
import torch
from transformers import ViTConfig
from transformers.models.vit.modeling_vit import ViTAttention

from attn_spec.module_adapters import ModuleAdapter


class ViTAdapter(ModuleAdapter):
    self_attention_only = True  # ViT attends over one sequence

    def build(self, d_model, n_heads):
        config = ViTConfig(hidden_size=d_model, num_attention_heads=n_heads, qkv_bias=False)
        config._attn_implementation = "sdpa"
        return ViTAttention(config)

    def load(self, module, W_Q, W_K, W_V, W_O):  # nn.Linear weights, y = x W^T
        for layer, w in ((module.q_proj, W_Q), (module.k_proj, W_K), (module.v_proj, W_V), (module.o_proj, W_O)):
            layer.weight.copy_(w)
            if layer.bias is not None:
                layer.bias.zero_()

    def forward(self, module, x_q, x_kv, mask):  # mask: bool [n_q, n_kv], True = may attend
        bias = None if mask is None else torch.zeros(mask.shape, dtype=x_q.dtype).masked_fill(~mask, -torch.inf)
        return module(x_q[None], attention_mask=None if bias is None else bias[None, None])[0][0]  # [n, d_model]
