"""The catalog of executable attention properties (installed as ``attn_spec.properties``).

One module per family of properties, named after its ``family=`` (every module here is imported, and
the catalog put in :data:`ORDER`); each property is one place: its check, its docstring (math, why, what
breaks it), its lesson for ``attn-spec explain`` and, for five of them, a sympy derivation.

Each property is one function ``fn(target, case)`` that returns when the property holds and
raises :class:`attn_spec.errors.Failure` with a diagnosis when it does not (through
:mod:`attn_spec.checking.assertions` and :func:`attn_spec.failures.fail`). ``target`` is an
adapter from :mod:`attn_spec.targets.conventions` or your own function or module (wrapped with
``make_target``); ``case`` a :class:`attn_spec.checking.cases.Case`.

    >>> from attn_spec import properties
    >>> properties.REGISTRY["rows-sum-to-one"].statement
    'every row of weights is a distribution over the keys: non-negative, sums to 1'

In your own tests, check one case, or run one property with Hypothesis (an AssertionError
carrying the lesson when it does not hold; returns the result, status "pass" or "skip"):

    >>> from attn_spec.checking.cases import Case
    >>> properties.rows_sum_to_one(my_attention, Case(n_q=3, n_kv=2, d_k=2, d_v=2))
    >>> properties.check_property("scale-sqrt-dk", my_attention, profile="quick", seed=0)
"""
import importlib
import pkgutil
import random
import sys

from attn_spec.checking.catalog import REGISTRY, Property
from attn_spec.checking.strategies import get_profile
from attn_spec.errors import KitUsageError
from attn_spec.report import render
from attn_spec.run import Run
from attn_spec.settings import did_you_mean
from attn_spec.targets.conventions import Target, make_target, parse_masks
from attn_spec.targets.deadline import timeout

# The catalog's order, public in every report and in `attn-spec list`: the basic, decisive properties
# first, the serving kernels' own last. Each id is defined in the module of its family (family= in @prop).
ORDER = ("rows-sum-to-one", "causal-mask", "permutation-equivariance", "scale-sqrt-dk", "cross-attention-shapes",
         "head-concat-equivalence", "matches-reference", "mask-semantics", "batch-independence", "value-linearity",
         "key-shift-invariance", "numerical-stability", "determinism", "inputs-unchanged", "dtype-device",
         "non-contiguous", "long-sequences", "gqa-equivalence", "gradients", "scale-argument", "is-causal",
         "sliding-window", "softcap", "mask-mod-statement", "mask-mod-rows", "score-mod-statement", "devices-agree",
         "dropout-mask", "dropout-mean", "alibi-slopes",
         "decode-equals-full-causal", "cache-outside-invariance", "append-writes-exactly", "merge-equals-union",
         "merge-empty-neutral", "paged-equals-contiguous", "paged-outside-invariance", "paged-append-writes-exactly",
         "paged-capacity-contract", "chunked-prefill-equals-one-shot", "split-kv-agree",
         "varlen-equals-per-sequence", "segment-isolation", "varlen-degenerate-lengths", "lse-equals-logsumexp")


def _register_the_catalog() -> list[str]:
    """Import every module of this package (each family's @prop registers its properties), put REGISTRY in
    ORDER, and make each property's check an attribute of the package; returns the checks' names in order."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    if set(REGISTRY) != set(ORDER):  # sanity check: a property registered but not placed, or placed but gone
        raise ValueError(f"properties.ORDER and the registered properties differ: "
                         f"{sorted(set(REGISTRY) ^ set(ORDER))}")
    ordered = {pid: REGISTRY[pid] for pid in ORDER}
    REGISTRY.clear()
    REGISTRY.update(ordered)
    names = []
    for entry in REGISTRY.values():  # the check as its module exports it: it wraps a plain function or module
        names.append(entry.fn.__name__)
        globals()[entry.fn.__name__] = getattr(sys.modules[entry.fn.__module__], entry.fn.__name__)
    return names


__all__ = ["REGISTRY", "Property", "ORDER", "select", "check_property", *_register_the_catalog()]


def select(only=None, skip=None) -> list[Property]:
    """The properties to run, in catalog order; unknown ids are a usage error."""
    for ids in (only or [], skip or []):
        unknown = [i for i in ids if i not in REGISTRY]
        if unknown:
            named = ", ".join(f"{i}{did_you_mean(i, REGISTRY)}" for i in unknown)
            raise KitUsageError(f"unknown property id(s): {named}; known: {', '.join(REGISTRY)}")
    return [p for p in REGISTRY.values() if (not only or p.id in only) and p.id not in (skip or [])]


def check_property(property_id: str, target, *, convention=None, profile="default", seed=None, dtypes=None,
                   devices=None, masks=None, call_timeout=None):
    """Run one property with Hypothesis on ``target``; AssertionError with the lesson if it does not hold.

    ``target`` is your function or module (any convention; ``convention=`` when it cannot be
    detected) or an adapter. ``masks=("bool", "additive")`` declares that it takes additive float
    masks too. ``seed=None`` draws a random seed; the failure text names it. ``call_timeout``: seconds a
    call into the target may take on a small case (default 10; 0: none), as ``attn-spec check --call-timeout``.
    Returns the :class:`attn_spec.report.PropertyResult` (status "pass", or "skip" with the reason
    in ``message`` when the property does not apply to the target).
    """
    get_profile(profile)
    prop = select(only=[property_id])[0]
    with timeout(call_timeout):  # the layout probe's calls
        adapter = target if isinstance(target, Target) else make_target(target, convention=convention, masks=masks)
    adapter.masks = parse_masks(masks) or adapter.masks
    seed = random.randrange(2**32) if seed is None else seed
    run = Run(profile, seed, list(dtypes) if dtypes else None, list(devices) if devices else None,
              call_timeout=call_timeout)
    result, diagnosis, _ = run.property(prop, adapter)
    if result.status in ("fail", "error"):
        raise AssertionError(render(result, "text", diagnosis=diagnosis, traceback=True))
    return result
