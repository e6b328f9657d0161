"""The ``hf`` convention: an attention function as Hugging Face transformers models call it.

    attn_output, attn_weights = fn(module, query, key, value, attention_mask, dropout=0.0, scaling=s, **kwargs)

pinned on transformers 5.x (``integrations/sdpa_attention.py``, ``eager_attention_forward`` in each model,
``masking_utils.py``):

- query [B, H, S_q, D], key and value [B, H_kv, S_kv, D] (views transposed from [B, S, H, D]); the output
  is [B, S_q, H, D_v], with the weights [B, H, S_q, S_kv] or None;
- ``module`` is the attention layer (a stand-in: hf_module.py): ``num_key_value_groups = H // H_kv``,
  ``is_causal``, ``head_dim``, ``scaling``, ``training`` (False: eval), ``sinks`` (no effect), ``config``, ...;
- grouped-query attention (H_kv < H) is probed: MHA-only models (BERT, CLIP, GPT-NeoX) never call their
  function so, and one that raises there lacks ``gqa``; it is required with ``--require gqa`` or a config
  (``--hf-config``) of num_key_value_heads < num_attention_heads. Where it runs, the grouping is HF's own
  ``repeat_kv``: query head h reads KV head h // g (a function that tiles, h % H_kv, is wrong for every
  GQA checkpoint);
- a call without a mask is probed too (``unmasked``): a function that raises on attention_mask=None lacks it;
- ``scaling`` is always passed (the model's head_dim ** -0.5 unless it has its own), ``dropout`` is 0.0 in eval;
- the mask is what the model builds for the function's implementation (``AttentionMaskInterface``):
  ``eager_mask``: float [B, 1, S_q, S_kv], 0 where a key may be attended and finfo(dtype).min elsewhere;
  ``sdpa_mask``: bool [B, 1, S_q, S_kv] (True = attend), or None when ``module.is_causal`` says it all
  (no padding, and S_q == 1 or S_q == S_kv); an implementation registered without a mask function gets
  attention_mask=None (causality only through ``module.is_causal``). Causal masks are aligned bottom-right:
  with a cache the queries are the last positions;
- a sliding window reaches the function both in the mask and as ``sliding_window=w`` (what
  flash-attention implementations read); logit soft-capping only as ``softcap=c``, to functions that
  declare that parameter (Gemma 2's eager does; ``sdpa_attention_forward`` raises on it).

The mask form comes from transformers' registries: a function registered with ``AttentionInterface`` under a
name whose ``AttentionMaskInterface`` entry is ``sdpa_mask`` gets bool masks, ``eager_mask`` float masks, any
other name none; an unregistered function (a model's ``eager_attention_forward``, yours before you register
it) is called as the eager path calls it. Hugging Face runs attention in the model's dtype and its eager path
computes the softmax in float32, so float64 is checked only when asked for (``--dtypes float64``).
"""
from __future__ import annotations

import sys

import torch

from attn_spec import reference
from attn_spec.failures import fail
from attn_spec.errors import TargetRaised, Unsupported
from attn_spec.targets.base import MASK_FORMS, Target, _call, parameter_names, returned
from attn_spec.targets.hf_module import HfModule, MissingAttribute, config_groups, parse_module_attrs, read_config
from attn_spec.vocabulary import Traits
from attn_spec.targets.layouts import Heads

HF_PARAMETERS = ["module", "query", "key", "value"]


def _registries():
    """transformers' (AttentionInterface, AttentionMaskInterface, sdpa_mask, eager_mask), or None when it is not
    installed. Imported only when the target comes from transformers or the user's code imported them."""
    try:
        from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
        from transformers.modeling_utils import AttentionInterface
    except Exception:  # noqa: BLE001 - not installed, or an incompatible version: no registry to read
        return None
    return AttentionInterface, AttentionMaskInterface, sdpa_mask, eager_mask


def _registered_names(fn) -> list[str]:
    loaded = "transformers.modeling_utils" in sys.modules  # where AttentionInterface lives: the user registered?
    if not (loaded or (getattr(fn, "__module__", "") or "").startswith("transformers")):
        return []
    found = _registries()
    return [] if found is None else [name for name, f in found[0]._global_mapping.items() if f is fn]


def mask_form(fn) -> tuple[str, str]:
    """("float" | "bool" | "none", why): the mask Hugging Face builds for ``fn``."""
    names = _registered_names(fn)
    if not names:
        return "float", ("not registered with AttentionInterface: called as the eager path calls it, with a float "
                         "mask [B, 1, S_q, S_kv] of 0 and finfo.min")
    _, masks, sdpa_mask, eager_mask = _registries()
    for name in names:
        builder = masks._global_mapping.get(name)
        if builder is sdpa_mask:
            return "bool", (f"registered as {name!r}, whose mask function is sdpa_mask: a bool mask [B, 1, S_q, S_kv], "
                            f"True = attend, or None when module.is_causal says it all")
        if builder is eager_mask:
            return "float", f"registered as {name!r}, whose mask function is eager_mask: a float mask of 0 and finfo.min"
    return "none", (f"registered as {names[0]!r} without an sdpa_mask or eager_mask mask function: Hugging Face passes "
                    f"attention_mask=None, causality only through module.is_causal")


