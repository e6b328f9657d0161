"""The target interface every convention implements (:class:`Target`: ``attend``, ``vjp``,
``multihead``), the calls into the user's code (``_call``: its exceptions are its own, the
global state it changes restored) and the convention registry: a Target class with its own ``traits``
(attn_spec.vocabulary.Traits) registers itself when it is defined, and every list of conventions is
derived from the registry. The conventions themselves: functions.py, modules.py, hf.py, flex.py,
mask_mods.py; which one a target follows: conventions.py."""
from __future__ import annotations

import inspect
import math

import torch

from attn_spec import vocabulary
from attn_spec.dtypes import DTYPES
from attn_spec.errors import KitUsageError, NotDifferentiable, TargetRaised, Unsupported
from attn_spec.failures import fail, message
from attn_spec.targets.detached import how_detached
from attn_spec.targets.envelope import fit_widths
from attn_spec.targets.guard import StateGuard, passes_through
from attn_spec.targets.integrity import not_plain
from attn_spec.targets.forked import call_forked
from attn_spec.targets.loading import raised_on_purpose, user_traceback


CLASSES: dict[str, type] = {}  # convention name -> its Target class, in registration order
# The lists of conventions, derived from the registry when first asked for (module __getattr__, below):
DERIVED = {
    "CONVENTIONS": {},  # every convention
    "ATTENTION_CONVENTIONS": {"kind": "attention"},  # targets that compute attention: the catalog's default
    "MOD_CONVENTIONS": {"kind": "mod"},  # FlexAttention mods, checked against a named statement
    "SERVING_CONVENTIONS": {"kind": "serving"},  # serving kernels (decode, ...), checked by their own properties
    "FUNCTION_CONVENTIONS": {"kind": "attention", "multihead": False},  # attention on Q, K, V directly
    "MULTIHEAD_CONVENTIONS": {"kind": "attention", "multihead": True},  # modules with projections
}
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
    if state.in_child:  # a call that can kill the process (attn_spec.targets.forked): the same outcomes, from a child
        return call_forked(fn, args, call, state)
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


WRONG_TYPES = {  # what came back -> its words (the diagnosis names the root by them too), and what else to say
    "ndarray": ("a numpy.ndarray", "NumPy also leaves the autograd graph"),
    "list": ("a list", "a list is no tensor: keep the output one tensor"),
    "tuple": ("a tuple", "the convention returns the output alone, without the weights"),
    "float": ("a float", "was .item() or float() called on the output?"),
    "int": ("an int", "a Python number is no tensor"),
    "NoneType": ("None", "is a return statement missing?"),
}


def type_words(out) -> tuple[str, str]:
    """(``"a numpy.ndarray"``, why) for a returned object that is not a tensor."""
    name = type(out).__name__
    return WRONG_TYPES.get(name, (f"a {type(out).__module__}.{name}".replace("builtins.", ""),
                                  "the convention returns a torch.Tensor"))


def check_output(out, shape: tuple, call: str, *, inputs: dict | None = None, state: StateGuard | None = None
                 ) -> torch.Tensor:
    """The output must be a plain dense tensor (attn_spec.targets.integrity.not_plain) of the contract's shape;
    with the target's ``state``, also its own storage, not that of ``inputs`` (name -> tensor) or of the previous
    output, whose values must not have changed since it was returned (integrity.Outputs)."""
    if not isinstance(out, torch.Tensor):
        words, why = type_words(out)
        fail(words, what="the output", expected=f"a torch.Tensor of shape {list(shape)}",
             call=call, cause=f"returns {words}: return a torch.Tensor ({why})")
    returned(out, call, inputs, state)
    if tuple(out.shape) != tuple(shape):
        fail(f"{list(out.shape)}", what="the output's shape", expected=f"{list(shape)}", call=call,
             cause="the output must be [..., n_q, d_v]: one row per query, as wide as V")
    return out


