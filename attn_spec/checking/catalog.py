"""The property registry: ``@prop`` turns one small function into a catalog entry."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

from attn_spec.checking import strategies
from attn_spec.targets.conventions import CONVENTIONS, MULTIHEAD_CONVENTIONS, Target, make_target
from attn_spec.checking.cases import Case, MhaCase

REGISTRY: dict[str, "Property"] = {}


@dataclass(frozen=True)
class Property:
    """One executable property: ``fn(target, case)`` returns on success, raises Failure otherwise."""

    id: str
    fn: Callable
    family: str
    statement: str
    conventions: tuple[str, ...]
    case_options: dict = field(default_factory=dict)  # keyword arguments for the case strategy
    multihead: bool | str = False  # True: draws MhaCase; "module": MhaCase for multi-head conventions
    examples: tuple = ()  # explicit cases, tried first, before anything random
    after: tuple[str, ...] = ()  # properties whose failure explains (blocks) this one

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.fn) or ""

    def uses_multihead(self, convention: str) -> bool:
        """True: always MhaCase; "module": MhaCase for every multi-head convention (module, torch-mha, adapter)."""
        return self.multihead is True or (self.multihead == "module" and convention in MULTIHEAD_CONVENTIONS)

    def strategy(self, profile, convention: str, *, dtypes=None, devices=None):
        """The case strategy for one target convention, restricted to the requested dtypes/devices."""
        options = dict(self.case_options)
        wanted = options.pop("dtypes", None)
        if dtypes is not None and wanted is not None:
            wanted = tuple(d for d in wanted if d in dtypes) or tuple(dtypes)
        make = strategies.mha_cases if self.uses_multihead(convention) else strategies.cases
        if make is strategies.mha_cases:
            options = {key: val for key, val in options.items() if key in ("masks",)}
        return make(profile, dtypes=wanted or dtypes or tuple(strategies.DTYPES), devices=devices, **options)

    def examples_for(self, convention: str):
        """The explicit examples that fit this convention's case type."""
        kind = MhaCase if self.uses_multihead(convention) else Case
        return [ex for ex in self.examples if isinstance(ex, kind)]

    def __call__(self, target, case):
        """Check one case; ``target`` is an adapter or the user's own function/module (wrapped here)."""
        return self.fn(target if isinstance(target, Target) else make_target(target), case)


def prop(id: str, *, family: str, statement: str, conventions=CONVENTIONS, cases=None,
         multihead=False, examples=(), after=()):
    """Register ``fn`` under ``id`` (stable, kebab-case: a public contract)."""

    def register(fn):
        if id in REGISTRY:
            raise ValueError(f"property id {id!r} is registered twice")  # sanity check
        entry = REGISTRY[id] = Property(id, fn, family, statement, tuple(conventions), dict(cases or {}),
                                        multihead, tuple(examples), tuple(after))

        @functools.wraps(fn)
        def check_case(target, case):  # properties.rows_sum_to_one(my_attention, case) works too
            return entry(target, case)

        check_case.property_id = id
        return check_case

    return register