class HfTarget(Target):
    """``hf_module_attr``: ``["NAME=VALUE", "config.NAME=VALUE"]``, offered on the stand-in module (hf_module.py);
    ``hf_config``: a model's config.json, whose fields join ``module.config`` and whose ``num_key_value_heads <
    num_attention_heads`` makes grouped-query attention a requirement (as ``--require gqa`` does)."""

    traits = Traits("hf", "fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)",
                    dtypes=("float32", "float16", "bfloat16"), options=("scale", "is-causal", "window", "softcap"),
                    layout="bhsd in, bshd out", keywords=("hf_module_attr", "hf_config"), detect_rank=43)
    gqa_grouping = "blocked"  # HF's repeat_kv: query head h reads KV head h // g, and checkpoints are trained so

    @staticmethod
    def detects(obj, names) -> bool:
        """Its parameters begin module, query, key, value, or it is registered with AttentionInterface."""
        return (names or [])[:4] == HF_PARAMETERS or bool(_registered_names(obj))

    def __init__(self, obj, name, masks=None, *, hf_module_attr=None, hf_config=None, **kwargs):
        super().__init__(obj, name, masks, **kwargs)
        self.form, self.form_why = mask_form(obj)
        if masks is None and self.form == "float":  # HF builds additive float masks for it: both forms are its contract
            self.masks = MASK_FORMS
        self.declares = set(parameter_names(obj) or ())
        self.attr_items, self.config_path = list(hf_module_attr or ()), hf_config
        fields = read_config(hf_config) if hf_config else {}
        self.config_gqa = config_groups(fields)
        self.extra = {**{f"config.{key}": value for key, value in fields.items()}, **parse_module_attrs(self.attr_items)}
        self.missing: dict[str, str] = {}  # module attribute the function read and the stand-in lacks -> how to supply it

    @property
    def gqa_contract(self) -> str:
        """Grouped-query attention is a requirement only when asked (``--require gqa``) or the model's config says
        num_key_value_heads < num_attention_heads: MHA-only models (BERT, CLIP, GPT-NeoX) never call their function
        with H_kv != H, so a function that raises there lacks gqa, it is not wrong."""
        return "module.num_key_value_groups" if "gqa" in self.required or self.config_gqa else ""

    @property
    def raising_declines(self) -> tuple[str, ...]:
        """A call without a mask that raises is a capability the function lacks (ModernBERT-decoder's adds the mask
        unconditionally: its model always builds one), and so is GQA unless required."""
        return ("unmasked",) + super().raising_declines

    def notes(self):
        if self.config_gqa:
            gqa = (f"grouped-query attention required: {self.config_path} has num_key_value_heads={self.config_gqa[1]} < "
                   f"num_attention_heads={self.config_gqa[0]}")
        else:
            gqa = ("grouped-query attention " + ("required (--require gqa)" if self.gqa_contract else
                                                 "probed (required with --require gqa or --hf-config)"))
        return [f"attention_mask: {self.form} ({self.form_why})",
                "dtypes: float32, float16, bfloat16 unless --dtypes names others (HF runs attention in the model's "
                "dtype; its eager path computes the softmax in float32)",
                f"{gqa}; grouping: HF's repeat_kv, query head h reads KV head h // g (gqa-grouping=blocked)",
                *self.missing.values()]

    def options(self):
        return {key: value for key, value in (("hf_module_attr", self.attr_items), ("hf_config", self.config_path))
                if value}

    def lacks_option(self, key):
        if key == "alibi":
            return f"{self.name}: Hugging Face passes ALiBi as part of the attention mask, not as slopes"
        if key == "dropout":  # HF applies it only while module.training; the kit's stand-in module is in eval
            return f"{self.name} is checked in eval mode (module.training is False), where Hugging Face drops nothing"
        if key == "softcap" and "softcap" not in self.declares:
            return f"{self.name} declares no softcap parameter (Hugging Face passes softcap=c to functions that take it)"
        if key == "window" and self.form == "none" and "sliding_window" not in self.declares:
            return f"{self.name} gets no mask and declares no sliding_window parameter"
        return None

    def _mask(self, mask, causal, window, n_q, n_kv, dtype, device):
        """The attention_mask HF would pass: the caller's mask combined with the causal (windowed) pattern."""
        if self.form == "none":
            if mask is not None:
                raise Unsupported(f"Hugging Face passes no attention_mask to {self.name} ({self.form_why})", total=True)
            return None
        if mask is not None and mask.dtype != torch.bool and self.form == "bool":
            raise Unsupported(f"{self.name} gets bool masks from Hugging Face (sdpa_mask), not float ones")
        if causal and mask is None and self.form == "bool" and (n_q == 1 or n_q == n_kv) and (window is None or n_kv < window):
            return None  # sdpa_mask leaves it to module.is_causal
        if not causal:
            return None if mask is None else self._form(mask, dtype)
        pattern = reference.causal_mask(n_q, n_kv, alignment="bottom-right", window=window, device=device)  # [Tq, Tk]
        if mask is None or mask.dtype == torch.bool:
            return self._form(pattern if mask is None else mask & pattern, dtype)
        return mask + self._form(pattern, dtype)

    def _form(self, mask, dtype):
        if self.form == "bool" or mask.dtype != torch.bool:
            return mask
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False, window=None, softcap=None):
        n_q, n_kv = q.shape[-2], k.shape[-2]
        causal = is_causal or window is not None
        if causal and n_q > n_kv:
            raise Unsupported("Hugging Face runs causal attention with at least as many keys as queries")
        given, mask = mask, self._mask(mask, causal, window, n_q, n_kv, q.dtype, q.device)
        h = Heads(q, k, v, None if mask is None else mask.expand(*mask.shape[:-2], n_q, n_kv))
        scaling = q.shape[-1] ** -0.5 if scale is None else scale
        module = HfModule(h.heads, h.kv_heads, q.shape[-1], is_causal=causal, scaling=scaling, dtype=q.dtype,
                          device=q.device, window=window, extra=self.extra)
        kwargs = {"dropout": 0.0, "scaling": scaling}
        if window is not None:
            kwargs["sliding_window"] = window
        if softcap is not None:
            kwargs["softcap"] = softcap
        self.calls += 1
        call = (f"{self.name}(module, query, key, value, {'None' if mask is None else 'attention_mask'}"
                f"{''.join(f', {key}={value!r}' for key, value in kwargs.items())})")
        seen = {"q": q, "k": k, "v": v, "mask": self._as_kit_mask(given, causal, window, n_q, n_kv, q.device),
                "scale": scaling, **({"softcap": softcap} if softcap is not None else {})}
        return self._observe("attend", seen, lambda: self._result(call, kwargs, module, h), call)

    def _as_kit_mask(self, given, causal, window, n_q, n_kv, device):
        """The mask the function applied, in the kit's terms (the diagnosis replays calls with it): the caller's
        mask with the causal (windowed) pattern folded in, whether HF passed it in the mask or as is_causal."""
        if not causal:
            return given
        pattern = reference.causal_mask(n_q, n_kv, alignment="bottom-right", window=window, device=device)
        if given is None or given.dtype == torch.bool:
            return pattern if given is None else given & pattern
        return given.masked_fill(~pattern, float("-inf"))

    def _result(self, call, kwargs, module, h):
        try:
            result = _call(lambda *a: self.obj(*a, **kwargs), (module, h.q, h.k, h.v, h.mask), call, self.state)
        except TargetRaised as exc:
            if isinstance(exc.exc, MissingAttribute):
                raise Unsupported(self._lacks_attribute(exc.exc.path), total=True) from None
            raise
        if not isinstance(result, tuple) or not result or not isinstance(result[0], torch.Tensor):
            fail(f"a {type(result).__name__}", what="the return value", expected="(attn_output, attn_weights)",
                 call=call, cause="an HF attention function returns a tuple: the output [B, S_q, H, D_v] and the "
                                  "weights or None")
        out, expected = result[0], h.bshd_shape()
        returned(out, call, {"query": h.q, "key": h.k, "value": h.v, "attention_mask": h.mask}, self.state)
        if tuple(out.shape) != expected:
            fail(f"{list(out.shape)}", what="attn_output's shape", expected=f"[B, S_q, H, D_v] = {list(expected)}",
                 call=call, cause="HF's attn_output is [B, S_q, H, D_v]: transpose(1, 2) the [B, H, S_q, D_v] result")
        return h.restore(out.transpose(1, 2))

    def _lacks_attribute(self, path: str) -> str:
        """A limitation of the kit, said once in the header: the function read what the stand-in does not offer."""
        name = path[len("module."):]
        self.missing[path] = (f"kit limitation: {self.name} reads {path}, which the stand-in module does not offer; "
                              f"supply it with --hf-module-attr {name}=VALUE (hf_module_attr=[...] in Python), or wrap "
                              f"the function in one that sets it on module")
        return f"the function reads {path}, which the stand-in module lacks (a kit limitation, see the header)"
