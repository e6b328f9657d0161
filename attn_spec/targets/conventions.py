"""The adapter layer: every target, whatever its convention, seen through one call interface.

Properties never touch the user's object. They call

- ``target.attend(q, k, v, mask=None) -> out``: attention on Q [..., Tq, Dk], K [..., Tk, Dk],
  V [..., Tk, Dv], bool mask broadcastable to [..., Tq, Tk] with True = may attend (or, for a
  target whose ``masks`` include "additive", a float mask added to the scaled scores);
- ``target.multihead(x_q, x_kv, weights, n_heads, mask=None) -> out``: a multi-head module
  built as ``Cls(d_model, n_heads)`` with the given projection weights (``module`` only).

Tensors go in and come out, so the same catalog can drive a target that lives in another
process (the grader) or inside pytest.

Conventions:
- ``function`` (functions.py): ``attention(Q, K, V, mask=None)``, the seed's function.
- ``sdpa`` (functions.py): the signature of ``torch.nn.functional.scaled_dot_product_attention``
  (``attn_mask``, ``dropout_p``, ``is_causal``, ``scale``).
- ``module`` (modules.py, as the next two): a class ``Cls(d_model, n_heads)`` with ``nn.Linear`` (no bias) ``W_Q``, ``W_K``,
  ``W_V``, ``W_O`` and ``forward(x_q [Tq, D], x_kv [Tk, D], mask=None)``.
- ``torch-mha``: ``torch.nn.MultiheadAttention`` (the class, an instance, or a factory).
- ``adapter``: any other module, through a user-written ``ModuleAdapter`` (module_adapters.py).
- ``hf`` (hf.py): a Hugging Face attention function, ``fn(module, query, key, value, attention_mask, ...)``.
- ``flex`` (flex.py): ``torch.nn.attention.flex_attention.flex_attention``, the kit's masks as a ``block_mask``.
- ``mask-mod``, ``score-mod`` (mask_mods.py): a FlexAttention ``mask_mod`` or ``score_mod`` against a named
  statement; not attentions, so only their own properties apply.
``function`` and ``sdpa`` targets may lay out heads and sequence as [B, S, H, D] (layouts.py).
Masks: every convention takes bool masks (True = may attend). Additive float masks (0 where a
key may be attended, -inf where not, any finite bias) are part of the ``sdpa``, ``torch-mha`` and
``flex`` contracts (and of ``hf`` where Hugging Face builds float masks for it); a ``function``,
``module`` or ``adapter`` target gets them only when its user declares them
(``masks=("bool", "additive")``, ``--masks bool,additive``). A target declared with
``masks=("additive",)`` gets each bool mask as the equivalent 0 / -inf float mask.

``module``, ``torch-mha`` and ``adapter`` are multi-head modules: ``attend`` embeds plain attention in them with one head,
identity projections and Q scaled by 2^m where D = 4^m * Dk, so that the module's own
1/sqrt(D) becomes exactly 1/sqrt(Dk) with no rounding.

This module decides which convention a target follows (``detect_convention``) and wraps it
(``make_target``, ``load``); the interface is in base.py.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from attn_spec.errors import KitUsageError, TargetLoadError, TargetRaised, Unsupported
from attn_spec.targets.base import (  # noqa: F401 - the conventions' vocabulary, imported from here too
    ATTENTION_CONVENTIONS, CONVENTIONS, FUNCTION_CONVENTIONS, LIBRARY_TARGETS, MASK_FORMS, MOD_CONVENTIONS,
    MULTIHEAD_CONVENTIONS, PROJECTIONS, Target, _call, check_output, library_convention, parameter_names,
    parse_masks, positional_capacity)
from attn_spec.targets.call_shapes import check_call_shape
from attn_spec.targets.capture import capture
from attn_spec.targets.functions import FunctionTarget, SdpaTarget
from attn_spec.targets.guard import StateGuard
from attn_spec.targets.layouts import attend_shape, broadcast_shapes  # noqa: F401 - imported from here too
from attn_spec.targets.loading import load_target, spec_of
from attn_spec.targets.modules import ModuleTarget
from attn_spec.targets.module_adapters import ModuleAdapter, SeedAdapter, TorchMhaAdapter


def _is_mha(obj) -> bool:
    mha = torch.nn.MultiheadAttention
    return isinstance(obj, mha) or (inspect.isclass(obj) and issubclass(obj, mha))


def detect_convention(obj) -> str:
    """The convention of ``obj`` from its type and signature; a usage error when it is ambiguous."""
    if isinstance(obj, ModuleAdapter) or (inspect.isclass(obj) and issubclass(obj, ModuleAdapter)):
        return "adapter"
    if _is_mha(obj):
        return "torch-mha"
    if inspect.isclass(obj):
        return "module"
    if obj is F.scaled_dot_product_attention:
        return "sdpa"
    names = parameter_names(obj)
    for convention, cls in LIBRARY_TARGETS.items():
        if cls.detects(obj, names):
            return convention
    if names is not None and set(names) & {"attn_mask", "is_causal", "causal", "softmax_scale", "dropout_p"}:
        return "sdpa"
    if positional_capacity(obj) >= 3 and (names is None or len(names) <= 4 or "mask" in names):
        return "function"
    raise KitUsageError(
        f"cannot tell which convention {getattr(obj, '__name__', obj)!r} follows (parameters: {names}). "
        f"Pick one with --convention (convention= in Python): function = attention(Q, K, V, mask=None); "
        f"sdpa = fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None); "
        f"module = Cls(d_model, n_heads) with W_Q, W_K, W_V, W_O; torch-mha = nn.MultiheadAttention or "
        f"a factory (d_model, n_heads) -> nn.MultiheadAttention; adapter = a ModuleAdapter subclass; "
        f"hf = fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs); "
        f"flex = flex_attention(query, key, value, score_mod=None, block_mask=None, ...); "
        f"mask-mod = mask_mod(b, h, q_idx, kv_idx); score-mod = score_mod(score, b, h, q_idx, kv_idx).")


def make_target(obj, name: str | None = None, convention: str | None = None, masks=None, *,
                inference_only: bool = False, state: StateGuard | None = None, layout: str | None = None,
                expect_mask: str | None = None, expect_score: str | None = None, verbose: bool = False,
                hf_module_attr=None, hf_config=None) -> Target:
    """The adapter for ``obj``. ``masks``: the mask forms it takes (default: its convention's, see
    MASK_FORMS); ``inference_only``: see :class:`Target`; ``state``: a guard that already holds what
    importing ``obj`` changed. ``layout`` (bhsd, bshd) applies to function and sdpa targets (probed
    when not given: what the probe calls print is kept as ``target.output["layout probe"]``, all of it with
    ``verbose``); ``expect_mask`` and ``expect_score`` name the statement a mask-mod or score-mod target is
    checked against; ``hf_module_attr`` and ``hf_config`` extend an hf target's stand-in module (targets.hf). An adapter class that raises when instantiated is a TargetLoadError."""
    name = name or spec_of(obj) or getattr(obj, "__qualname__", None) or type(obj).__name__
    convention = convention or ("mask-mod" if expect_mask else "score-mod" if expect_score else None) \
        or detect_convention(obj)
    if convention not in CONVENTIONS:
        raise KitUsageError(f"convention={convention!r}, but it must be one of {', '.join(CONVENTIONS)}")
    for given, flag, applies in ((layout, "--layout", ("function", "sdpa")), (expect_mask, "--expect-mask", ("mask-mod",)),
                                 (expect_score, "--expect-score", ("score-mod",)),
                                 (hf_module_attr, "--hf-module-attr", ("hf",)), (hf_config, "--hf-config", ("hf",))):
        if given is not None and convention not in applies:
            raise KitUsageError(f"{flag} applies to the {' and '.join(applies)} convention"
                                f"{'s' if len(applies) > 1 else ''}, but {name} follows the {convention} convention")
    check_call_shape(obj, convention, name)  # before anything runs: a signature that cannot take the call
    kwargs = {"inference_only": inference_only}
    if convention in ("function", "sdpa"):
        target = (FunctionTarget if convention == "function" else SdpaTarget)(obj, name, masks, layout, **kwargs)
    elif convention in LIBRARY_TARGETS:
        options = {key: value for key, value in (("expect_mask", expect_mask), ("expect_score", expect_score),
                                                 ("hf_module_attr", hf_module_attr), ("hf_config", hf_config)) if value}
        target = LIBRARY_TARGETS[convention](obj, name, masks=masks, **options, **kwargs)
    elif convention == "module":
        target = ModuleTarget(SeedAdapter(obj), name, masks=masks, **kwargs)
    elif convention == "torch-mha":
        adapter = TorchMhaAdapter.from_instance(obj, name) if isinstance(obj, torch.nn.Module) \
            else TorchMhaAdapter(obj, name=name)
        target = ModuleTarget(adapter, name, "torch-mha", masks, **kwargs)
    else:
        target = ModuleTarget(_instance(obj, name, state or StateGuard()), name, "adapter", masks, **kwargs)
    target.state = state or target.state
    if convention in ("function", "sdpa") and layout is None:
        with capture() as output:
            target.detect_layout()  # two tiny calls, under the target's guard
        if output.summary():
            target.output["layout probe"] = output.summary(verbose)
    return target


def _instance(adapter, name: str, state: StateGuard):
    if not inspect.isclass(adapter):
        return adapter
    try:
        return _call(adapter, (), f"{name}()", state)
    except (TargetRaised, Unsupported) as exc:
        trace = f"\n\n{exc.user_traceback}" if isinstance(exc, TargetRaised) else ""
        raise TargetLoadError(f"Cannot use target {name!r}: {exc}{trace}") from None


def load(spec: str, convention: str | None = None, *, name: str | None = None, root: str | None = None,
         masks=None, inference_only: bool = False, verbose: bool = False, **options) -> Target:
    """Import the TARGET ``spec`` (``root``: see load_target) and wrap it (``masks``: see make_target). What
    the import printed is kept (``target.output["import"]``); the global state it changed is restored and
    noted. ``options``: the other keywords of make_target (layout, expect_mask, expect_score). Raises
    TargetLoadError (or KitUsageError: no convention fits)."""
    state = StateGuard()
    with capture() as output:
        with state.call(f"importing {spec}"):
            obj = load_target(spec, root=root)
        target = make_target(obj, name or spec, convention, masks, inference_only=inference_only, state=state,
                             verbose=verbose, **options)
    if output.summary():
        target.output["import"] = output.summary(verbose)
    return target
