"""Differential diagnosis: name the bug behind a target's failures by replaying mistake models.

- :mod:`~attn_spec.diagnosis.model`: the ``Mistake`` record, ``@mistake`` and the building blocks;
- :mod:`~attn_spec.diagnosis.mistakes`, ``mistakes_masks``, ``mistakes_code``, ``mistakes_ecosystem``,
  ``mistakes_module``, ``mistakes_dropout``, ``mistakes_alibi``, ``serving``, ``serving_paged``, ``serving_lse``: the catalog
  (``MISTAKES``, one record type for every level, serving kernels' included);
- :mod:`~attn_spec.targets.record` (beside the calls it records): the calls a replayed failure made;
- :mod:`~attn_spec.diagnosis.predict`: what a model does on one call;
- :mod:`~attn_spec.diagnosis.replay`: which models reproduce the calls of a failure;
- :mod:`~attn_spec.diagnosis.evidence`, ``roots``, ``run``: replays, one root per bug, the report;
- :mod:`~attn_spec.diagnosis.causes` (with ``causes_formula``, ``causes_code``): the words of every cause the
  catalog names (``because("key", **facts)``); ``numbers``: causes read from a property's numbers; ``mask_mods``:
  the wrong mask_mods of an --expect-mask statement;
- :mod:`~attn_spec.diagnosis.measured`: roots the calls show by themselves (no tensor back, K transposed
  over the wrong axes);
- :mod:`~attn_spec.diagnosis.passing`: a model must agree with the calls of the properties that passed;
- :mod:`~attn_spec.diagnosis.fits`: measured fits on purpose-built calls (the scale against the shapes, the
  normaliser, batch mixing) for bugs no model catalogues;
- :mod:`~attn_spec.diagnosis.fold`: a root whose failures another root's model reproduces (at the target's own
  dtype, with emptied rows left NaN) is a symptom, folded into its cause;
- :mod:`~attn_spec.diagnosis.discriminate`: a second probe where tied models fit every failing call.
"""
# Import order is catalog order: the formula (scale, softmax, positions, shapes, values), masks, the code
# around it, the ecosystem's options and layouts, multi-head plumbing, backward passes and state, then the serving
# kernels (contiguous caches before paged ones: the first model that fits is named).
from attn_spec.diagnosis import mistakes, mistakes_masks, mistakes_code  # noqa: F401,I001
from attn_spec.diagnosis import mistakes_ecosystem, mistakes_module, mistakes_dropout  # noqa: F401,I001
from attn_spec.diagnosis import mistakes_alibi, serving, serving_paged, serving_lse  # noqa: F401,I001
from attn_spec.diagnosis.model import MISTAKES, Mistake

__all__ = ["MISTAKES", "Mistake"]
