"""What a catalog entry is: ``@prop`` turns one small function into a :class:`Property`.

A property is one place: its check (the function), its docstring (the math, "Why:" and
"Catches:"), its :class:`Lesson` (the rest of what ``attn-spec explain`` teaches) and, for some,
a sympy derivation marked with ``@derivation``. Derivations import sympy inside the function:
importing the catalog must stay cheap.

No registry here: ``@prop`` and ``@derivation`` mark the functions, and the catalog
(:func:`attn_spec.properties.catalog`, above this package) gathers them; the engine is handed the
properties it runs.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from typing import Callable

from attn_spec.checking import strategies
from attn_spec.targets.conventions import Target, conventions, make_target
from attn_spec.checking.cases import Case, MhaCase


@dataclass(frozen=True)
class Lesson:
    """What ``attn-spec explain`` adds to a property's docstring (see :mod:`attn_spec.lessons`).

    ``unicode``/``latex``: the statement typeset for a terminal and for markdown; ``check``: how the
    kit checks it on a black box; ``example``: the key of the live worked example in
    ``attn_spec.lessons.EXAMPLES``; ``why``: used only when the docstring has no "Why:" paragraph.
    """

    unicode: str
    latex: str
    check: str
    example: str
    why: str = ""


@dataclass(frozen=True)
class Property:
    """One executable property: ``fn(target, case)`` returns on success, raises Failure otherwise."""

    id: str
    fn: Callable
    family: str
    statement: str
    only_for: tuple[str, ...]  # the conventions it applies to; empty: every attention convention, those registered later too
    case_options: dict = field(default_factory=dict)  # keyword arguments for the case strategy
    multihead: bool | str = False  # True: draws MhaCase; "module": MhaCase for multi-head conventions
    examples: tuple = ()  # explicit cases, tried first, before anything random
    after: tuple[str, ...] = ()  # properties whose failure explains (blocks) this one
    lesson: Lesson | None = None
    # At fixed shapes (--shapes, the scale profile; see attn_spec.checking.shapes): the cases to check
    # there, {"masks": (...), "grouped": bool}, or why the property does not apply at such sizes.
    at_scale: dict | str | None = None
    # A multi-head property's projections: "drawn" (random W_Q..W_O, shown in a counterexample) or "identity"
    # (a probe reading one head through projections that select Q, K and V; the module header says which).
    projections: str = "drawn"
    long_examples: tuple = ()  # explicit cases tried last, in the profiles that check long cases (Profile.long)
    derivation: Callable[[], list] | None = None  # the sympy derivation of the fact behind it (returns the steps)

    @property
    def conventions(self) -> tuple[str, ...]:
        """The conventions it applies to, now: ``only_for``, or every registered attention convention."""
        return self.only_for or conventions(kind="attention")

    def with_derivation(self, derive: Callable[[], list] | None) -> "Property":
        """This property with its derivation (the catalog pairs them when it loads)."""
        return dataclasses.replace(self, derivation=derive) if derive is not None else self

    @property
    def doc(self) -> str:
        return inspect.getdoc(self.fn) or ""

    def uses_multihead(self, convention: str) -> bool:
        """True: always MhaCase; "module": MhaCase for every multi-head convention (module, torch-mha, adapter)."""
        return self.multihead is True or (self.multihead == "module"
                                          and convention in conventions(kind="attention", multihead=True))

    def strategy(self, profile, convention: str, *, dtypes=None, devices=None, fitted=None):
        """The case strategy for one target convention, restricted to the requested dtypes/devices
        (and ``fitted``: options that draw only what the target takes, see attn_spec.checking.fitting)."""
        options = dict(self.case_options, **(fitted or {}))
        wanted = options.pop("dtypes", None)
        if dtypes is not None and wanted is not None:
            wanted = tuple(d for d in wanted if d in dtypes) or tuple(dtypes)
        make = strategies.mha_cases if self.uses_multihead(convention) else strategies.cases
        if make is strategies.mha_cases:
            options = {key: val for key, val in options.items() if key in ("masks", "max_length")}
        return make(profile, dtypes=wanted or dtypes or tuple(strategies.DTYPES), devices=devices, **options)

    def examples_for(self, convention: str, *, long: bool = False):
        """The explicit examples (``long``: the long examples instead) that fit this convention's case type."""
        kind = MhaCase if self.uses_multihead(convention) else Case
        return [ex for ex in (self.long_examples if long else self.examples) if isinstance(ex, kind)]

    def __call__(self, target, case):
        """Check one case; ``target`` is an adapter or the user's own function/module (wrapped here)."""
        return self.fn(target if isinstance(target, Target) else make_target(target), case)


def prop(id: str, *, family: str, statement: str, conventions=(), cases=None,
         multihead=False, examples=(), after=(), lesson: Lesson | None = None, at_scale=None,
         projections="drawn", long_examples=()):
    """Make ``fn`` the property ``id`` (stable, kebab-case: a public contract); the returned check carries it as
    ``.property`` for the catalog to gather. ``conventions``: those it applies to (default: every attention
    convention, attn_spec.vocabulary)."""

    def register(fn):
        entry = Property(id, fn, family, statement, tuple(conventions), dict(cases or {}),
                                        multihead, tuple(examples), tuple(after), lesson, at_scale, projections,
                                        tuple(long_examples))

        @functools.wraps(fn)
        def check_case(target, case):  # properties.rows_sum_to_one(my_attention, case) works too
            return entry(target, case)

        check_case.property_id, check_case.property = id, entry
        return check_case

    return register


def derivation(id: str):
    """Mark ``fn`` as the sympy derivation of property ``id`` (the catalog pairs them): it returns its steps, a
    list of ``(text, sympy expression)``, and raises ``attn_spec.symbolic.DerivationError`` if a step fails."""

    def register(fn):
        fn.derives = id
        return fn

    return register
