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
- ``function``: ``attention(Q, K, V, mask=None)``, the seed's function.
- ``sdpa``: the signature of ``torch.nn.functional.scaled_dot_product_attention``
  (``attn_mask``, ``dropout_p``, ``is_causal``, ``scale``).
- ``module``: a class ``Cls(d_model, n_heads)`` with ``nn.Linear`` (no bias) ``W_Q``, ``W_K``,
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
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F

from attn_spec.checking.assertions import fail, message
from attn_spec.errors import KitUsageError, NotDifferentiable, TargetLoadError, TargetRaised, Unsupported
from attn_spec.targets import layouts
from attn_spec.targets.capture import capture
from attn_spec.targets.detached import how_detached
from attn_spec.targets.guard import StateGuard, passes_through
from attn_spec.targets.layouts import _grouped, attend_shape, broadcast_shapes  # noqa: F401 - imported from here too
from attn_spec.targets.loading import load_target, raised_on_purpose, spec_of, user_traceback
from attn_spec.targets.module_adapters import ModuleAdapter, SeedAdapter, TorchMhaAdapter

CONVENTIONS = ("function", "sdpa", "module", "torch-mha", "adapter", "hf", "flex", "mask-mod", "score-mod")
ATTENTION_CONVENTIONS = CONVENTIONS[:7]  # targets that compute attention: the catalog's default
MOD_CONVENTIONS = ("mask-mod", "score-mod")  # FlexAttention mods, checked against a named statement
FUNCTION_CONVENTIONS = ("function", "sdpa", "hf", "flex")  # attention on Q, K, V directly
MULTIHEAD_CONVENTIONS = ("module", "torch-mha", "adapter")  # modules with projections
PROJECTIONS = ("W_Q", "W_K", "W_V", "W_O")
MASK_FORMS = ("bool", "additive")  # what a target may be called with as its mask


def parse_masks(masks) -> tuple[str, ...] | None:
    """``"bool,additive"`` or ``["bool", "additive"]`` -> ``("bool", "additive")``; None stays None
    (the convention's default). Anything else is a usage error."""
    if masks is None:
        return None
    items = masks.replace(",", " ").split() if isinstance(masks, str) else [
        item for entry in masks for item in str(entry).replace(",", " ").split()]
    bad = [item for item in items if item not in MASK_FORMS]
    if bad or not items:
        raise KitUsageError(f"masks={list(items)}, but each must be one of {', '.join(MASK_FORMS)} "
                            f"(e.g. --masks bool,additive)")
    return tuple(dict.fromkeys(items))


def _call(fn, args, call: str, state: StateGuard):
    """Run the user's code; its exceptions become a TargetRaised (or Unsupported) with its traceback.

    Every exception is the target's, BaseExceptions too (SystemExit, GeneratorExit, a
    KeyboardInterrupt it raises itself), except the user's Ctrl-C and the kit's own signals.
    Only the user's own ``raise NotImplementedError`` (or ``raise attn_spec.Unsupported``) declares
    an input unsupported; a NotImplementedError from inside torch or another library is a crash.
    ``state`` restores the global state the call changed. Autograd follows the caller's mode:
    off by default, on inside ``Target.vjp``.
    """
    try:
        with state.call(call):
            return fn(*args)
    except Unsupported as exc:  # attn_spec.Unsupported, raised by the target to decline this input
        raise Unsupported(f"{call} declined: {exc}", total=exc.total) from None
    except NotImplementedError as exc:
        if raised_on_purpose(exc):
            raise Unsupported(f"{call} raised NotImplementedError: {exc}") from None
        raised = TargetRaised(exc, call, user_traceback(exc))
        raised.cause = ("a NotImplementedError raised inside torch or another library is a crash, not a "
                        "declaration: the target's own code must raise it (or attn_spec.Unsupported) to decline "
                        "an input")
        raise raised from None
    except BaseException as exc:  # noqa: BLE001 - anything the user's code raises is a finding
        if passes_through(exc):
            raise
        raise TargetRaised(exc, call, user_traceback(exc)) from None


