"""The ``hf`` convention: an attention function as Hugging Face transformers models call it.

    attn_output, attn_weights = fn(module, query, key, value, attention_mask, dropout=0.0, scaling=s, **kwargs)

pinned on transformers 5.x (``integrations/sdpa_attention.py``, ``eager_attention_forward`` in each model,
``masking_utils.py``):

- query [B, H, S_q, D], key and value [B, H_kv, S_kv, D] (views transposed from [B, S, H, D]); the output
  is [B, S_q, H, D_v], with the weights [B, H, S_q, S_kv] or None;
- ``module`` is the attention layer: ``num_key_value_groups = H // H_kv`` (grouped-query attention is
  part of the contract), ``is_causal``, ``head_dim``, ``scaling``, ``training`` (False: eval) and ``config``;
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
from types import SimpleNamespace

import torch

from attn_spec import reference
from attn_spec.checking.assertions import fail
from attn_spec.errors import Unsupported
from attn_spec.targets.base import MASK_FORMS, Target, _call, library_convention, parameter_names
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


class HfModule(torch.nn.Module):
    """What an HF attention layer offers the function it calls (eval mode, no parameters)."""

    def __init__(self, n_heads, n_kv_heads, head_dim, *, is_causal, scaling):
        super().__init__()
        self.num_key_value_groups, self.is_causal = n_heads // n_kv_heads, is_causal
        self.head_dim, self.scaling, self.layer_idx, self.attention_dropout = head_dim, scaling, 0, 0.0
        self.config = SimpleNamespace(num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=head_dim,
                                      attention_dropout=0.0)
        self.eval()


@library_convention
class HfTarget(Target):
    convention = "hf"
    default_dtypes = ("float32", "float16", "bfloat16")
    gqa_contract = "module.num_key_value_groups"

    @staticmethod
    def detects(obj, names) -> bool:
        """Its parameters begin module, query, key, value, or it is registered with AttentionInterface."""
        return (names or [])[:4] == HF_PARAMETERS or bool(_registered_names(obj))

    def __init__(self, obj, name, masks=None, **kwargs):
        super().__init__(obj, name, masks, **kwargs)
        self.form, self.form_why = mask_form(obj)
        if masks is None and self.form == "float":  # HF builds additive float masks for it: both forms are its contract
            self.masks = MASK_FORMS
        self.declares = set(parameter_names(obj) or ())

    def notes(self):
        return [f"attention_mask: {self.form} ({self.form_why})",
                "dtypes: float32, float16, bfloat16 unless --dtypes names others (HF runs attention in the model's "
                "dtype; its eager path computes the softmax in float32)"]

    def lacks_option(self, key):
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
        module = HfModule(h.heads, h.kv_heads, q.shape[-1], is_causal=causal, scaling=scaling)
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
        result = _call(lambda *a: self.obj(*a, **kwargs), (module, h.q, h.k, h.v, h.mask), call, self.state)
        if not isinstance(result, tuple) or not result or not isinstance(result[0], torch.Tensor):
            fail(f"a {type(result).__name__}", what="the return value", expected="(attn_output, attn_weights)",
                 call=call, cause="an HF attention function returns a tuple: the output [B, S_q, H, D_v] and the "
                                  "weights or None")
        out, expected = result[0], h.bshd_shape()
        if tuple(out.shape) != expected:
            fail(f"{list(out.shape)}", what="attn_output's shape", expected=f"[B, S_q, H, D_v] = {list(expected)}",
                 call=call, cause="HF's attn_output is [B, S_q, H, D_v]: transpose(1, 2) the [B, H, S_q, D_v] result")
        return h.restore(out.transpose(1, 2))
