"""The ``flex`` convention: ``torch.nn.attention.flex_attention.flex_attention`` and functions with its signature.

    out = flex_attention(query [B, H, S_q, D], key [B, H_kv, S_kv, D], value [B, H_kv, S_kv, D_v],
                         score_mod=None, block_mask=None, scale=None, enable_gqa=False)  # [B, H, S_q, D_v]

The kit's masks reach it as a ``block_mask`` built with ``create_block_mask`` from a mask_mod that reads the
mask (a float mask's finite part as a score_mod adding it); ``is_causal`` and a sliding window are mask_mods
(index-based, so causal is aligned top-left), soft-capping a score_mod. On the CPU FlexAttention runs
eagerly (no torch.compile needed) and has no backward: autograd is a capability it lacks there.

Called without torch.compile, flex_attention still traces its unfused implementation with dynamo, once per
new shape, stride or dtype (0.5 to 2 s each, hundreds of times in a check). On the CPU a flex target is
therefore called under ``torch.compiler.set_stance("force_eager")``: the same operations (``sdpa_dense``)
without the trace. On a GPU it runs as it is (compiled kernels are what a GPU check is for).
"""
from __future__ import annotations

import contextlib
import sys
import warnings

import torch

from attn_spec import reference
from attn_spec.errors import TargetRaised, Unsupported
from attn_spec.targets.base import MASK_FORMS, Target, _call, check_output
from attn_spec.targets.layouts import Heads
from attn_spec.vocabulary import Traits


def block_mask(allowed, device):
    """A BlockMask from a bool mask [B or 1, H or 1, S_q, S_kv] (True = attend)."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, h, n_q, n_kv = allowed.shape
    return create_block_mask(lambda bi, hi, qi, ki: allowed[bi, hi, qi, ki], b, h, n_q, n_kv, device=device)


class FlexTarget(Target):
    traits = Traits("flex", "flex_attention(query, key, value, score_mod=None, block_mask=None, scale=None, ...)",
                    trained=False,  # no backward on the CPU
                    masks=MASK_FORMS,  # a float mask's -inf entries become the block_mask, its finite values a score_mod
                    options=("scale", "is-causal", "window", "softcap"), detect_rank=42)
    gqa_contract = "enable_gqa=True"

    @staticmethod
    def detects(obj, names) -> bool:
        module = sys.modules.get("torch.nn.attention.flex_attention")
        return (module is not None and obj is module.flex_attention) or {"score_mod", "block_mask"} <= set(names or ())

    def notes(self):
        return ["how masks reach it: a block_mask from create_block_mask (a float mask's finite values through a score_mod); "
                "is_causal and sliding windows as mask_mods, softcap as a score_mod"]

    @staticmethod
    def _stance(device):
        """On the CPU, FlexAttention runs its unfused implementation (sdpa_dense) without a dynamo trace per new
        shape, stride or dtype (0.5 to 2 s each): the same operations its eager-backend trace runs."""
        if torch.device(device).type == "cpu" and hasattr(torch.compiler, "set_stance"):
            return torch.compiler.set_stance("force_eager")
        return contextlib.nullcontext()

    def vjp(self, q, k, v, mask, grad_out):
        """FlexAttention has no backward on the CPU, whatever the input: its NotImplementedError there is the
        library's documented limit (a skip of gradients, as for sdpa), not a crash of the target."""
        try:
            return super().vjp(q, k, v, mask, grad_out)
        except Unsupported as exc:
            if q.device.type == "cpu":
                exc.total = True
            raise
        except TargetRaised as exc:
            if q.device.type != "cpu" or not isinstance(exc.exc, NotImplementedError):
                raise
            raise Unsupported(f"{exc.message} (FlexAttention has no backward on the CPU)", total=True) from None

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False, window=None, softcap=None):
        h = Heads(q, k, v, mask)
        n_q, n_kv = q.shape[-2], k.shape[-2]
        allowed, bias = None, None
        if h.mask is not None:
            allowed = h.mask if h.mask.dtype == torch.bool else ~torch.isneginf(h.mask)  # [B|1, H|1, Tq, Tk]
            if h.mask.dtype != torch.bool:
                bias = h.mask.masked_fill(~allowed, 0.0)
        if is_causal or window is not None:
            pattern = reference.causal_mask(n_q, n_kv, window=window, device=q.device)  # [Tq, Tk]
            allowed = pattern.expand(1, 1, n_q, n_kv) if allowed is None else allowed & pattern
        full = (h.batch, h.heads, n_q, n_kv)  # a block mask's mask_mod is read at every (b, h): no broadcasting
        kwargs = {}
        if allowed is not None:
            kwargs["block_mask"] = block_mask(allowed.expand(full), q.device)
        if bias is not None:
            bias = bias.expand(full)
        if bias is not None or softcap is not None:
            def score_mod(score, b, hi, qi, ki):
                if softcap is not None:
                    score = softcap * torch.tanh(score / softcap)
                return score if bias is None else score + bias[b, hi, qi, ki]
            kwargs["score_mod"] = score_mod
        if scale is not None:
            kwargs["scale"] = scale
        if h.kv_heads != h.heads:
            kwargs["enable_gqa"] = True
        self.calls += 1
        call = f"{self.name}(query, key, value{''.join(f', {key}=...' for key in kwargs)})"
        seen = {"q": q, "k": k, "v": v, "mask": mask, "scale": scale, "is_causal": is_causal,
                **{key: a for key, a in (("window", window), ("softcap", softcap)) if a is not None}}
        return self._observe("attend", seen, lambda: self._result(call, kwargs, h, q.device), call)

    def _result(self, call, kwargs, h, device):
        with warnings.catch_warnings(), self._stance(device):
            warnings.simplefilter("ignore")  # "flex_attention called without torch.compile()": eager is what we check
            out = _call(lambda *a: self.obj(*a, **kwargs), (h.q, h.k, h.v), call, self.state)
        check_output(out, (h.batch, h.heads, h.q.shape[-2], h.v.shape[-1]), call,
                     inputs={"query": h.q, "key": h.k, "value": h.v}, state=self.state)
        return h.restore(out)