def check_output(out, shape: tuple, call: str) -> torch.Tensor:
    """The output must be a tensor of the contract's shape."""
    if not isinstance(out, torch.Tensor):
        fail(f"a {type(out).__name__}", what="the output", expected=f"a torch.Tensor of shape {list(shape)}",
             call=call, cause="the function must return the output tensor (only the output, not a tuple)")
    if tuple(out.shape) != tuple(shape):
        fail(f"{list(out.shape)}", what="the output's shape", expected=f"{list(shape)}", call=call,
             cause="the output must be [..., n_q, d_v]: one row per query, as wide as V")
    return out


OPTIONS = {"window": "sliding window", "softcap": "softcap"}  # attend()'s options, in words
LIBRARY_TARGETS: dict[str, type] = {}  # convention -> Target class of hf.py, flex.py, mask_mods.py, in detection order


def library_convention(cls):
    """Register a Target class kept in a module of its own (imported by the attn_spec.targets package); its
    ``detects(obj, names)`` tells detect_convention whether a callable follows it."""
    LIBRARY_TARGETS[cls.convention] = cls
    return cls


class Target:
    """Base adapter. ``name`` names the target in reports; ``calls`` counts calls into it;
    ``masks`` the mask forms it may be called with (MASK_FORMS).

    ``inference_only``: the user declared an inference kernel, so a missing backward is a skip
    (``--inference-only``). ``state`` restores the global state each call changes and keeps what
    it was (attn_spec.targets.guard).
    """

    convention = "?"
    default_masks = ("bool",)
    is_attention = True  # False for FlexAttention's mods: only their own properties apply
    default_dtypes = None  # the dtypes checked unless the user names some (None: all)
    gqa_contract = ""  # where grouped K/V heads are part of the convention, what tells the target: then raising fails

    def __init__(self, obj, name: str, masks=None, *, inference_only: bool = False):
        self.obj, self.name, self.calls, self.inference_only = obj, name, 0, inference_only
        self.masks = parse_masks(masks) or self.default_masks
        self.supported = None  # what it takes, once probed (attn_spec.targets.capabilities.supports)
        self.behaviours = None  # its probed behaviours, once probed (attn_spec.targets.behaviours)
        self.state = StateGuard()
        self.output: dict[str, dict] = {}  # phase before the checks (the import) -> captured output
        self.recorder = None  # set while a failure is replayed for its diagnosis (attn_spec.diagnosis.record)

    def fresh_instances(self) -> None:
        """Forget built module instances (a module keeping state between calls starts afresh); no-op here."""

    def _observe(self, kind: str, inputs: dict, thunk, label: str = "", state_key: tuple = ()):
        """``thunk()``, the call into the user's code, kept by the recorder when one is set."""
        if self.recorder is None:
            return thunk()
        return self.recorder.observe(kind, inputs, thunk, label=label, state_key=state_key)

    def attend(self, q, k, v, mask=None, *, scale=None, is_causal=False, window=None, softcap=None) -> torch.Tensor:
        """``scale`` and ``is_causal`` reach only targets that take them (else Unsupported); so do
        ``window`` (w keys: query i sees keys i - w < j <= i) and ``softcap`` (cap * tanh(scores / cap))."""
        mask = self._mask_for_call(mask, q.dtype)
        options = {key: value for key, value in (("window", window), ("softcap", softcap)) if value is not None}
        for key in options:
            why = self.lacks_option(key)
            if why:
                raise Unsupported(why, total=True)
        with torch.no_grad():
            return self._attend(q, k, v, mask, scale=scale, is_causal=is_causal, **options)

    def lacks_option(self, key: str) -> str | None:
        """Why this target cannot take attend()'s option ``key`` ("window", "softcap"); None if it can."""
        return f"the {self.convention} convention takes no {OPTIONS[key]} argument"

    def notes(self) -> list[str]:
        """How the target is called, for the report's header (a detected layout, the mask HF builds for it)."""
        return []

    def options(self) -> dict:
        """The make_target keywords that rebuild this target (a reproduction snippet passes them on)."""
        return {}

    def mistakes(self, q, k, v, mask):
        """(description, float64 output) of misreadings specific to this convention, for diagnoses."""
        return []

    def _mask_for_call(self, mask, dtype):
        """The mask in a form the target was promised: a float mask only where declared."""
        if mask is None:
            return None
        if mask.dtype == torch.bool:
            if "bool" in self.masks:
                return mask
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, -math.inf)
        if "additive" not in self.masks:
            raise Unsupported(f"additive float masks are not part of the {self.convention} convention: the target "
                              f"gets bool masks only (declare them with --masks bool,additive)", total=True)
        return mask

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False):
        raise NotImplementedError  # sanity check: every convention implements it

    def _no_extra_arguments(self, scale, is_causal):
        if scale is not None:
            raise Unsupported(f"the {self.convention} convention takes no scale argument", total=True)
        if is_causal:
            raise Unsupported(f"the {self.convention} convention takes no is_causal argument", total=True)

    def vjp(self, q, k, v, mask, grad_out):
        """(out, dQ, dK, dV): the output and the gradients of <out, grad_out> w.r.t. Q, K and V.

        A gradient that does not reach an input comes back as zeros. An exception in the backward
        is the target's (TargetRaised, with its traceback). ``.backward()`` on leaf copies, not
        ``torch.autograd.grad``: reentrant checkpointing (``torch.utils.checkpoint(...,
        use_reentrant=True)``) raises inside ``autograd.grad`` and supports only ``.backward()``
        without ``inputs``. An output that is not differentiable at all raises NotDifferentiable
        (function, module, adapter and hf targets: they are trained) or Unsupported (inference-only
        targets, and the library conventions sdpa, torch-mha and flex).
        """
        return self._observe("vjp", {"q": q, "k": k, "v": v, "mask": mask, "grad_out": grad_out},
                             lambda: self._vjp(q, k, v, mask, grad_out), label="backward of <out, G>")

    def _vjp(self, q, k, v, mask, grad_out):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        mask = self._mask_for_call(mask, q.dtype)
        with torch.enable_grad():
            out = self._attend(*leaves, mask)
            if not out.requires_grad:
                self._not_differentiable(leaves, mask)
            # The scalar <out, grad_out>: its backward gives the same numbers as grad_outputs=grad_out
            # (it multiplies by ones), without autograd's first-call import of sympy.
            loss = (out * grad_out).sum()
            call = f"the backward of {self._describe_call(mask)}"
            _call(loss.backward, (), call, self.state)
        grads = [torch.zeros_like(t) if t.grad is None else t.grad for t in leaves]
        return (out.detach(), *grads)

    def _describe_call(self, mask) -> str:
        return f"{self.name}(Q, K, V{', mask' if mask is not None else ''})"

    def _not_differentiable(self, leaves, mask):
        how = how_detached(lambda: self._attend(*leaves, mask))
        if self.inference_only:
            raise Unsupported(f"declared an inference kernel (inference_only): the output is not differentiable "
                              f"in Q, K, V; {how}", total=True)
        if self.convention in ("sdpa", "torch-mha", "flex"):
            raise Unsupported(f"no autograd: the output is not differentiable in Q, K, V; {how}", total=True)
        raise NotDifferentiable(message(f"not differentiable in Q, K, V; {how}", what="no autograd: the output",
                                        call=self._describe_call(mask)),
                                cause="the attention is detached from autograd, so it cannot be trained; if it is "
                                      "an inference kernel, declare it (--inference-only, inference_only=True)")

    def multihead(self, x_q, x_kv, weights, n_heads, mask=None) -> torch.Tensor:
        raise Unsupported(f"the {self.convention} convention has no multi-head projections to compare", total=True)


