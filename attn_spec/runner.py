"""Run the catalog against a target with Hypothesis and collect a Report."""
from __future__ import annotations

import dataclasses
import random
import time
import traceback

from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Flaky

from attn_spec import __version__
from attn_spec.adapters import Target, make_target
from attn_spec.cases import DTYPES, available_devices
from attn_spec.catalog import REGISTRY, Property
from attn_spec.errors import Failure, TargetRaised, Unsupported
from attn_spec.report import PropertyResult, Report, TargetReport, format_matrix, tensor_to_data
from attn_spec.strategies import KitUsageError, get_profile


def select(only=None, skip=None) -> list[Property]:
    """The properties to run, in catalog order; unknown ids are a usage error."""
    import attn_spec.properties  # noqa: F401 - registers the catalog

    for ids in (only or [], skip or []):
        unknown = [i for i in ids if i not in REGISTRY]
        if unknown:
            raise KitUsageError(f"unknown property id(s): {', '.join(unknown)}; known: {', '.join(REGISTRY)}")
    return [p for p in REGISTRY.values() if (not only or p.id in only) and p.id not in (skip or [])]


def _snippet(prop: Property, case, target_name: str, convention: str, seed: int) -> str:
    fields = ", ".join(f"{f.name}={getattr(case, f.name)!r}" for f in dataclasses.fields(case)
                       if getattr(case, f.name) != f.default)
    kind = type(case).__name__
    return (f"# attn-spec check {target_name} --only {prop.id} --seed {seed}\n"
            f"import attn_spec\nfrom attn_spec.cases import {kind}\n"
            f"case = {kind}({fields})\n"
            f"attn_spec.reproduce({prop.id!r}, {target_name!r}, case, convention={convention!r})")


def _counterexample(prop, failure: Failure, case, target: Target, seed: int) -> dict:
    ce = {"case": dataclasses.asdict(case), "summary": case.summary(),
          "got": tensor_to_data(failure.got), "expected": tensor_to_data(failure.expected),
          "got_text": None if failure.got is None else format_matrix(failure.got),
          "expected_text": None if failure.expected is None else format_matrix(failure.expected),
          "seed": seed, "reproduce": _snippet(prop, case, target.name, target.convention, seed)}
    if isinstance(failure, TargetRaised):
        ce["traceback"] = failure.user_traceback
    return ce


def run_property(prop: Property, target: Target, *, profile: str, seed: int, dtypes, devices) -> PropertyResult:
    """Run one property: explicit examples first, then random cases, shrinking any failure."""
    result = PropertyResult(prop.id, "pass", statement=prop.statement)
    if target.convention not in prop.conventions:
        result.status, result.message = "skip", f"does not apply to the {target.convention} convention"
        return result
    prof = get_profile(profile)
    skip_reason = []

    def body(case):
        if skip_reason:
            return
        result.examples += 1
        try:
            prop.fn(target, case)
        except Unsupported as exc:
            skip_reason.append(str(exc))
        except BaseException as exc:
            exc.attn_case = case
            raise

    test = given(prop.strategy(prof, target.convention, dtypes=dtypes, devices=devices))(body)
    for case in reversed(prop.examples_for(target.convention)):
        if case.dtype in dtypes and case.device in devices:
            test = example(case)(test)
    test = settings(max_examples=prof.max_examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
                    phases=(Phase.explicit, Phase.generate, Phase.shrink), verbosity=Verbosity.quiet)(test)
    start = time.perf_counter()
    try:
        hypothesis_seed(seed)(test)()
    except Failure as failure:
        result.status, result.message, result.cause = "fail", failure.message, failure.cause
        result.counterexample = _counterexample(prop, failure, failure.attn_case, target, seed)
    except Flaky as exc:
        result.status = "fail"
        result.message = f"the target gave different results for the same input ({type(exc).__name__})"
        result.cause = "the attention is nondeterministic (dropout or randomness left on?)"
    except Exception as exc:  # noqa: BLE001 - a bug in the kit itself, reported, never hidden
        result.status = "error"
        result.message = f"internal error in attn-spec: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    result.seconds = time.perf_counter() - start
    if skip_reason and result.status == "pass":
        result.status, result.message = "skip", skip_reason[0]
    return result


def _mark_blocked(results: list[PropertyResult]) -> None:
    """A failure explained by an earlier property's failure is reported as blocked by it."""
    failed = {r.id for r in results if r.status == "fail"}
    for r in results:
        if r.status == "fail":
            blockers = [b for b in REGISTRY[r.id].after if b in failed]
            r.blocked_by = blockers[0] if blockers else None


def check_target(target: Target, *, profile="default", seed=0, only=None, skip=None, dtypes=None,
                 devices=None, progress=None) -> TargetReport:
    props = select(only, skip)
    report = TargetReport(target.name, target.convention)
    for i, prop in enumerate(props):
        if progress:
            progress(f"{target.name}: [{i + 1}/{len(props)}] {prop.id}")
        report.properties.append(run_property(prop, target, profile=profile, seed=seed,
                                              dtypes=dtypes or list(DTYPES), devices=devices or available_devices()))
    _mark_blocked(report.properties)
    report.calls = target.calls
    return report


def check(*targets, name=None, convention=None, profile="default", seed=None, only=None, skip=None,
          dtypes=None, devices=None, progress=None) -> Report:
    """Check attention functions or modules against the catalog; returns a :class:`Report`.

    >>> report = attn_spec.check(my_attention, profile="quick")
    >>> report.conforms, print(report)
    """
    get_profile(profile)
    seed = random.randrange(2**32) if seed is None else seed
    dtypes, devices = list(dtypes or DTYPES), list(devices or available_devices())
    reports = []
    for obj in targets:
        target = obj if isinstance(obj, Target) else make_target(obj, name if len(targets) == 1 else None, convention)
        reports.append(check_target(target, profile=profile, seed=seed, only=only, skip=skip, dtypes=dtypes,
                                    devices=devices, progress=progress))
    return Report(reports, __version__, profile, seed, devices=devices, dtypes=dtypes)


def reproduce(property_id: str, target, case, *, convention=None) -> None:
    """Run one property on one case; raises the Failure (with its diagnosis) if it does not hold."""
    from attn_spec.loading import load_target

    prop = select(only=[property_id])[0]
    obj = load_target(target) if isinstance(target, str) else target
    adapter = obj if isinstance(obj, Target) else make_target(obj, target if isinstance(target, str) else None,
                                                               convention)
    try:
        prop.fn(adapter, case)
    except Failure as failure:
        note = f"likely cause: {failure.cause}" if failure.cause else ""
        raise Failure(f"{property_id}: {failure.message}\n{note}", cause=failure.cause, got=failure.got,
                      expected=failure.expected) from None
    print(f"{property_id} holds on {case.summary()}")
