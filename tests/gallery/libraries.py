"""Real-library-style attentions, wrapped the way users wrap them: they must conform, all in one check.

torch's SDPA (default and math backends), ``nn.MultiheadAttention``, Hugging Face's ViT attention
(``examples/hf_vit_adapter.py``, when transformers is installed: :func:`hugging_face_vit`), nanoGPT's causal self-attention
through a ModuleAdapter, GQA in the tile grouping, and student code that reads its mask as bool
(``masked_fill(mask.logical_not(), ...)``, ``masked_fill(mask == 0, ...)``): each behaves as its
library does, and each was once falsely accused. Plus nanoGPT with an inverted causal mask, a bug.
"""
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from attn_spec.module_adapters import ModuleAdapter
from gallery import buggy, correct, library
from gallery.masking import mask_eq_zero_idiom
from gallery.robustness import gqa_tile_grouped

library("sdpa", "sdpa_default")(F.scaled_dot_product_attention)
library("torch-mha", "nn.MultiheadAttention")(torch.nn.MultiheadAttention)
library(name="gqa_tile_grouped")(gqa_tile_grouped)
library(name="mask_eq_zero_idiom")(mask_eq_zero_idiom)


@library("sdpa")
def sdpa_math(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA pinned to its math backend (the one PyTorch's own tests compare the fused kernels with)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                                              is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)


@library()
def einsum_bool_mask(Q, K, V, mask=None):
    """A student's einsum attention that reads the mask as bool (logical_not), as the function convention promises."""
    s = torch.einsum("...qd,...kd->...qk", Q, K) / math.sqrt(Q.shape[-1])  # [..., Tq, Tk]
    if mask is not None:
        s = s.masked_fill(mask.logical_not(), float("-inf"))
    return torch.einsum("...qk,...kd->...qd", s.softmax(dim=-1), V)  # [..., Tq, Dv]


class CausalSelfAttention(torch.nn.Module):
    """nanoGPT's (model.py, its manual path): packed c_attn, heads by view + transpose, a causal buffer."""

    def __init__(self, n_embd, n_head, block_size=1024):
        super().__init__()
        self.c_attn = torch.nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = torch.nn.Linear(n_embd, n_embd, bias=False)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def hide_future(self, att, T):
        return att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # [B, H, T, hs]
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = F.softmax(self.hide_future(att, T), dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)  # [B, T, C]
        return self.c_proj(y)


class NanoGPTAdapter(ModuleAdapter):
    """Causal self-attention with its own mask: it declines every call but a causal one, and the kit
    draws causal self-attention cases for it."""

    self_attention_only = True
    module = CausalSelfAttention

    def build(self, d_model, n_heads):
        return self.module(d_model, n_heads)

    def load(self, module, W_Q, W_K, W_V, W_O):
        module.c_attn.weight.copy_(torch.cat([W_Q, W_K, W_V]))  # [3D, D]
        module.c_proj.weight.copy_(W_O)

    def forward(self, module, x_q, x_kv, mask):
        n = x_q.shape[0]
        if mask is None or not torch.equal(mask, torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()):
            raise NotImplementedError("causal self-attention only: the module applies its own causal mask")
        if n > module.bias.shape[-1]:
            raise NotImplementedError(f"sequences up to block_size={module.bias.shape[-1]}")
        return module(x_q[None])[0]  # [T, D]


correct("adapter", "nanogpt_causal_self_attention")(NanoGPTAdapter)
library("adapter", "nanogpt_causal_self_attention")(NanoGPTAdapter)


class InvertedCausalSelfAttention(CausalSelfAttention):
    def hide_future(self, att, T):
        return att.masked_fill(self.bias[:, :, :T, :T] == 1, float("-inf"))  # BUG: hides the past, keeps the future


@buggy("matches-reference", mistake="mask-inverted", bug="nanoGPT-style causal module whose built-in mask is inverted",
       convention="adapter")
class NanoGPTInvertedMask(NanoGPTAdapter):
    module = InvertedCausalSelfAttention


def hugging_face_vit():
    """Hugging Face's ViT attention through the README's adapter (None without transformers, a test extra).
    Loaded on demand: importing transformers takes seconds."""
    from attn_spec.targets.loading import load_target

    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    return load_target(f"{Path(__file__).resolve().parents[2] / 'examples' / 'hf_vit_adapter.py'}:ViTAdapter")