def parameter_names(fn) -> list[str] | None:
    """The parameter names of ``fn``, from its signature or a builtin's docstring; None if unknown."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        first = (getattr(fn, "__doc__", None) or "").strip().split(")")[0]
        if "(" not in first:
            return None
        return [p.split("=")[0].strip().lstrip("*") for p in first.split("(", 1)[1].split(",") if p.strip()]


def positional_capacity(fn) -> float:
    """How many positional arguments ``fn`` takes (inf for ``*args`` or an unreadable signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return float("inf")
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return float("inf")
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)


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
        if self.layout == "bhsd":
            inputs = {"q": q, "k": k, "v": v, "mask": mask, **extra}
            return check_output(self._observe("attend", inputs, lambda: fn(q, k, v, mask), call), attend_shape(q, k, v),
                                call)
        h = layouts.Heads(q, k, v, mask)
        inputs = {"q": h.q, "k": h.k, "v": h.v, "mask": h.mask, **extra}
        return layouts.restore_bshd(self._observe("attend", inputs, lambda: layouts.call_bshd(fn, h), call), h, call)

    def _probe_call(self, q, k, v):
        return _call(self.obj, (q, k, v), "attention(Q, K, V) (a layout probe)", self.state)

    def notes(self):
        return [f"layout: {self.layout} ({self.layout_why})"]

    def options(self):
        return {"layout": self.layout} if self.layout_why == "given" else {}

    def mistakes(self, q, k, v, mask):
        found = layouts.transposed_reading(q, k, v, mask) if self.layout == "bshd" else None
        return [found] if found else []


