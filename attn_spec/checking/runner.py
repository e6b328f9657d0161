"""Run properties against a target with Hypothesis and collect its TargetReport.

The diagnosis of what failed comes after, above this floor (attn_spec.run.Run runs, then diagnoses)."""
from __future__ import annotations

import contextlib
import os
import tempfile
import time
import traceback
import zlib

import hypothesis.configuration as hypothesis_configuration
import torch
from hypothesis import HealthCheck, Phase, Verbosity, example, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import reject
from hypothesis.errors import Flaky, Unsatisfiable

from attn_spec.targets.conventions import Target, conventions
from attn_spec.checking.cases import available_devices
from attn_spec.checking.catalog import Property
from attn_spec.checking.counterexamples import counterexample
from attn_spec.checking.fitting import NotCheckable, fit, fit_case
from attn_spec.targets.capabilities import (Supports, envelope, envelope_gaps, parse_capabilities, parse_dtypes, parse_length, probe_capabilities,
                                          required, supports)
from attn_spec.targets.behaviours import parse_requirements, probe_behaviours
from attn_spec.targets.capture import capture
from attn_spec.errors import Failure, KitSignal, PlatformDefect, TargetDied, TargetHung, Uninformative, Unsupported
from attn_spec.checking.assertions import counting
from attn_spec.checking.platform import judge
from attn_spec.report import PropertyResult, TargetReport
from attn_spec.checking.shapes import fixed_cases
from attn_spec.checking.shrink import shrink
from attn_spec.checking.strategies import get_profile
from attn_spec.targets.integrity import CHANGED
from attn_spec.targets.record import differs, record


# Failures the diagnosis does not replay (``PropertyResult.hung``): a hang would wait out its deadline again; a dead
# process (a heap corrupted by an out-of-bounds store aborts at some later free, not at every call) proves nothing
# when a replay survives.
UNREPLAYED = (TargetHung, TargetDied)


class _Hung(KitSignal):
    """A call past its deadline, carried out of Hypothesis (a BaseException: it neither shrinks nor retries it)."""

    def __init__(self, failure: TargetHung):
        super().__init__(failure.message)
        self.failure = failure


@contextlib.contextmanager
def _hypothesis_home_elsewhere():
    """Hypothesis caches files under its home (./.hypothesis by default); while the kit runs, that
    home is a temporary folder, so nothing appears in the user's directory. Restored afterwards,
    so a user's own Hypothesis tests in the same session keep theirs."""
    previous = getattr(hypothesis_configuration, "__hypothesis_home_directory", None)
    hypothesis_configuration.set_hypothesis_home_dir(os.path.join(tempfile.gettempdir(), "attn-spec-hypothesis"))
    try:
        yield
    finally:
        hypothesis_configuration.set_hypothesis_home_dir(previous)


