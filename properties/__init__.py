"""The catalog of executable attention properties (installed as ``attn_spec.properties``).

Each property is one function ``fn(target, case)`` that returns when the property holds and
raises :class:`attn_spec.errors.Failure` with a diagnosis when it does not. ``target`` is an
adapter from :mod:`attn_spec.adapters`; ``case`` a :class:`attn_spec.cases.Case`.

    >>> from attn_spec import properties
    >>> properties.REGISTRY["rows-sum-to-one"].statement
    'every row of weights is a distribution over the keys: non-negative, sums to 1'
"""
from attn_spec.catalog import REGISTRY, Property
from attn_spec.properties.arguments import is_causal, scale_argument
from attn_spec.properties.core import (causal_mask, cross_attention_shapes, head_concat_equivalence,
                                       matches_reference, permutation_equivariance, rows_sum_to_one,
                                       scale_sqrt_dk)

__all__ = ["REGISTRY", "Property", "is_causal", "scale_argument", "causal_mask", "cross_attention_shapes", "head_concat_equivalence",
           "matches_reference", "permutation_equivariance", "rows_sum_to_one", "scale_sqrt_dk"]