class FunctionTarget(LayoutTarget):
    """``attention(Q, K, V, mask=None) -> out``."""

    convention = "function"

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


# Each argument an sdpa-style target may take, by the names libraries give it (SDPA's first, then flash-attn's).
SDPA_NAMES = {"attn_mask": ("attn_mask",), "is_causal": ("is_causal", "causal"), "scale": ("scale", "softmax_scale"),
              "window": ("sliding_window", "window_size"), "softcap": ("softcap",)}


class SdpaTarget(LayoutTarget):
    """``fn(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None)``, or flash-attn's
    ``fn(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0)``."""

    convention = "sdpa"
    default_masks = MASK_FORMS  # attn_mask is bool or additive float in SDPA's contract

    def __init__(self, obj, name, masks=None, layout=None, **kwargs):
        self.accepts = set(parameter_names(obj) or ())
        self.names = {role: next((n for n in names if n in self.accepts), None) for role, names in SDPA_NAMES.items()}
        super().__init__(obj, name, masks, layout, **kwargs)

    def _probe_call(self, q, k, v):
        extra = {"dropout_p": 0.0} if "dropout_p" in self.accepts else {}
        return _call(lambda *a: self.obj(*a, **extra), (q, k, v), f"{self.name}(q, k, v) (a layout probe)", self.state)

    def lacks_option(self, key):
        return None if self.names[key] else f"{self.name} takes no {' or '.join(SDPA_NAMES[key])} argument"

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False, window=None, softcap=None):
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
            kwargs["dropout_p"] = 0.0
        if "enable_gqa" in self.accepts and _grouped(q, k):
            kwargs["enable_gqa"] = True
        self.calls += 1
        mask_name = self.names["attn_mask"]
        call = f"{self.name}(q, k, v{''.join(f', {key}=...' for key in kwargs)})"

        def fn(q, k, v, mask):
            if mask is not None:
                kwargs[mask_name] = mask
            return _call(lambda *a: self.obj(*a, **kwargs), (q, k, v), call, self.state)
        return self._run(fn, q, k, v, mask, call, scale=scale, is_causal=is_causal, window=window, softcap=softcap)


