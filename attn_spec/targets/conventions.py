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

Each convention is a Target class that declares its traits (attn_spec.vocabulary.Traits: kind, trained,
multi-head, masks, dtypes, options, layout, the make_target keywords it takes) and registers itself when
defined; ``CONVENTIONS`` and every subset are derived from the registry (``attn-spec list --conventions``).
This module decides which convention a target follows (``detect_convention``: each class's ``detects``, in
``detect_rank`` order) and wraps it (``make_target``: the class's ``build``; ``load``); the interface is in
base.py.
"""
from __future__ import annotations

from attn_spec.errors import KitUsageError, TargetHung, TargetLoadError
from attn_spec.targets import base, interpreter
from attn_spec.targets.base import (  # noqa: F401 - the conventions' vocabulary, imported from here too
    CLASSES, MASK_FORMS, PROJECTIONS, Target, _call, check_output, convention_class, conventions, parameter_names,
    parse_masks, positional_capacity)
from attn_spec.targets.call_shapes import check_call_shape
from attn_spec.targets.capture import capture
from attn_spec.targets.deadline import IMPORT_FACTOR, words
from attn_spec.targets.functions import FunctionTarget, SdpaTarget  # noqa: F401 - registers them; imported from here
from attn_spec.targets.guard import StateGuard
from attn_spec.targets.layouts import attend_shape, broadcast_shapes  # noqa: F401 - imported from here too
from attn_spec.targets.loading import load_target, spec_of
from attn_spec.targets.modules import AdapterTarget, ModuleTarget, TorchMhaTarget  # noqa: F401 - registers them
from attn_spec.targets.module_adapters import ModuleAdapter, SeedAdapter, TorchMhaAdapter  # noqa: F401
from attn_spec.vocabulary import traits as traits_of

KEYWORDS = {"layout": "--layout", "expect_mask": "--expect-mask", "expect_score": "--expect-score",
            "hf_module_attr": "--hf-module-attr", "hf_config": "--hf-config"}


def __getattr__(name: str):
    """CONVENTIONS, ATTENTION_CONVENTIONS, ... : derived from the registry when asked (attn_spec.targets.base)."""
    if name in base.DERIVED:
        return conventions(**base.DERIVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def detect_convention(obj) -> str:
    """The convention of ``obj``: the first registered class, in ``detect_rank`` order, whose ``detects``
    recognises its type and signature; a usage error when none does."""
    names = parameter_names(obj)
    for cls in sorted(CLASSES.values(), key=lambda c: c.traits.detect_rank):
        if cls.detects(obj, names):
            return cls.convention
    listed = "; ".join(f"{c.convention} = {c.traits.signature}" for c in CLASSES.values())
    raise KitUsageError(
        f"cannot tell which convention {getattr(obj, '__name__', obj)!r} follows (parameters: {names}). "
        f"Pick one with --convention (convention= in Python): {listed}.")


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
    cls = convention_class(convention)
    given = {key: value for key, value in (("layout", layout), ("expect_mask", expect_mask),
                                           ("expect_score", expect_score), ("hf_module_attr", hf_module_attr),
                                           ("hf_config", hf_config)) if value is not None}
    for key in given:
        if key not in cls.traits.keywords:
            applies = [c for c in conventions() if key in traits_of(c).keywords]
            raise KitUsageError(f"{KEYWORDS[key]} applies to the {' and '.join(applies)} convention"
                                f"{'s' if len(applies) > 1 else ''}, but {name} follows the {convention} convention")
    check_call_shape(obj, convention, name)  # before anything runs: a signature that cannot take the call
    if "layout" in cls.traits.keywords:
        given.setdefault("layout", None)
    target = cls.build(obj, name, masks=masks, inference_only=inference_only, state=state, **given)
    target.state = state or target.state
    runtime = interpreter.runs(obj)
    if runtime:  # a Triton kernel under the interpreter: each call in a forked child, the interpreter probed
        target.runtime, target.state.in_child = (runtime,), True
        target.left_out = interpreter.platform()
    if "layout" in cls.traits.keywords and layout is None:
        with capture() as output:
            target.detect_layout()  # two tiny calls, under the target's guard
        target.state.verify("during the layout probe")
        if output.summary():
            target.output["layout probe"] = output.summary(verbose)
    return target


def load(spec: str, convention: str | None = None, *, name: str | None = None, root: str | None = None,
         masks=None, inference_only: bool = False, verbose: bool = False, **options) -> Target:
    """Import the TARGET ``spec`` (``root``: see load_target) and wrap it (``masks``: see make_target). What
    the import printed is kept (``target.output["import"]``); the global state it changed is restored and
    noted; an import that does not finish within its deadline (attn_spec.targets.deadline) is one that
    cannot be loaded. ``options``: the other keywords of make_target (layout, expect_mask, expect_score). Raises
    TargetLoadError (or KitUsageError: no convention fits)."""
    state = StateGuard()
    with capture() as output:
        try:
            with state.call(f"importing {spec}", deadline=IMPORT_FACTOR):
                obj = load_target(spec, root=root)
        except TargetHung as exc:  # an import that never ends is a target that cannot be loaded
            raise TargetLoadError(f"Cannot load target {spec!r}: importing it did not finish within "
                                  f"{words(exc.seconds)} (--call-timeout sets the deadline: {IMPORT_FACTOR} "
                                  f"times a call's)\n\n{exc.user_traceback}") from None
        state.verify("at import")
        target = make_target(obj, name or spec, convention, masks, inference_only=inference_only, state=state,
                             verbose=verbose, **options)
    if output.summary():
        target.output["import"] = output.summary(verbose)
    return target