@contextlib.contextmanager
def _global_rng(seed: int, salt: str):
    """torch's global RNG seeded from the run's seed and ``salt`` (the kit never draws from it; a target with
    dropout does), and the caller's RNG state restored afterwards: a target's random numbers do not depend
    on what ran before it."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    saved = torch.get_rng_state(), (torch.cuda.get_rng_state_all() if cuda else None)
    torch.manual_seed(zlib.crc32(salt.encode()) ^ seed)
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        if cuda:
            torch.cuda.set_rng_state_all(saved[1])


def run_property(prop: Property, target: Target, *, profile: str, seed: int, dtypes, devices,
                 verbose: bool = False, rungs=None, progress=None) -> PropertyResult:
    """Run one property: explicit examples first, then random cases, shrinking any failure.

    The cases are those the target takes (probed once per target: attn_spec.checking.fitting); a
    property that ran on no input at all is a skip that says what was not checked, never a pass.
    The target's prints, warnings and log records are captured (``result.output``; all that was
    kept with ``verbose``); its exceptions are its failures; an exception of the kit's own is an
    ``error`` with the kit's traceback. ``rungs`` (fixed shapes, see attn_spec.checking.shapes):
    the property's cases at those shapes instead, nothing drawn or shrunk. ``progress(n)``: told when the
    n-th case starts. A call that does not return within its deadline fails the property on its case,
    unshrunk (attn_spec.targets.deadline)."""
    result = PropertyResult(prop.id, "pass", statement=prop.statement)
    if target.convention not in prop.conventions:
        result.status, result.message = "skip", f"does not apply to the {target.convention} convention"
        return result
    if rungs is not None:
        return run_fixed(prop, target, rungs, seed, result, verbose=verbose, progress=progress)
    prof = get_profile(profile)
    with capture():  # a target not probed yet (check_property) is probed here, its prints kept off the terminal
        takes = supports(target, dtypes, devices[0])
    try:
        fitted, dtypes, not_drawn = fit(prop, target.convention, takes, dtypes)
    except NotCheckable as exc:
        result.status, result.message = "skip", f"not checked: {exc}"
        return result
    unsupported = []  # reasons the target gave for inputs it does not handle
    supported = [0]  # examples the target did handle
    GIVE_UP = 40  # unsupported inputs in a row, none supported: the property is a skip

    def body(case):
        if unsupported and (unsupported[-1].total or (len(unsupported) >= GIVE_UP and not supported[0])):
            return  # nothing left to learn: let Hypothesis run out its budget for free
        result.examples += 1
        if progress:
            progress(result.examples)
        try:
            judge(prop, target, case)
        except PlatformDefect as exc:  # the platform fails the kit's own formula on this case: draw another
            result.platform.append(exc.note)
            reject()
        except Uninformative:  # the case checks nothing for this property: draw another
            reject()
        except Unsupported as exc:  # not a failure: this input is outside what the target declares
            unsupported.append(exc)
            if not exc.total:
                reject()
            return
        except BaseException as exc:
            exc.attn_case = case
            if result.found_after_calls is None:  # the first failing input, before any shrinking
                result.found_after_calls = _calls_to(exc, target)
            if isinstance(exc, TargetHung):  # not shrunk: every smaller case tried would wait out its deadline
                raise _Hung(exc) from None
            raise
        supported[0] += 1

    test = given(prop.strategy(prof, target.convention, dtypes=dtypes, devices=devices, fitted=fitted))(body)
    # In the catalog's order (the most bugs caught first), those that cost the target the fewest calls first
    examples = sorted((fit_case(case, fitted, dtypes, devices) for case in prop.examples_for(target.convention)),
                      key=target.calls_per_attend)
    if prof.long:  # last: the costliest, tried once the small ones hold
        examples += [fit_case(case, fitted, dtypes, devices) for case in prop.examples_for(target.convention, long=True)]
    for case in reversed(list(dict.fromkeys(examples))):
        test = example(case)(test)
    # The kit's shrinker steps through a dense case's fields; a serving case's (cache lengths, pages, segments) are
    # Hypothesis's to shrink at every profile
    kit_shrinks = prof.shrinker == "kit" and getattr(target.traits, "kind", None) != "serving"
    test = settings(max_examples=prof.max_examples, deadline=None, database=None, derandomize=False,
                    suppress_health_check=list(HealthCheck), report_multiple_bugs=False, print_blob=False,
                    phases=(Phase.explicit, Phase.generate) + (() if kit_shrinks else (Phase.shrink,)),
                    verbosity=Verbosity.quiet)(test)
    # No database, so no key for it: Hypothesis would otherwise digest body's source on every run (~10 ms).
    test._hypothesis_internal_database_key = None
    start, output = time.perf_counter(), None
    try:
        with _hypothesis_home_elsewhere(), capture() as output, _global_rng(seed, prop.id), counting(target):
            explicit = None
            try:
                hypothesis_seed(seed)(test)()
            except Failure as failure:
                if failure.attn_case not in examples and not kit_shrinks:
                    raise  # shrunk by Hypothesis already
                explicit = failure
            if explicit is not None:  # shrunk outside the except: the target's tracebacks chain to nothing of ours
                # Hypothesis never shrinks an explicit example (nor, at quick, a drawn one): the kit does
                raise shrink(prop, target, explicit, dict(prop.case_options, **fitted),
                             lambda case: fit_case(case, fitted, dtypes, devices))
    except (Failure, _Hung) as caught:
        failure = caught.failure if isinstance(caught, _Hung) else caught
        result.status, result.message, result.cause = "fail", failure.message, failure.cause
        result.vacuous, result.hung = failure.vacuous, isinstance(failure, UNREPLAYED)
        result.counterexample = counterexample(prop, failure, failure.attn_case, target, seed)
        result.case = failure.attn_case
    except Unsatisfiable:
        pass  # every input was unsupported: reported as a skip below
    except Flaky as exc:
        _measure_flakiness(result, exc, prop, target, seed)
    except Exception as exc:  # noqa: BLE001 - a bug in the kit itself, reported, never hidden
        result.status = "error"
        result.message = f"internal error in attn-spec: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    result.seconds = time.perf_counter() - start
    untrusted(result, target)
    result.output = output and output.summary(verbose)
    if result.status == "pass" and not supported[0]:  # it ran on no input: not a pass
        result.status = "skip"
        result.message = f"not checked: {unsupported[0] if unsupported else lost(result) or 'no input was drawn'}"
    elif unsupported and result.status == "pass":
        result.message = f"checked on {supported[0]} supported inputs; others skipped: {unsupported[0]}"
    if result.platform and result.status == "pass":
        result.message = "; ".join(filter(None, [result.message, lost(result)]))
    if not_drawn and result.status == "pass":
        result.message = "; ".join(filter(None, [result.message, f"not drawn: {'; '.join(not_drawn)}"]))
    return result


def _measure_flakiness(result: PropertyResult, exc: Flaky, prop: Property, target: Target, seed: int,
                       runs: int = 5) -> None:
    """Hypothesis saw one input both pass and fail: re-run it ``runs`` times and say what was measured.

    Nondeterminism is named only if the same input really gives different outputs; a failure that
    the input gives every time is reported as itself, with its input."""
    inner = [e for e in getattr(exc, "exceptions", ()) if getattr(e, "attn_case", None) is not None]
    case = inner[0].attn_case if inner else getattr(exc, "attn_case", None)
    result.status = "fail"
    if case is None:
        result.message = f"Hypothesis reported a flaky failure ({type(exc).__name__}) without an input to re-run"
        return
    replays = [record(prop.fn, target, case) for _ in range(runs)]
    failures = [raised for _, raised in replays if isinstance(raised, Failure)]
    varies = sum(differs(replays[0][0], calls) for calls, _ in replays[1:])
    if failures and not varies and len(failures) == runs:
        failure = failures[0]
        result.message, result.cause = failure.message, failure.cause
    elif varies:
        result.message = (f"the same input gave different outputs: {varies} of {runs - 1} re-runs differ from the "
                          f"first ({case.summary()})")
        result.cause = "the attention is nondeterministic (dropout or randomness left on, or state kept between calls)"
        failure = failures[0] if failures else None
    else:
        result.message = (f"this input failed once, then {'failed' if failures else 'held'} on {len(failures) or runs} "
                          f"of {runs} re-runs with the same outputs: the verdict depends on what ran before it")
        result.cause = "the target keeps state between calls (a cache, a counter, a global)"
        failure = failures[0] if failures else None
    result.case = case
    if failure is not None:
        result.counterexample = counterexample(prop, failure, case, target, seed)


def lost(result: PropertyResult) -> str:
    """How many cases a platform defect took from the property (said once in the report's header), or ""."""
    n = len(result.platform)
    return (f"{n} case{'s' if n != 1 else ''} lost to a platform defect (see the header), each drawn again where it could be"
            if n else "")


ROOT = "matches-reference"  # what a vacuous failure is blocked by: it names what the output is


def run_fixed(prop: Property, target: Target, rungs, seed: int, result: PropertyResult, *,
              verbose: bool = False, progress=None) -> PropertyResult:
    """Check ``prop`` on its cases at each rung, in order; stop at the first failure.

    As in run_property, the target's output is captured and torch's global RNG seeded for the
    property; a case on which the property's relation does not bite (Uninformative) is not counted
    as checked, and a property with no case checked is a skip that says why."""
    planned = [(rung, fixed_cases(prop, target.convention, rung, seed)) for rung in rungs]
    cases = [case for _, made in planned if not isinstance(made, str) for case in made]
    reasons = list(dict.fromkeys(made for _, made in planned if isinstance(made, str)))
    unsupported, uninformative, start = [], [], time.perf_counter()
    with capture() as output, _global_rng(seed, prop.id), counting(target):
        for case in cases:
            if unsupported and unsupported[-1].total:
                break
            result.examples += 1
            if progress:
                progress(result.examples)
            try:
                judge(prop, target, case)
            except Uninformative as exc:  # a platform defect too (PlatformDefect): this case checks nothing
                uninformative.append(exc)
                if isinstance(exc, PlatformDefect):
                    result.platform.append(exc.note)
            except Unsupported as exc:
                unsupported.append(exc)
            except Failure as failure:
                result.status, result.message, result.cause = "fail", failure.message, failure.cause
                result.message += f" (at {case.summary()})"
                result.vacuous, result.case, result.hung = failure.vacuous, case, isinstance(failure, UNREPLAYED)
                result.found_after_calls = _calls_to(failure, target)
                result.counterexample = counterexample(prop, failure, case, target, seed)
                break
            except Exception as exc:  # noqa: BLE001 - out of memory, or a bug in the kit: reported, never hidden
                result.status = "error"
                result.message = (f"the kit ran out of memory at {case.summary()}: {exc}" if _out_of_memory(exc) else
                                  f"internal error in attn-spec: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                break
    result.seconds = time.perf_counter() - start
    untrusted(result, target)
    result.output = output.summary(verbose)
    if result.status == "pass":
        checked = result.examples - len(unsupported) - len(uninformative)
        skipped = [str(u) for u in (unsupported + uninformative)[:1]] + reasons
        if not checked:
            result.status, result.message = "skip", "; ".join(skipped)
        elif skipped:
            result.message = "; ".join([f"checked on {checked} cases at fixed shapes"] + [f"skipped: {r}" for r in skipped])
    return result


def untrusted(result: PropertyResult, target: Target) -> None:
    """What the target replaced in torch or the kit while ``result``'s property ran is undone; a pass judged with
    them replaced is not one, nor one whose last output changed after it was judged or was an input's storage
    (attn_spec.targets.integrity)."""
    replaced = target.state.verify(f"during {result.id}")
    outputs = target.state.outputs
    changed = outputs.changed()  # the last output, compared once more after the property's judging
    aliased, outputs.aliased = outputs.aliased, None
    if replaced and result.status == "pass":
        result.status = "fail"
        result.message = f"not trusted: the target replaced {_names(replaced)} while this property ran"
        result.cause = TAMPERED
    elif changed and result.status == "pass":
        result.status, result.message, result.cause = "fail", f"the output of its last call: {changed}", CHANGED
    elif aliased and result.status == "pass":
        result.status, (result.message, result.cause) = "fail", aliased
    if changed:
        outputs.last = None  # said once


TAMPERED = ("the target replaced functions of torch or of attn-spec in the kit's process: the reference, the "
            "budgets and the verdict would be computed with them (the kit put them back)")
INTEGRITY = "integrity:untouched"  # the row that says what a target replaced in torch or the kit


def _names(names, limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def integrity(target: Target) -> list[PropertyResult]:
    """The ``integrity:untouched`` row, failed, naming what the target replaced in torch or the kit and when; none
    when it replaced nothing (a row only where something is wrong, as a requirement's)."""
    if not target.state.tampered:
        return []
    when: dict = {}
    for name, (change, moment) in target.state.tampered.items():
        when.setdefault((change, moment), []).append(name)
    message = "; ".join(f"the target {change} {_names(names)} {moment}" for (change, moment), names in when.items())
    return [PropertyResult(INTEGRITY, "fail", message, cause=TAMPERED,
                           statement="the target leaves torch's functions and the kit's own objects as they are")]


def _calls_to(exc: BaseException, target: Target) -> int:
    """The target's calls when ``exc`` showed the property fails: those a cause made to explain it not counted
    (Failure.calls), else all made so far (the target raised)."""
    calls = getattr(exc, "calls", None)
    return target.calls if calls is None else calls


def _out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError"


def mark_blocked(results, catalog: dict[str, Property]) -> None:
    """A failure explained by an earlier property's failure is reported as blocked by it.

    A vacuous failure (the property would have held only because the output ignores its inputs) is
    blocked by the root, ``matches-reference``, or else by its own blockers; it never blocks another.
    ``results``: anything with ``id``, ``status``, ``vacuous`` and ``blocked_by`` (also the grader's rows);
    ``catalog``: the properties by id (each names those that explain its failure)."""
    failed = {r.id for r in results if r.status == "fail" and not r.vacuous}
    for r in results:
        if r.status == "fail":
            r.blocked_by = blocker(r, failed, catalog)


def blocker(result, failed, catalog: dict[str, Property]) -> str | None:
    """The failed property (of the ids ``failed``) whose failure explains ``result``'s, or None."""
    after = catalog[result.id].after if result.id in catalog else ()
    blockers = [b for b in ((ROOT,) if result.vacuous else ()) + after
                if b in failed and b != result.id]
    return blockers[0] if blockers else None


def requirements(report: TargetReport, require, target=None) -> list[PropertyResult]:
    """One result per ``--require`` item: a pass, or a failure saying what was required and found (``target``: the
    probed target, for the head dims it takes)."""
    results = []
    for key, value in parse_requirements(require).items():
        result = PropertyResult(f"convention:{key}", "pass", statement=f"required: {key}={value}")
        if report.behaviours.get(key) != value:
            result.status = "fail"
            result.message = f"required {key}={value}, found {key}={report.behaviours.get(key, 'not probed')}"
        results.append(result)
    need = parse_length(require)
    if need is not None:  # length=N: the probed max length reaches N (or no limit was found)
        found = report.capabilities.get("length", "not probed")
        result = PropertyResult("capability:length", "pass", statement=f"required: sequences of {need} positions")
        if not (found == "yes" or (found.isdigit() and int(found) >= need)):
            result.status = "fail"
            result.message = (f"required length={need}, found {'max length ' if found.isdigit() else 'length '}{found}: "
                              f"{report.lacks.get('length', '')}")
        results.append(result)
    supported = target.supported if target is not None and target.supported is not None else Supports()
    for name, gap in envelope_gaps(report.capabilities, supported, require).items():  # head-dims=LO-HI, dtypes=A,B
        item = next(item for item in require if item.startswith(f"{name}="))
        result = PropertyResult(f"capability:{name}", "pass", statement=f"required: {item}")
        if gap:
            result.status = "fail"
            why = report.lacks.get(name) or next((report.lacks[d] for d in parse_dtypes(require) if d in report.lacks), "")
            result.message = f"required {item}, found {gap}: {why}"
        results.append(result)
    for name in parse_capabilities(require):
        result = PropertyResult(f"capability:{name}", "pass", statement=f"required capability: {name}")
        if report.capabilities.get(name) != "yes":
            result.status = "fail"
            result.message = (f"required capability {name}, found {report.capabilities.get(name, 'not probed')}: "
                              f"{report.lacks.get(name, 'the probe did not run')}")
        results.append(result)
    return results


def _picture(target) -> dict:
    """What a mod computes, drawn whatever the verdict (its mask, or the bias it adds); a mod that raises says so."""
    try:
        return target.picture()
    except Failure as failure:
        return {"title": f"no picture: {failure.message}", "kind": "error", "matrix": None}


# Run first: one call per example, and its explicit examples (plain, masked, batched) catch most
# bugs on the first few calls. The report keeps catalog order either way.
RUN_FIRST = ("matches-reference",)


NOT_RUN = "stopped at the first failure"  # the message of each property --exitfirst left out


def _probe_header(report: TargetReport, target: Target, dtypes, devices, seed: int, verbose: bool) -> list:
    """The capabilities and behaviours of the header, probed before the properties (the cases drawn are
    those the target takes: checking.fitting). A bug of the kit's own there is an ``error`` row, returned;
    the properties then draw every input, as for a target that declines nothing."""
    errors = []
    with capture() as output, _global_rng(seed, "header"):
        for name, probe in (("capabilities", lambda: probe_capabilities(target, dtypes, devices[0])),
                            ("behaviours", lambda: probe_behaviours(target, "float32" if "float32" in dtypes
                                                                    else dtypes[0], devices[0]))):
            try:
                found = probe()
            except Exception as exc:  # noqa: BLE001 - a bug in the kit itself, reported, never hidden
                errors.append(PropertyResult(
                    f"probe:{name}", "error", statement=f"the header's {name}, probed on tiny inputs",
                    message=f"internal error in attn-spec while probing the {name}: {type(exc).__name__}: {exc}\n"
                            f"{traceback.format_exc()}"))
                if name == "capabilities":
                    target.supported = Supports()
                continue
            if name == "behaviours":
                report.behaviours = found
            else:
                report.capabilities, report.lacks = found
                report.envelope = envelope(target.supported)
    target.state.verify("during the header's probes")
    report.output.update(target.output)
    if output.summary():
        report.output["header probes"] = output.summary(verbose)
    return errors


def applicable(props, target: Target) -> list:
    """The properties a check of ``target`` reports: a FlexAttention mod or a serving kernel gets only those naming
    its convention, an attention those whose conventions overlap the attention conventions (the registry's
    kind="attention"); the others are left out, not skipped: the CLI's report and the pytest plugin's items list
    the same ones."""
    attention = set(conventions(kind="attention"))
    return [p for p in props if target.convention in p.conventions or
            (target.is_attention and set(p.conventions) & attention)]


def _notes(target) -> list[str]:
    """The header's notes on how the target runs (Triton's interpreter), the dtypes its platform cannot run, and how
    it is called (Target.notes)."""
    return [*target.runtime] + [f"{name}: {why}" for name, why in target.left_out.items()] + target.notes()


def _heads_note(target, props, results) -> list[str]:
    """For a multi-head module: which properties drew heads and weights and which ran one head (issue 23.5)."""
    if not (target.traits is not None and target.traits.multihead):
        return []
    ran = {r.id for r in results if r.status not in ("skip", "not-run")}
    multi = [p.id for p in props if p.id in ran and p.multihead and p.projections == "drawn"]
    probed = [p.id for p in props if p.id in ran and p.multihead and p.projections == "identity"]
    single = [p.id for p in props if p.id in ran and not p.multihead]
    parts = ([f"{', '.join(multi)} drew 1 to 4 heads and random W_Q, W_K, W_V, W_O (a counterexample shows them)"]
             if multi else []) + ([f"{', '.join(probed)} drew the heads and read each through projections that "
                                   f"select Q, K and V"] if probed else []) + (
        [f"{', '.join(single)} ran one head, through projections that select Q, K and V"] if single else [])
    return [f"heads: {'; '.join(parts)}"] if parts else []


def check_target(target: Target, props: list[Property], *, profile="default", seed=0, dtypes=None,
                 devices=None, progress=None, require=None, exitfirst=False, expected=(),
                 verbose=False, rungs=None) -> TargetReport:
    """Run ``props`` (in catalog order; see :func:`attn_spec.properties.select`) on one target, each failure
    blocked by the earlier one that explains it (the roots come after: attn_spec.run.Run).

    ``exitfirst``: after the first failure of a property not in ``expected`` (an expectations file's
    ids), the rest are ``not-run``. Nothing the target does stops the check: its exceptions are
    failures, its output is captured, the global state it changes is restored after each call and
    listed in ``state_changes``. ``rungs``: at these fixed shapes only (attn_spec.checking.shapes)."""
    target.required = required(require)  # before the probes: a required capability's probe fails
    report = TargetReport(target.name, target.convention, masks=list(target.masks), notes=_notes(target))
    dtypes, devices = target.dtypes(dtypes), devices or available_devices()
    props = applicable(props, target)
    # Probed first: the cases drawn for each property are those the target takes (checking.fitting).
    if target.is_attention:
        if progress:
            progress(f"{target.name}: probing its capabilities and behaviours")
        probe_errors = _probe_header(report, target, dtypes, devices, seed, verbose)
    else:  # a FlexAttention mod: no attention to probe; what it computes, drawn
        probe_errors = []
        report.output.update(target.output)
        if hasattr(target, "picture"):
            report.picture = _picture(target)
    probe_calls = target.calls
    results = {}
    for i, prop in enumerate(sorted(props, key=lambda p: p.id not in RUN_FIRST)):
        if exitfirst and any(r.status in ("fail", "error") and r.id not in expected for r in results.values()):
            results[prop.id] = PropertyResult(prop.id, "not-run", NOT_RUN, statement=prop.statement)
            continue
        tick = progress and (lambda n, where=f"{target.name}: [{i + 1}/{len(props)}] {prop.id}":
                             progress(f"{where}, case {n}"))
        results[prop.id] = run_property(prop, target, profile=profile, seed=seed, dtypes=dtypes, devices=devices,
                                        verbose=verbose, rungs=rungs, progress=tick)
    report.properties = [results[p.id] for p in props]
    for result in report.properties:  # counted from the first property's first call, not the probes'
        if result.found_after_calls is not None:
            result.found_after_calls -= probe_calls
    ran = {p.id: p for p in props}
    mark_blocked(report.properties, ran)
    report.properties.extend(probe_errors + requirements(report, require, target))
    return finish(report, target, ran)


def finish(report: TargetReport, target: Target, catalog: dict[str, Property]) -> TargetReport:
    """What the target's calls left, in its report (again after a diagnosis has replayed some); ``catalog``: the
    properties by id."""
    props = [catalog[r.id] for r in report.properties if r.id in catalog]
    report.notes = _notes(target) + _heads_note(target, props, report.properties)  # with what the calls taught
    report.calls = target.calls
    report.inference_only = target.inference_only
    report.state_changes = target.state.notes()
    target.state.verify("before the verdict")
    report.properties = [r for r in report.properties if r.id != INTEGRITY] + integrity(target)
    return report
