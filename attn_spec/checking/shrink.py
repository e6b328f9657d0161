"""Shrinking a failing explicit example, which Hypothesis never does (and, at the quick profile, every failure).

Hypothesis shrinks the cases it draws, never an explicit example (``@example``). A property's
hand-picked cases run first because they catch most bugs in a call or two, and the one that catches
the most goes first (matches-reference's batched, masked, heads-split case: ``Q [2, 3, 3, 2]``). Left
as it is, a bug that a plain ``[1, 2]`` case shows too would be shown on that larger case. So when an
explicit example fails, the kit shrinks it itself, greedily, as Hypothesis would:

- it tries cases one step smaller (seed 0; no batch dims, one dim fewer, a dim of 1; no mask; the
  contiguous layout; one query, key or width, or one fewer; integer entries; magnitude 1), the largest
  step first;
- it keeps the first that fails in the same way and starts again from it: the same kind of Failure,
  vacuous or not, and the same cause whatever numbers it measured (at d_k = 1 a missing 1/sqrt(d_k)
  cannot show, and a float32 precision loss reads as that; a smaller case that shows another cause
  teaches less); for an exception of the target's, the same exception type;
- it stops when no step fails, or after ``TRIES`` tries.

At the quick profile (``Profile.shrinker == "kit"``) a drawn case that fails is shrunk here too, in place of
Hypothesis's shrinker: a few dozen candidates instead of hundreds, each a whole property call. Not a serving
kernel's: the steps below know no cache lengths, pages or segments, which Hypothesis shrinks.

Each candidate is one the property's strategy could draw (its case options and what the target takes:
cross, batch, min_n_kv, masks, fitted by :func:`attn_spec.checking.fitting.fit_case`). A candidate that
is unsupported, uninformative or lost to a platform defect does not fail. The calls shrinking makes
come after the failure was found, so they are not counted in the calls to the first failure (neither
are Hypothesis's), nor are those its causes make.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator

from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.platform import judge
from attn_spec.errors import Failure, TargetRaised

NUMBER = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:e[-+]?\d+)?")
TRIES = 40  # candidates run at most: a few per field of a case


def shrink(prop, target, failure: Failure, options: dict, fit: Callable) -> Failure:
    """The failure of the smallest case found (its ``attn_case``): ``failure`` is ``prop``'s on ``target``, on the
    case ``failure.attn_case``.
    ``options``: the property's case options with those fitted to the target (what its strategy draws from);
    ``fit``: makes a candidate one the target takes (fitting.fit_case with the fitted options)."""
    seen, tries, smallest = {failure.attn_case}, 0, failure
    progress = True
    while progress and tries < TRIES:
        progress = False
        for candidate in _smaller(smallest.attn_case, options):
            candidate = fit(candidate)
            if candidate in seen or not _drawable(candidate, options):
                continue
            seen.add(candidate)
            tries += 1
            found = _failure(prop, target, candidate, failure)
            if found is not None:
                found.attn_case, smallest, progress = candidate, found, True
                break
            if tries >= TRIES:
                break
    return smallest


def _failure(prop, target, case, like: Failure) -> Failure | None:
    """``prop``'s failure on ``case`` if it fails like ``like``, else None."""
    try:
        judge(prop, target, case)
    except Failure as failure:
        return failure if _alike(failure, like) else None
    except Exception:  # noqa: BLE001 - unsupported, uninformative, a platform defect: this candidate does not fail
        return None
    return None


def _alike(a: Failure, b: Failure) -> bool:
    """The same failure: the same class, vacuous or not, the same cause (a smaller case that shows another, such as
    every key masked where the mask was inverted, teaches less), and for an exception of the target's, its type."""
    if type(a) is not type(b) or a.vacuous != b.vacuous or _words(a.cause) != _words(b.cause):
        return False
    return not isinstance(a, TargetRaised) or type(a.exc) is type(b.exc)


def _words(cause: str) -> str:
    """A cause without the numbers it measured ("error 3e-07, budget 7e-15"): the same cause on another case."""
    return NUMBER.sub("#", cause)


def _fewer(n: int, least: int = 1) -> list[int]:
    """The sizes to try below ``n``: the least first, then one fewer."""
    return list(dict.fromkeys(m for m in (least, n - 1) if least <= m < n))


def _smaller(case, options: dict) -> Iterator:
    """Cases one step smaller than ``case``, the largest step first (constraints are checked by the caller)."""
    if isinstance(case, MhaCase):
        yield from _smaller_mha(case)
        return
    if type(case) is not Case or case.segments:  # a packed batch keeps its segments: they are the case
        return
    if case.seed:  # Hypothesis shrinks a seed towards 0: other values, as often telling
        yield case.replace(seed=0)
    cross = options.get("cross")
    if case.batch and not case.kv_heads:  # grouped heads tie the last batch dim to kv_heads
        yield case.replace(batch=(), layout="contiguous")
        for i in range(len(case.batch)):
            yield case.replace(batch=case.batch[:i] + case.batch[i + 1:])
        for i, n in enumerate(case.batch):
            for m in _fewer(n):
                yield case.replace(batch=case.batch[:i] + (m,) + case.batch[i + 1:])
    if case.mask != "none":
        yield case.replace(mask="none")
    if case.layout != "contiguous":
        yield case.replace(layout="contiguous")
    least_kv = options.get("min_n_kv", 1)
    if cross is False:  # self-attention shapes: n_q = n_kv, d_v = d_k
        for n in _fewer(case.n_q, least_kv):
            yield case.replace(n_q=n, n_kv=n)
        for d in _fewer(case.d_k):
            yield case.replace(d_k=d, d_v=d)
    else:
        for field, least in (("n_q", 1), ("n_kv", least_kv), ("d_k", 1), ("d_v", 1)):
            for n in _fewer(getattr(case, field), least):
                yield case.replace(**{field: n})
    if case.values != "integers":
        yield case.replace(values="integers")
    if case.magnitude != 1.0:
        yield case.replace(magnitude=1.0)


def _smaller_mha(case: MhaCase) -> Iterator[MhaCase]:
    d_head = case.d_model // case.n_heads
    if case.seed:
        yield case.replace(seed=0)
    if case.mask != "none":
        yield case.replace(mask="none")
    for h in _fewer(case.n_heads):
        yield case.replace(n_heads=h, d_model=d_head * h)
    for n in _fewer(case.n_q):
        yield case.replace(n_q=n, n_kv=n) if case.self_attention else case.replace(n_q=n)
    if not case.self_attention:
        for n in _fewer(case.n_kv):
            yield case.replace(n_kv=n)
    for d in _fewer(d_head):
        yield case.replace(d_model=d * case.n_heads)


def _drawable(case, options: dict) -> bool:
    """Whether the property's strategy, with its case options, could draw ``case``."""
    if case.mask not in options.get("masks", (case.mask,)):
        return False
    if not isinstance(case, Case):
        return True
    batch, cross = options.get("batch"), options.get("cross")
    if (batch is True and not case.batch) or (batch is False and case.batch):
        return False
    if cross is True and (case.n_q == case.n_kv or case.d_k == case.d_v):
        return False
    if cross is False and (case.n_q != case.n_kv or case.d_k != case.d_v):
        return False
    if len(case.batch) < 2 and case.layout != "contiguous":
        return False
    return case.n_kv >= options.get("min_n_kv", 1)
