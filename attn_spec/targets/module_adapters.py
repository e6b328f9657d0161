"""How to build, load and call a multi-head module: one small adapter class per module family.

To check a module the kit does not know, write a ``ModuleAdapter`` in a few lines: how to
build it for ``(d_model, n_heads)``, how to load four projection weights into it, and how to
call it. Then ``attn-spec check my_adapters.py:MyAdapter`` (an adapter class or instance is
detected as the ``adapter`` convention). Weights follow ``nn.Linear``: y = x W^T, each [D, D].
Masks arrive as bool [n_q, n_kv] with True = may attend, or None (and, when the user declares
additive masks with ``--masks bool,additive``, also as float masks to add to the scaled scores).
To decline an input the module cannot take (a mask it does not apply, a shape it does not
handle), raise ``NotImplementedError`` (or ``attn_spec.Unsupported``) from ``forward``.
"""
from __future__ import annotations

import torch


class ModuleAdapter:
    """Override ``build``, ``load`` and ``forward``; set ``self_attention_only`` if forward takes one input."""

    name = "adapter"
    self_attention_only = False  # True: forward(x) only; the kit then never asks for cross-attention

    def build(self, d_model: int, n_heads: int) -> torch.nn.Module:
        raise NotImplementedError

    def load(self, module, W_Q, W_K, W_V, W_O) -> None:
        raise NotImplementedError

    def forward(self, module, x_q, x_kv, mask):
        raise NotImplementedError


def _linear_weight(module, name, d_model):
    w = getattr(getattr(module, name, None), "weight", None)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (d_model, d_model):
        raise AttributeError(f"{name} is not an nn.Linear({d_model}, {d_model})")
    return getattr(module, name)


class SeedAdapter(ModuleAdapter):
    """The seed's convention: ``Cls(d_model, n_heads)`` with W_Q, W_K, W_V, W_O and forward(x_q, x_kv, mask)."""

    def __init__(self, cls):
        self.cls, self.name = cls, getattr(cls, "__name__", "module")

    def build(self, d_model, n_heads):
        return self.cls(d_model, n_heads)

    def load(self, module, W_Q, W_K, W_V, W_O):
        d_model = W_Q.shape[0]
        for name, w in zip(("W_Q", "W_K", "W_V", "W_O"), (W_Q, W_K, W_V, W_O)):
            layer = _linear_weight(module, name, d_model)
            layer.weight.copy_(w)
            if getattr(layer, "bias", None) is not None:
                layer.bias.zero_()

    def forward(self, module, x_q, x_kv, mask):
        return module(x_q, x_kv) if mask is None else module(x_q, x_kv, mask)


class TorchMhaAdapter(ModuleAdapter):
    """``torch.nn.MultiheadAttention``: packed ``in_proj_weight``, ``out_proj``, bool masks with True = *ignore*
    (float masks are additive, as in SDPA).

    ``factory(d_model, n_heads)`` builds an instance (the class itself, a function, or a copy of
    a given instance's settings). A mask whose rows are all equal goes in as ``key_padding_mask``,
    any other as ``attn_mask``, so both of MHA's mask paths are exercised.
    """

    def __init__(self, factory, batch_first=None, name="MultiheadAttention"):
        self.factory, self.batch_first, self.name = factory, batch_first, name

    @classmethod
    def from_instance(cls, mha: torch.nn.MultiheadAttention, name: str):
        def factory(d_model, n_heads):
            return type(mha)(d_model, n_heads, bias=mha.in_proj_bias is not None, batch_first=mha.batch_first)
        return cls(factory, mha.batch_first, name)

    def build(self, d_model, n_heads):
        return self.factory(d_model, n_heads)

    def load(self, module, W_Q, W_K, W_V, W_O):
        module.in_proj_weight.copy_(torch.cat([W_Q, W_K, W_V]))  # [3D, D]
        module.out_proj.weight.copy_(W_O)
        for bias in (module.in_proj_bias, module.out_proj.bias):
            if bias is not None:
                bias.zero_()

    def forward(self, module, x_q, x_kv, mask):
        batch_first = module.batch_first if self.batch_first is None else self.batch_first
        dim = 0 if batch_first else 1
        q, kv = x_q.unsqueeze(dim), x_kv.unsqueeze(dim)  # [1, T, D] or [T, 1, D]
        kwargs = {"need_weights": False}
        if mask is not None and mask.dtype != torch.bool:
            kwargs["attn_mask"] = mask  # [Tq, Tk] additive float mask: MHA adds it to the scores as is
        elif mask is not None:
            if bool((mask == mask[:1]).all()):
                kwargs["key_padding_mask"] = ~mask[:1]  # [1, Tk], True = ignore
            else:
                kwargs["attn_mask"] = ~mask  # [Tq, Tk], True = ignore
        out, _ = module(q, kv, kv, **kwargs)
        return out.squeeze(dim)  # [Tq, D]
