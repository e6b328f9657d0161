"""The catalog of executable attention properties (installed as ``attn_spec.properties``).

One module per family of properties; each property is one place: its check, its docstring (math,
why, what breaks it), its lesson for ``attn-spec explain`` and, for five of them, a sympy derivation.

Each property is one function ``fn(target, case)`` that returns when the property holds and
raises :class:`attn_spec.errors.Failure` with a diagnosis when it does not (through
:mod:`attn_spec.checking.assertions`). ``target`` is an
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
import random

from attn_spec.checking.catalog import REGISTRY, Property
from attn_spec.checking.cases import DTYPES, available_devices
from attn_spec.checking.runner import run_property
from attn_spec.diagnosis.run import diagnose_one
from attn_spec.checking.strategies import get_profile
from attn_spec.errors import KitUsageError
from attn_spec.report import render
from attn_spec.settings import did_you_mean
from attn_spec.targets.conventions import Target, make_target, parse_masks

# Import order is catalog order: the basic, decisive properties first.
from attn_spec.properties.core import (causal_mask, permutation_equivariance, rows_sum_to_one,  # noqa: I001
                                       scale_sqrt_dk)
from attn_spec.properties.output import cross_attention_shapes, head_concat_equivalence, matches_reference
from attn_spec.properties.masking import batch_independence, mask_semantics
from attn_spec.properties.numerics import key_shift_invariance, numerical_stability, value_linearity
from attn_spec.properties.robustness import (determinism, dtype_device, gqa_equivalence, inputs_unchanged,
                                             long_sequences, non_contiguous)
from attn_spec.properties.gradients import gradients
from attn_spec.properties.arguments import is_causal, scale_argument
from attn_spec.properties.windows import sliding_window, softcap
from attn_spec.properties.mods import mask_mod_rows, mask_mod_statement, score_mod_statement
from attn_spec.properties.devices import devices_agree
from attn_spec.properties.decode import append_writes_exactly, cache_outside_invariance, decode_equals_full_causal
from attn_spec.properties.merge import merge_empty_neutral, merge_equals_union
from attn_spec.properties.paged import (paged_append_writes_exactly, paged_capacity_contract,  # noqa: I001
                                        paged_equals_contiguous, paged_outside_invariance)
from attn_spec.properties.prefill import chunked_prefill_equals_one_shot
from attn_spec.properties.dropout import dropout_mask, dropout_mean
from attn_spec.properties.alibi import alibi_slopes
from attn_spec.properties.varlen import segment_isolation, varlen_degenerate_lengths, varlen_equals_per_sequence

__all__ = ["REGISTRY", "Property", "select", "check_property",
           "rows_sum_to_one", "causal_mask", "permutation_equivariance", "scale_sqrt_dk", "cross_attention_shapes",
           "head_concat_equivalence", "matches_reference", "mask_semantics", "batch_independence",
           "value_linearity", "key_shift_invariance", "numerical_stability", "determinism", "inputs_unchanged",
           "dtype_device", "non_contiguous", "long_sequences", "gqa_equivalence", "gradients",
           "scale_argument", "is_causal", "sliding_window", "softcap", "mask_mod_statement", "mask_mod_rows",
           "score_mod_statement", "devices_agree", "decode_equals_full_causal", "cache_outside_invariance",
           "append_writes_exactly", "merge_equals_union", "merge_empty_neutral",
           "paged_equals_contiguous", "paged_outside_invariance", "paged_append_writes_exactly",
           "paged_capacity_contract", "chunked_prefill_equals_one_shot", "dropout_mask", "dropout_mean", "alibi_slopes",
           "varlen_equals_per_sequence", "segment_isolation", "varlen_degenerate_lengths"]


def select(only=None, skip=None) -> list[Property]:
    """The properties to run, in catalog order; unknown ids are a usage error."""
    for ids in (only or [], skip or []):
        unknown = [i for i in ids if i not in REGISTRY]
        if unknown:
            named = ", ".join(f"{i}{did_you_mean(i, REGISTRY)}" for i in unknown)
            raise KitUsageError(f"unknown property id(s): {named}; known: {', '.join(REGISTRY)}")
    return [p for p in REGISTRY.values() if (not only or p.id in only) and p.id not in (skip or [])]


def check_property(property_id: str, target, *, convention=None, profile="default", seed=None, dtypes=None,
                   devices=None, masks=None):
    """Run one property with Hypothesis on ``target``; AssertionError with the lesson if it does not hold.

    ``target`` is your function or module (any convention; ``convention=`` when it cannot be
    detected) or an adapter. ``masks=("bool", "additive")`` declares that it takes additive float
    masks too. ``seed=None`` draws a random seed; the failure text names it.
    Returns the :class:`attn_spec.report.PropertyResult` (status "pass", or "skip" with the reason
    in ``message`` when the property does not apply to the target).
    """
    get_profile(profile)
    prop = select(only=[property_id])[0]
    adapter = target if isinstance(target, Target) else make_target(target, convention=convention, masks=masks)
    adapter.masks = parse_masks(masks) or adapter.masks
    seed = random.randrange(2**32) if seed is None else seed
    dtypes = list(dtypes or adapter.default_dtypes or DTYPES)
    result = run_property(prop, adapter, profile=profile, seed=seed, dtypes=dtypes,
                          devices=list(devices or available_devices()))
    if result.status in ("fail", "error"):
        raise AssertionError(render(result, "text", diagnosis=diagnose_one(adapter, result, REGISTRY), traceback=True))
    return result
