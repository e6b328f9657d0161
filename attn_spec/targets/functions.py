"""Function-style targets: ``attention(Q, K, V, mask=None)`` (function) and SDPA's or flash-attn's
signature (sdpa), in the [B, H, S, D] or [B, S, H, D] layout (layouts.py)."""
from __future__ import annotations

import torch

from attn_spec.errors import KitUsageError, Unsupported
from attn_spec.vocabulary import Traits
from attn_spec.targets import layouts
from attn_spec.targets.base import (MASK_FORMS, Target, _call, check_output, parameter_names, positional_capacity,
                                    returned)
from attn_spec.targets.layouts import _grouped, attend_shape


class LayoutTarget(Target):
    """A function-style target whose tensors are laid out ``bhsd`` (the default) or ``bshd`` (layouts.py)."""

    def __init__(self, obj, name, masks=None, layout=None, **kwargs):
        super().__init__(obj, name, masks, **kwargs)
        if layout is not None and layout not in layouts.LAYOUTS:
            raise KitUsageError(f"layout={layout!r}, but it must be one of {', '.join(layouts.LAYOUTS)}")
        self.layout, self.layout_why = (layout, "given") if layout else ("bhsd", "the default")

    def detect_layout(self) -> None:
        """Probe the layout (make_target does, for a user's target; two tiny calls that are not counted)."""
        self.layout, self.layout_why = layouts.detect(self._probe_call, parameter_names(self.obj))

    def _run(self, fn, q, k, v, mask, call, **arguments):
        """``fn(q, k, v, mask)`` (the user's code) in the target's layout. The call is observed (kept by the
        diagnosis' recorder) with ``arguments`` (scale, is_causal, window, softcap) and, in bhsd, the kit's own
        tensors; in bshd, the [B, H, S, D] tensors whose transposes the kernel gets, and its output read back
        as [B, H, S_q, D_v] (a mistake model's frame: heads on dim -3, whatever the kernel returned)."""
        extra = {key: a for key, a in arguments.items() if a is not None}
        given = {"Q": q, "K": k, "V": v, "mask": mask}
        if self.layout == "bhsd":
            inputs = {"q": q, "k": k, "v": v, "mask": mask, **extra}
            return check_output(self._observe("attend", inputs, lambda: fn(q, k, v, mask), call), attend_shape(q, k, v),
                                call, inputs=given, state=self.state)
        h = layouts.Heads(q, k, v, mask)
        inputs = {"q": h.q, "k": h.k, "v": h.v, "mask": h.mask, **extra}
        out = self._observe("attend", inputs, lambda: layouts.call_bshd(fn, h), call)
        if isinstance(out, torch.Tensor):
            returned(out, call, given, self.state)
        return layouts.restore_bshd(out, h, call)

    def _probe_call(self, q, k, v):
        return _call(self.obj, (q, k, v), "attention(Q, K, V) (a layout probe)", self.state)

    def notes(self):
        return [f"layout: {self.layout} ({self.layout_why})"]

    def options(self):
        return {"layout": self.layout} if self.layout_why == "given" else {}


class FunctionTarget(LayoutTarget):
    """``attention(Q, K, V, mask=None) -> out``."""

    traits = Traits("function", "attention(Q, K, V, mask=None)", declarable_masks=True,
                    layout="bhsd or bshd (probed)", keywords=("layout",), detect_rank=90)

    @staticmethod
    def detects(obj, names) -> bool:  # the catch-all: three positional arguments, a few names or a mask
        return positional_capacity(obj) >= 3 and (names is None or len(names) <= 4 or "mask" in names)

    def __init__(self, obj, name, masks=None, layout=None, **kwargs):
        super().__init__(obj, name, masks, layout, **kwargs)
        self.takes_mask = positional_capacity(obj) >= 4

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False):
        self._no_extra_arguments(scale, is_causal)
        if mask is not None and not self.takes_mask:
            raise Unsupported("the function takes no mask argument", total=True)
        self.calls += 1
        call = "attention(Q, K, V, mask)" if mask is not None else "attention(Q, K, V)"

        def fn(*args):
            return _call(self.obj, args if args[3] is not None else args[:3], call, self.state)
        return self._run(fn, q, k, v, mask, call)