def returned(out: torch.Tensor, call: str, inputs: dict | None = None, state: StateGuard | None = None) -> None:
    """A returned tensor's integrity: plain and dense; with ``state``, not aliased and not changed since (above)."""
    problem = not_plain(out)
    if problem:
        fail(problem, what="the output", expected="a plain dense torch.Tensor", call=call,
             cause="the kit judges the values a call returns: return one plain tensor (a subclass can lie about its "
                   "values or compute them later)")
    if state is not None:
        state.outputs.returned(out, inputs or {}, call,
                               lambda measured, **words: fail(measured, call=call, **words))


OPTIONS = {"window": "sliding window", "softcap": "softcap", "dropout": "dropout", "alibi": "alibi_slopes"}  # attend()'s options, in words


def __getattr__(name: str):
    """CONVENTIONS and its subsets (DERIVED), derived from the registry now (a convention registered later
    is in them); the attn_spec.targets package imports every convention of the kit's own first."""
    if name in DERIVED:
        return conventions(**DERIVED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def conventions(**where) -> tuple[str, ...]:
    """The registered conventions' names, those whose traits match ``where`` (attn_spec.vocabulary.names)."""
    return tuple(name for name in vocabulary.names(**where) if name in CLASSES)


def convention_class(name: str) -> type:
    """The Target class of convention ``name``; a usage error naming the registered ones otherwise."""
    if name not in CLASSES:
        raise KitUsageError(f"convention={name!r}, but it must be one of {', '.join(conventions())}")
    return CLASSES[name]


class Target:
    """Base adapter. ``name`` names the target in reports; ``calls`` counts calls into it;
    ``masks`` the mask forms it may be called with (MASK_FORMS).

    A subclass that sets ``traits`` (attn_spec.vocabulary.Traits) in its own body is a convention: it is
    registered when defined, and ``convention``, ``default_masks``, ``default_dtypes`` and
    ``is_attention`` come from its traits. ``build(obj, name, **keywords)`` makes a target of it from
    what make_target was given; ``detects(obj, names)`` tells detect_convention whether ``obj`` follows it
    (tried in the order of ``traits.detect_rank``).

    ``inference_only``: the user declared an inference kernel, so a missing backward is a skip
    (``--inference-only``). ``state`` restores the global state each call changes and keeps what
    it was (attn_spec.targets.guard).
    """

    traits = None
    convention = "?"
    default_masks = ("bool",)
    is_attention = True  # False for FlexAttention's mods and serving kernels: only their own properties apply
    default_dtypes = None  # the dtypes checked unless the user names some (None: all)
    runtime: tuple[str, ...] = ()  # how its code runs, for the header (Triton's interpreter: targets.interpreter)
    left_out: dict[str, str] = {}  # dtype -> why its platform cannot run it, left out of the check (set per instance)
    gqa_contract = ""  # where grouped K/V heads are part of the convention, what tells the target: then raising fails
    gqa_grouping = ""  # where the convention fixes which KV head each query head reads (hf: "blocked"), else probed
    required: frozenset = frozenset()  # the capabilities the user requires (--require), set before the probes
    returns_weights = False  # its own API returns the weights with the output (nn.MultiheadAttention)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        traits = cls.__dict__.get("traits")
        if traits is None:
            return
        vocabulary.register(traits)
        CLASSES[traits.name] = cls
        cls.convention, cls.default_masks, cls.default_dtypes = traits.name, traits.masks, traits.dtypes
        cls.is_attention = traits.kind == "attention"

    @classmethod
    def build(cls, obj, name: str, *, masks=None, inference_only: bool = False, state=None, **keywords):
        """A target of this convention for ``obj`` (``keywords``: those of ``traits.keywords`` that were given)."""
        return cls(obj, name, masks=masks, inference_only=inference_only, **keywords)

    @staticmethod
    def detects(obj, names) -> bool:
        """Whether ``obj`` (parameter names ``names``, None if unknown) follows this convention."""
        return False

    def __init__(self, obj, name: str, masks=None, *, inference_only: bool = False):
        self.obj, self.name, self.calls, self.inference_only = obj, name, 0, inference_only
        self.masks = parse_masks(masks) or self.default_masks
        self.supported = None  # what it takes, once probed (attn_spec.targets.capabilities.supports)
        self.behaviours = None  # its probed behaviours, once probed (attn_spec.targets.behaviours)
        self.state = StateGuard()
        self.output: dict[str, dict] = {}  # phase before the checks (the import) -> captured output
        self.recorder = None  # set while a failure is replayed for its diagnosis (attn_spec.targets.record)
        self.platform_notes: dict = {}  # platform defects the kit's own formula showed on its calls (checking.platform)

    def dtypes(self, given=None) -> list[str]:
        """The dtypes checked: ``given``, else the convention's own (hf: no float64), else all; less those its
        platform cannot run (``left_out``)."""
        return [name for name in given or self.default_dtypes or DTYPES if name not in self.left_out]

    def fresh_instances(self) -> None:
        """Forget built module instances (a module keeping state between calls starts afresh); no-op here."""

    def calls_per_attend(self, case) -> int:
        """The calls into the user's code that one ``attend`` on ``case``'s tensors makes (a module: one per batch
        element); the runner tries a property's explicit examples that cost the fewest calls first."""
        return 1

    def _observe(self, kind: str, inputs: dict, thunk, label: str = "", state_key: tuple = ()):
        """``thunk()``, the call into the user's code, kept by the recorder when one is set."""
        if self.recorder is None:
            return thunk()
        return self.recorder.observe(kind, inputs, thunk, label=label, state_key=state_key)

    def attend(self, q, k, v, mask=None, *, scale=None, is_causal=False, window=None, softcap=None,
               dropout=None, alibi=None) -> torch.Tensor:
        """``scale`` and ``is_causal`` reach only targets that take them (else Unsupported); so do
        ``window`` (w keys: query i sees keys i - w < j <= i), ``softcap`` (cap * tanh(scores / cap)) and
        ``dropout`` (the probability p of dropping each weight; the kit passes 0 otherwise) and ``alibi`` (ALiBi
        slopes [H]: each head's scores gain -slope * |i + n_kv - n_q - j|, flash-attn's alibi_slopes)."""
        mask = self._mask_for_call(mask, q.dtype)
        options = {key: value for key, value in (("window", window), ("softcap", softcap), ("dropout", dropout), ("alibi", alibi))
                   if value is not None}
        for key in options:
            why = self.lacks_option(key)
            if why:
                raise Unsupported(why, total=True)
        q, k, blocks, d_v = fit_widths(self.supported, q, k, v, scale)  # a probe's widths, inside the envelope
        with torch.no_grad():
            if len(blocks) == 1 and blocks[0] is v:
                return self._attend(q, k, v, mask, scale=scale, is_causal=is_causal, **options)
            outs = [self._attend(q, k, block, mask, scale=scale, is_causal=is_causal, **options) for block in blocks]
        return torch.cat(outs, dim=-1)[..., :d_v].clone()  # [..., Tq, Dv]

    @property
    def raising_declines(self) -> tuple[str, ...]:
        """The capabilities whose probe raising means the target lacks them (attn_spec.targets.capabilities): GQA
        unless grouped K/V heads are part of the convention; the others' probes raising is a crash."""
        return () if self.gqa_contract else ("gqa",)

    def lacks_option(self, key: str) -> str | None:
        """Why this target cannot take attend()'s option ``key`` ("window", "softcap", "dropout"); None if it can."""
        if self.traits is not None and key in self.traits.options:
            return None
        return f"the {self.convention} convention takes no {OPTIONS[key]} argument"

    def notes(self) -> list[str]:
        """How the target is called, for the report's header (a detected layout, the mask HF builds for it)."""
        return []

    def options(self) -> dict:
        """The make_target keywords that rebuild this target (a reproduction snippet passes them on)."""
        return {}

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
        if self.traits is not None and not self.traits.trained:
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


