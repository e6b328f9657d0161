"""The catalog of executable attention properties (installed as ``attn_spec.properties``).

One module per family of properties, named after its ``family=`` (the serving kernels' families in the
subpackage ``serving``); :func:`catalog` imports them once and returns the catalog in :data:`ORDER`
(importing this package imports none of them). Each property is one place: its check, its docstring (math, why, what
breaks it), its lesson for ``attn-spec explain`` and, for five of them, a sympy derivation.

Each property is one function ``fn(target, case)`` that returns when the property holds and
raises :class:`attn_spec.errors.Failure` with a diagnosis when it does not (through
:mod:`attn_spec.checking.assertions` and :func:`attn_spec.failures.fail`). ``target`` is an
adapter from :mod:`attn_spec.targets.conventions` or your own function or module (wrapped with
``make_target``); ``case`` a :class:`attn_spec.checking.cases.Case`.

    >>> from attn_spec import properties
    >>> properties.catalog()["rows-sum-to-one"].statement
    'every row of weights is a distribution over the keys: non-negative, sums to 1'

In your own tests, check one case (each check is an attribute of this package), or run one property with
Hypothesis through the API, :func:`attn_spec.check_property` (an AssertionError carrying the lesson when it
does not hold; returns the result, status "pass" or "skip"):

    >>> from attn_spec.checking.cases import Case
    >>> properties.rows_sum_to_one(my_attention, Case(n_q=3, n_kv=2, d_k=2, d_v=2))
    >>> attn_spec.check_property("scale-sqrt-dk", my_attention, profile="quick", seed=0)

The catalog imports nothing above :mod:`attn_spec.checking` (tests/test_layout.py): no run, report or
diagnosis. A property names the behaviour it checks; the diagnosis words the cause.
"""
import importlib
import pkgutil

from attn_spec.checking.catalog import Property
from attn_spec.errors import KitUsageError
from attn_spec.settings import did_you_mean

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


PACKAGES = ("attn_spec.properties", "attn_spec.properties.serving")  # where the families live
_CATALOG: dict[str, Property] = {}


def catalog() -> dict[str, Property]:
    """The catalog, property id -> :class:`Property`, in :data:`ORDER`. The first call imports every family
    module (each @prop marks its check; each @derivation its derivation); later calls return the same dict."""
    if _CATALOG:
        return _CATALOG
    found, derivations = {}, {}
    for package in PACKAGES:
        for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
            if info.ispkg:
                continue
            module = importlib.import_module(f"{package}.{info.name}")
            for value in vars(module).values():
                entry = getattr(value, "property", None)
                if isinstance(entry, Property) and entry.fn.__module__ == module.__name__:
                    if found.get(entry.id, entry) is not entry:  # sanity check
                        raise ValueError(f"property id {entry.id!r} is registered twice")
                    found[entry.id] = entry
                if getattr(value, "derives", None) and value.__module__ == module.__name__:
                    derivations[value.derives] = value
    if set(found) != set(ORDER):  # sanity check: a property defined but not placed, or placed but gone
        raise ValueError(f"properties.ORDER and the defined properties differ: {sorted(set(found) ^ set(ORDER))}")
    if set(derivations) - set(found):
        raise ValueError(f"derivations of no property: {sorted(set(derivations) - set(found))}")
    _CATALOG.update({pid: found[pid].with_derivation(derivations.get(pid)) for pid in ORDER})
    # each check an attribute of this package, as its module exports it (properties.gradients: the check, not
    # the module of the same name)
    globals().update({entry.fn.__name__: getattr(importlib.import_module(entry.fn.__module__), entry.fn.__name__)
                      for entry in _CATALOG.values()})
    return _CATALOG


def __getattr__(name):  # PEP 562: a check (properties.rows_sum_to_one) loads the catalog on first use
    if not name.startswith("_") and not _CATALOG:
        catalog()
        if name in globals():
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def select(only=None, skip=None) -> list[Property]:
    """The properties to run, in catalog order; unknown ids are a usage error."""
    known = catalog()
    for ids in (only or [], skip or []):
        unknown = [i for i in ids if i not in known]
        if unknown:
            named = ", ".join(f"{i}{did_you_mean(i, known)}" for i in unknown)
            raise KitUsageError(f"unknown property id(s): {named}; known: {', '.join(known)}")
    return [p for p in known.values() if (not only or p.id in only) and p.id not in (skip or [])]