# Each argument an sdpa-style target may take, by the names libraries give it (SDPA's first, then flash-attn's,
# then Triton kernels' sm_scale).
SDPA_NAMES = {"attn_mask": ("attn_mask",), "is_causal": ("is_causal", "causal"), "scale": ("scale", "softmax_scale", "sm_scale"),
              "window": ("sliding_window", "window_size"), "softcap": ("softcap",), "dropout": ("dropout_p",),
              "alibi": ("alibi_slopes",)}


class SdpaTarget(LayoutTarget):
    """``fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)``, or flash-attn's
    ``fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0)``."""

    traits = Traits("sdpa", "fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)",
                    trained=False, masks=MASK_FORMS,  # attn_mask is bool or additive float in SDPA's contract
                    options=("scale", "is-causal", "window", "softcap", "dropout", "alibi"), layout="bhsd or bshd (probed)",
                    keywords=("layout",), detect_rank=80)

    @staticmethod
    def detects(obj, names) -> bool:  # SDPA itself, or SDPA's or flash-attn's argument names
        import torch.nn.functional as F

        return obj is F.scaled_dot_product_attention or (
            names is not None and bool(set(names) & {"attn_mask", "is_causal", "causal", "softmax_scale", "sm_scale", "dropout_p"}))

    def __init__(self, obj, name, masks=None, layout=None, **kwargs):
        self.accepts = set(parameter_names(obj) or ())
        self.names = {role: next((n for n in names if n in self.accepts), None) for role, names in SDPA_NAMES.items()}
        super().__init__(obj, name, masks, layout, **kwargs)

    def _probe_call(self, q, k, v):
        extra = {"dropout_p": 0.0} if "dropout_p" in self.accepts else {}
        return _call(lambda *a: self.obj(*a, **extra), (q, k, v), f"{self.name}(q, k, v) (a layout probe)", self.state)

    def lacks_option(self, key):
        return None if self.names[key] else f"{self.name} takes no {' or '.join(SDPA_NAMES[key])} argument"

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False, window=None, softcap=None, dropout=None,
                alibi=None):
        is_causal = is_causal or window is not None  # a window of w keys is causal
        kwargs = {}
        for key, value, default in (("attn_mask", mask, None), ("is_causal", is_causal, False), ("scale", scale, None)):
            if value is not default and value is not False:
                if not self.names[key]:
                    raise Unsupported(f"{self.name} takes no {key} argument", total=True)
                kwargs[self.names[key]] = value
        if window is not None:  # HF's sliding_window=w, or flash-attn's window_size=(w - 1, 0)
            kwargs[self.names["window"]] = window if self.names["window"] == "sliding_window" else (window - 1, 0)
        if softcap is not None:
            kwargs["softcap"] = softcap
        if "dropout_p" in self.accepts:
            kwargs["dropout_p"] = dropout or 0.0
        if alibi is not None:
            kwargs["alibi_slopes"] = alibi
        if "enable_gqa" in self.accepts and _grouped(q, k):
            kwargs["enable_gqa"] = True
        self.calls += 1
        mask_name = self.names["attn_mask"]
        call = f"{self.name}(q, k, v{''.join(f', {key}=...' for key in kwargs)})"

        def fn(q, k, v, mask):
            if mask is not None:
                kwargs[mask_name] = mask
            return _call(lambda *a: self.obj(*a, **kwargs), (q, k, v), call, self.state)
        return self._run(fn, q, k, v, mask, call, scale=scale, is_causal=is_causal, window=window, softcap=softcap,
                         dropout=dropout, alibi=alibi)