class ModuleTarget(Target):
    """A multi-head module, driven through a :class:`ModuleAdapter` (build, load weights, call)."""

    def __init__(self, adapter: ModuleAdapter, name: str, convention: str = "module", masks=None, **kwargs):
        if convention == "torch-mha":  # nn.MultiheadAttention takes additive float masks too
            self.default_masks = MASK_FORMS
        super().__init__(adapter, name, masks, **kwargs)
        self.adapter, self.convention = adapter, convention
        self._modules = {}  # (d_model, n_heads, dtype, device) -> instance; weights are reloaded per call

    def fresh_instances(self) -> None:
        self._modules.clear()

    def _build(self, d_model, n_heads, weights, dtype, device):
        key = (d_model, n_heads, dtype, str(device))
        if key not in self._modules:
            if len(self._modules) >= 16:  # a module may hold big buffers (nanoGPT's causal mask): keep the newest
                del self._modules[next(iter(self._modules))]
            self._modules[key] = _call(self._new_module, (d_model, n_heads, dtype, device),
                                       f"{self.name}({d_model}, {n_heads})", self.state)
        module = self._modules[key]
        try:
            with torch.no_grad(), self.state.call(f"loading W_Q, W_K, W_V, W_O into {self.name}({d_model}, {n_heads})"):
                self.adapter.load(module, *(weights[name] for name in PROJECTIONS))
        except (AttributeError, RuntimeError) as exc:
            fail(f"{type(exc).__name__}: {exc}", what="loading W_Q, W_K, W_V, W_O into the module",
                 call=f"{self.name}({d_model}, {n_heads})",
                 cause=f"the {self.convention} convention needs W_Q, W_K, W_V, W_O as "
                       f"nn.Linear(d_model, d_model) (or an adapter that says where they are)")
        except BaseException as exc:  # noqa: BLE001 - the adapter's own code raised
            if passes_through(exc):
                raise
            raise TargetRaised(exc, f"{self.name}.load(...)", user_traceback(exc)) from None
        return module

    def _new_module(self, d_model, n_heads, dtype, device):
        module = self.adapter.build(d_model, n_heads)
        if hasattr(module, "to"):
            module = module.to(device=device, dtype=dtype)
            module.eval()
        return module

    def vjp(self, q, k, v, mask, grad_out):
        try:
            return super().vjp(q, k, v, mask, grad_out)
        finally:  # .backward() also filled the parameters' .grad: leave the modules as they were
            for module in self._modules.values():
                for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
                    p.grad = None

    def multihead(self, x_q, x_kv, weights, n_heads, mask=None):
        mask = self._mask_for_call(mask, x_q.dtype)
        with torch.no_grad():
            return self._multihead(x_q, x_kv, weights, n_heads, mask)

    def _multihead(self, x_q, x_kv, weights, n_heads, mask, module=None):
        if self.adapter.self_attention_only and not (x_q is x_kv or (x_q.shape == x_kv.shape and torch.equal(x_q, x_kv))):
            raise Unsupported(f"{self.name} does self-attention only (no separate x_kv)")
        self.calls += 1
        if module is None:
            module = self._build(x_q.shape[-1], n_heads, weights, x_q.dtype, x_q.device)
        call = "forward(x_q, x_kv, mask)" if mask is not None else "forward(x_q, x_kv)"
        out = self._observe("multihead", {"x_q": x_q, "x_kv": x_kv, "weights": weights, "n_heads": n_heads,
                                          "mask": mask},
                            lambda: _call(lambda *a: self.adapter.forward(module, *a), (x_q, x_kv, mask), call,
                                          self.state),
                            call, state_key=(x_q.shape[-1], n_heads, x_q.dtype, str(x_q.device)))
        return check_output(out, (x_q.shape[0], x_q.shape[-1]), call)

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False):
        """Plain attention through the module: one head, projections that select Q, K and V.

        Cross form: x_q = [2^m Q | 0], x_kv = [K | V | 0]. Self-attention-only modules get
        x = [2^m Q | K | V | 0] for both (n_q must equal n_kv). D = 4^m * d_k, so the module's
        1/sqrt(D) times the gain 2^m is exactly 1/sqrt(d_k).
        """
        self._no_extra_arguments(scale, is_causal)
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        n_q, d_k, n_kv, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        self_only = self.adapter.self_attention_only
        if self_only and n_q != n_kv:
            raise Unsupported(f"{self.name} does self-attention only (n_q != n_kv needs a separate x_kv)")
        width = (2 * d_k if self_only else d_k) + d_v  # columns the inputs need
        m = 0
        while 4**m * d_k < width:
            m += 1
        d_model, gain = 4**m * d_k, 2.0**m  # gain / sqrt(d_model) == 1 / sqrt(d_k), exactly
        k_at, v_at = (d_k, 2 * d_k) if self_only else (0, d_k)  # where K and V sit in the input rows
        weights = {name: torch.zeros(d_model, d_model, dtype=q.dtype, device=q.device) for name in PROJECTIONS}
        idx = torch.arange(d_k, device=q.device)
        weights["W_Q"][idx, idx] = 1  # Q block -> head columns 0:d_k
        weights["W_K"][idx, k_at + idx] = 1  # K block -> head columns 0:d_k
        idv = torch.arange(d_v, device=q.device)
        weights["W_V"][idv, v_at + idv] = 1  # V block -> head columns 0:d_v
        weights["W_O"] = torch.eye(d_model, dtype=q.dtype, device=q.device)
        q, k, v = q.expand(*batch, n_q, d_k), k.expand(*batch, n_kv, d_k), v.expand(*batch, n_kv, d_v)
        if mask is not None:
            mask = mask.expand(*batch, n_q, n_kv)
        module = self._build(d_model, 1, weights, q.dtype, q.device)  # loaded once: a vjp's graph saves the weights
        rows = []
        for index in (torch.cartesian_prod(*[torch.arange(n) for n in batch]).reshape(-1, len(batch)).tolist()
                      if batch else [[]]):
            index = tuple(index)
            if self_only:
                x = torch.cat([q[index] * gain, k[index], v[index],
                               q.new_zeros(n_q, d_model - width)], dim=-1)  # [T, D]
                x_q = x_kv = x
            else:
                x_q = torch.cat([q[index] * gain, q.new_zeros(n_q, d_model - d_k)], dim=-1)  # [Tq, D]
                x_kv = torch.cat([k[index], v[index], q.new_zeros(n_kv, d_model - width)], dim=-1)  # [Tk, D]
            y = self._multihead(x_q, x_kv, weights, 1, None if mask is None else mask[index], module)  # [Tq, D]
            rows.append(y[:, :d_v])  # [Tq, Dv]
        return torch.stack(rows).reshape(*batch, n_q, d_v)  # [..., Tq, Dv]


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
                expect_mask: str | None = None, expect_score: str | None = None, verbose: bool = False) -> Target:
    """The adapter for ``obj``. ``masks``: the mask forms it takes (default: its convention's, see
    MASK_FORMS); ``inference_only``: see :class:`Target`; ``state``: a guard that already holds what
    importing ``obj`` changed. ``layout`` (bhsd, bshd) applies to function and sdpa targets (probed
    when not given: what the probe calls print is kept as ``target.output["layout probe"]``, all of it with
    ``verbose``); ``expect_mask`` and ``expect_score`` name the statement a mask-mod or score-mod target is
    checked against. An adapter class that raises when instantiated is a TargetLoadError."""
    name = name or spec_of(obj) or getattr(obj, "__qualname__", None) or type(obj).__name__
    convention = convention or ("mask-mod" if expect_mask else "score-mod" if expect_score else None) \
        or detect_convention(obj)
    if convention not in CONVENTIONS:
        raise KitUsageError(f"convention={convention!r}, but it must be one of {', '.join(CONVENTIONS)}")
    for given, flag, applies in ((layout, "--layout", ("function", "sdpa")), (expect_mask, "--expect-mask", ("mask-mod",)),
                                 (expect_score, "--expect-score", ("score-mod",))):
        if given is not None and convention not in applies:
            raise KitUsageError(f"{flag} applies to the {' and '.join(applies)} convention"
                                f"{'s' if len(applies) > 1 else ''}, but {name} follows the {convention} convention")
    kwargs = {"inference_only": inference_only}
    if convention in ("function", "sdpa"):
        target = (FunctionTarget if convention == "function" else SdpaTarget)(obj, name, masks, layout, **kwargs)
    elif convention in LIBRARY_TARGETS:
        options = {key: value for key, value in (("expect_mask", expect_mask), ("expect_score", expect_score)) if value}
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
