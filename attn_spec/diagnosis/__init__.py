"""Differential diagnosis: name the bug behind a target's failures by replaying mistake models.

- :mod:`~attn_spec.diagnosis.model`: the ``Mistake`` record, ``@mistake`` and the building blocks;
- :mod:`~attn_spec.diagnosis.mistakes`, ``mistakes_code``, ``mistakes_module``: the catalog;
- :mod:`~attn_spec.diagnosis.record`: the calls a replayed failure made;
- :mod:`~attn_spec.diagnosis.replay`: which models reproduce them.
"""
from attn_spec.diagnosis import mistakes, mistakes_code, mistakes_module  # noqa: F401 - registers the catalog
from attn_spec.diagnosis.model import MISTAKES, Mistake

__all__ = ["MISTAKES", "Mistake"]
