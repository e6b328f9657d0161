"""The stand-in for the attention layer a Hugging Face attention function is called with (the ``hf`` convention).

Hugging Face calls ``fn(module, query, key, value, attention_mask, ...)`` with ``module`` the model's attention
layer, and functions read what they need from it. The stand-in offers what HF attention layers commonly carry
(transformers 5.x: ``LlamaAttention``, ``GptOssAttention``, ``Gemma2Attention``, ...):

- ``num_key_value_groups`` (H // H_kv), ``num_heads``, ``num_key_value_heads``, ``head_dim``, ``scaling``,
  ``is_causal``, ``attention_dropout`` (0.0), ``layer_idx`` (0), ``sliding_window`` and ``training`` (False);
- ``sinks``: one learned logit per query head (GPT-OSS, DeepSeek-V4, Granite-SWA, ...), all ``-inf``: a sink
  of -inf adds exp(-inf) = 0 to the softmax's denominator (the concatenated-logit form) and scales the output
  by sigmoid(lse + inf) = 1 (the LSE form), so it has no effect;
- ``config``: ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``hidden_size``,
  ``attention_dropout``, ``sliding_window``, ``_attn_implementation`` ("eager") and ``dtype``.

Anything else a function reads raises :class:`MissingAttribute` (an AttributeError, so ``getattr(module, name,
None)`` still works): a limitation of the kit, not a bug of the function, which the user lifts with
``--hf-module-attr NAME=VALUE`` (``config.NAME=VALUE`` for the config) or by wrapping the function in one that
sets what it needs on ``module`` first.
"""
from __future__ import annotations

import ast
import json
import math
from types import SimpleNamespace

import torch

from attn_spec.errors import KitUsageError

SPECIAL = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


class MissingAttribute(AttributeError):
    """The function read an attribute the stand-in does not offer; ``path``: ``module.NAME`` or ``module.config.NAME``."""

    def __init__(self, path: str):
        super().__init__(f"the stand-in module has no attribute {path.split('.')[-1]!r} ({path})")
        self.path = path


class HfConfig(SimpleNamespace):
    """``module.config``: the fields HF attention code reads; any other raises MissingAttribute."""

    def __getattr__(self, name):
        raise MissingAttribute(f"module.config.{name}")


class HfModule(torch.nn.Module):
    """What an HF attention layer offers the function it calls (eval mode, no parameters).

    ``extra``: ``{"NAME": value, "config.NAME": value}`` from ``--hf-module-attr`` and ``--hf-config``; the
    config's shape fields, window and dtype always follow the case (the kit draws its own head counts)."""

    def __init__(self, n_heads, n_kv_heads, head_dim, *, is_causal, scaling, dtype=torch.float32, device="cpu",
                 window=None, extra=None):
        super().__init__()
        self.num_key_value_groups, self.is_causal, self.scaling = n_heads // n_kv_heads, is_causal, scaling
        self.num_heads, self.num_key_value_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.layer_idx, self.attention_dropout, self.sliding_window = 0, 0.0, window
        self.sinks = torch.full((n_heads,), -math.inf, dtype=dtype, device=device)  # [H]: no effect (module doc)
        config = {"attention_dropout": 0.0, "_attn_implementation": "eager"}
        for key, value in (extra or {}).items():
            if key.startswith("config."):
                config[key[len("config."):]] = value
            else:
                setattr(self, key, value)
        config.update(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
                      hidden_size=n_heads * head_dim, sliding_window=window, dtype=dtype)
        self.config = HfConfig(**config)
        self.eval()

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)  # parameters, buffers, submodules
        except AttributeError:
            raise MissingAttribute(f"module.{name}") from None


def parse_module_attrs(items) -> dict:
    """``["sinks_enabled=False", "config.rope_theta=10000.0"]`` -> ``{"sinks_enabled": False, ...}``: each value a
    Python literal (a number, string, bool, None, tuple or list; also inf, -inf, nan). A usage error otherwise."""
    attrs = {}
    for item in items or ():
        name, sep, raw = str(item).partition("=")
        if not sep or not all(part.isidentifier() for part in name.split(".")) or name.count(".") > 1 or (
                "." in name and not name.startswith("config.")):
            raise KitUsageError(f"{item!r}: expected NAME=VALUE or config.NAME=VALUE (e.g. --hf-module-attr "
                                f"config.rope_theta=10000.0)")
        try:
            attrs[name] = SPECIAL[raw.strip()] if raw.strip() in SPECIAL else ast.literal_eval(raw.strip())
        except (ValueError, SyntaxError):
            raise KitUsageError(f"{item!r}: {raw!r} is not a Python literal (a number, string in quotes, True, "
                                f"False, None, a tuple or a list); a tensor needs a wrapper function that sets "
                                f"it on module") from None
    return attrs


def read_config(path) -> dict:
    """A model's config.json (as ``save_pretrained`` writes it) -> its fields; a usage error if unreadable."""
    try:
        with open(path, encoding="utf-8") as handle:
            fields = json.load(handle)
    except (OSError, ValueError) as exc:
        raise KitUsageError(f"cannot read the Hugging Face config {path}: {exc}") from None
    if not isinstance(fields, dict):
        raise KitUsageError(f"{path} is not a Hugging Face config (a JSON object of fields)")
    return fields


def config_groups(fields: dict) -> tuple[int, int] | None:
    """(num_attention_heads, num_key_value_heads) when the config says grouped-query attention, else None."""
    heads, kv_heads = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv_heads, int) and 0 < kv_heads < heads:
        return heads, kv_heads
    return None
