"""The kit's Python API: ``attn_spec.check`` (a whole report), ``attn_spec.check_property`` (one property with
Hypothesis, from your own tests) and ``attn_spec.reproduce`` (one case).

``plan``, ``load_targets`` and ``run`` are the steps of a check, shared with ``attn-spec check``; every run
of properties goes through one :class:`attn_spec.run.Run` (run, then diagnose).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import attn_spec.settings as attn_settings
from attn_spec.checking.assertions import restate
from attn_spec.checking.cases import DTYPES, available_devices
from attn_spec.checking.catalog import Property
from attn_spec.checking import rows
from attn_spec.checking.shapes import Rung, rungs
from attn_spec.checking.strategies import get_profile
from attn_spec.errors import Failure, KitUsageError, PlatformDefect, TargetLoadError, Uninformative
from attn_spec.properties import catalog, select
from attn_spec.report import Report, render
from attn_spec.report.ci import Expectations
from attn_spec.report.text import REPRODUCE_PLATFORM, diagnosis_lines, platform_head
from attn_spec.run import Run
from attn_spec.targets.behaviours import parse_requirements
from attn_spec.targets.capabilities import parse_capabilities, required
from attn_spec.targets.conventions import Target, load, make_target, parse_masks
from attn_spec.targets.deadline import timeout
from attn_spec.targets.loading import load_target
from attn_spec.version import __version__


@dataclass
class Plan:
    """One check's settings, validated against the catalog and this machine."""

    settings: attn_settings.Settings
    properties: list[Property]
    seed: int
    dtypes: list[str]
    devices: list[str]
    expectations: Expectations | None
    rungs: list[Rung] | None = None  # fixed shapes (--shapes, the scale profile), else drawn cases

    def run(self, *, diagnose: bool = True, verbose: bool = False) -> Run:
        """How its properties run: the dtypes named in the settings or fixed by the shapes' rungs, else each
        target convention's own (hf: no float64), else all."""
        given = self.dtypes if self.settings["dtypes"] or self.rungs else None
        return Run(self.settings["profile"], self.seed, given, self.devices, self.rungs, diagnose, verbose,
                   self.settings["call-timeout"])


def plan(settings: attn_settings.Settings) -> Plan:
    """Validate what only the catalog and the machine can judge; a SettingError names the source."""
    for name, validate in (("only", lambda ids: select(only=ids)), ("skip", lambda ids: select(skip=ids)),
                           ("require", parse_requirements), ("require", parse_capabilities)):
        try:
            validate(settings[name])
        except KitUsageError as exc:
            raise settings.error(name, str(exc)) from None
    available = available_devices()
    devices = [d for d in settings["devices"] if d != "all"] or available
    if any(d not in available for d in devices):
        raise settings.error("devices", f"this machine has only {', '.join(available)}")
    dtypes, steps = settings["dtypes"] or list(DTYPES), None
    if settings["shapes"] or get_profile(settings["profile"]).ladder:  # on the accelerator, in its dtypes
        try:
            steps = rungs(settings["shapes"] or None, dtypes=settings["dtypes"] or None,
                          devices=devices if settings["devices"] else None)
        except KitUsageError as exc:  # H not a multiple of HKV: beyond what the setting's own check reads
            raise settings.error("shapes", str(exc)) from None
        devices, dtypes = list(dict.fromkeys(r.device for r in steps)), list(dict.fromkeys(r.dtype for r in steps))
    expectations = None
    if settings["expect"]:
        try:
            expectations = Expectations.read(settings["expect"])
        except OSError as exc:
            raise settings.error("expect", f"cannot read {settings['expect']}: {exc.strerror}") from None
    seed = random.randrange(2**32) if settings["seed"] is None else settings["seed"]
    return Plan(settings, select(settings["only"], settings["skip"]), seed, dtypes, devices, expectations, steps)


def target_options(settings: attn_settings.Settings) -> dict:
    """make_target's keywords from the settings: layout, expect_mask, expect_score, hf_module_attr, hf_config."""
    return {"layout": settings["layout"], "expect_mask": settings["expect-mask"], "expect_score": settings["expect-score"],
            "hf_module_attr": settings["hf-module-attr"] or None, "hf_config": settings["hf-config"]}


def load_targets(settings: attn_settings.Settings, objects=None, *, name: str | None = None,
                 not_loaded: list | None = None, keep=(TargetLoadError, KitUsageError),
                 verbose: bool = False) -> list[Target]:
    """The targets: ``objects`` (functions, modules, adapters, TARGET strings; default: the settings' TARGET
    specs), each wrapped in its convention (``name``: the name of a single one). A TARGET string is imported as
    attn_spec.targets.conventions.load does: what importing it printed is kept, the global state it changed
    restored. One that cannot be raises TargetLoadError (or KitUsageError: no convention fits), or, given a
    ``not_loaded`` list, is recorded there as ``{"target", "message"}`` (for the exceptions in ``keep``)
    while the others still load."""
    root = settings.bases.get("targets") if objects is None else None  # the settings' paths are relative to it
    targets, options = [], target_options(settings)
    objects = list(settings["targets"] if objects is None else objects)
    masks = settings["masks"] or None  # None: each convention's own
    for obj in objects:
        key = name if name and len(objects) == 1 else (obj if isinstance(obj, str) else None)
        try:
            if settings["isolate"] and not isinstance(obj, Target):
                targets.append(_isolated(obj, settings, root))
                continue
            with timeout(settings["call-timeout"]):  # an import, a module built: under their deadlines
                target = obj if isinstance(obj, Target) else \
                    load(obj, settings["convention"], name=key, root=root, masks=masks,
                         inference_only=settings["inference-only"], verbose=verbose, **options) if isinstance(obj, str) \
                    else make_target(obj, key, settings["convention"], masks, verbose=verbose, **options)
        except keep as exc:  # an adapter class that raises when instantiated: the others still run
            if not_loaded is None:
                raise
            not_loaded.append({"target": key or getattr(obj, "__qualname__", repr(obj)), "message": str(exc)})
            continue
        target.masks = parse_masks(masks) or target.masks
        targets.append(target)
    return targets


def _isolated(obj, settings: attn_settings.Settings, root) -> Target:
    """The TARGET ``obj`` in a process of its own (--isolate: attn_spec.grading.isolation.isolated)."""
    from attn_spec.grading.isolation.isolated import shared

    given = [name for name, value in target_options(settings).items() if value] + \
        (["masks"] if settings["masks"] and settings["masks"] != ["bool"] else [])
    if not isinstance(obj, str) or given:
        why = f"it does not take {', '.join(given)}" if given else \
            "an object already imported into this process cannot be moved out of it"
        raise KitUsageError(f"--isolate checks path/to/file.py:name targets in the function or seed-module convention; "
                            f"{why}")
    devices = [d for d in settings["devices"] if d != "all"] or available_devices()
    target = shared().target(obj, settings["convention"], devices=devices, root=root)
    target.inference_only = settings["inference-only"]
    return target


def run(targets: list[Target], plan: Plan, *, progress=None, exitfirst: bool = False, diagnose: bool = True,
        verbose: bool = False, not_loaded=()) -> Report:
    """Check each target as ``plan`` says; the expectations file, if any, is applied to the report.
    ``diagnose``: group each target's failures by root (attn_spec.diagnosis); off, only the catalog's order.
    ``verbose``: keep all the output the targets printed, warned and logged, not only the count and
    first occurrence. ``not_loaded``: targets that could not be loaded, listed in the report."""
    s, checks = plan.settings, plan.run(diagnose=diagnose, verbose=verbose)
    expected = set(plan.expectations.ids) if plan.expectations else set()
    reports = []
    for target in targets:
        target.inference_only = target.inference_only or s["inference-only"]
        reports.append(checks.target(target, plan.properties, require=s["require"], progress=progress,
                                     exitfirst=exitfirst, expected=expected))
    shapes = list(dict.fromkeys(str(r.shape) for r in plan.rungs or ()))
    report = Report(reports, __version__, s["profile"], plan.seed, devices=plan.devices, dtypes=plan.dtypes,
                    not_loaded=list(not_loaded), shapes=shapes, rows_judged=rows.rules(plan.rungs or ()))
    if plan.expectations:
        plan.expectations.apply(report, catalog())
    return report


def check(*targets, name=None, convention=None, profile=None, seed=None, only=None, skip=None, dtypes=None,
          devices=None, require=None, expect=None, inference_only=None, shapes=None, progress=None,
          exitfirst=False, verbose=False, config=False, diagnose=True, masks=None, layout=None, expect_mask=None,
          expect_score=None, hf_module_attr=None, hf_config=None, call_timeout=None, isolate=None) -> Report:
    """Check attention functions or modules against the catalog; returns a :class:`Report`.

    ``masks``: the mask forms the targets take, ``("bool",)`` or ``("bool", "additive")`` (default:
    each convention's own; additive float masks are part of the sdpa, torch-mha and flex conventions,
    and of hf where Hugging Face builds float masks).
    ``shapes``: check at these fixed shapes instead of drawn ones, e.g. ``["1,8,4096,128",
    "1,32,8,1,32768,128"]`` (B,H,N,D or B,H,[HKV,]NQ,NKV,D; a decode kernel's B,H,[HKV,]S_NEW,S_CACHE,D[,page=P]),
    on the accelerator if there is one (or ``devices``), in what kernels run there (or ``dtypes``); the ``scale``
    profile is a ladder of them.

    >>> report = attn_spec.check(my_attention, profile="quick")
    >>> report.conforms, print(report)

    ``config=True`` also reads what is not given here from the environment (``ATTN_SPEC_*``) and from
    ``[tool.attn-spec]`` in the nearest pyproject.toml (or the one at ``config``, a path), including
    the targets when none are given: ``attn_spec.check(config=True)`` is ``attn-spec check``.
    ``expect``: an expectations file, as ``--expect``. ``inference_only``: the targets are inference
    kernels, so an output without autograd makes ``gradients`` a skip instead of a failure.
    ``verbose``: the report keeps all of the targets' captured output (prints, warnings, log
    records), not only the count and first occurrence. A target that cannot be wrapped (an adapter
    class that raises when instantiated) is listed in ``report.not_loaded``; the others are checked.
    ``layout`` (bhsd, bshd), ``expect_mask``, ``expect_score``, ``hf_module_attr`` (``["NAME=VALUE"]``) and
    ``hf_config`` (a config.json) are passed to ``make_target``
    (attn_spec.targets.conventions). ``isolate``: each TARGET string (path/to/file.py:name) runs in a process of
    its own, as ``--isolate``. Without ``dtypes``, each target is checked in its convention's dtypes
    (hf: float32, float16, bfloat16). ``call_timeout``: seconds a call into a target may take on a small case,
    proportionally more on larger ones (default 10; 0: none); a call past it fails its property as a hang.
    """
    given = config_keywords(convention=convention, profile=profile, seed=seed, only=only, skip=skip,
                            dtypes=dtypes, devices=devices, require=require, expect=expect,
                            inference_only=inference_only, shapes=shapes, masks=masks, layout=layout,
                            expect_mask=expect_mask, expect_score=expect_score, hf_module_attr=hf_module_attr,
                            hf_config=hf_config, call_timeout=call_timeout, isolate=isolate)
    if not config:
        settings = attn_settings.resolve([given])
    else:
        settings = attn_settings.load(given, path=None if config is True else config)
    checked_plan = plan(settings)
    not_loaded = []
    if targets:  # given here: one that cannot be wrapped is listed in the report, the others still run
        loaded = load_targets(settings, targets, name=name, not_loaded=not_loaded, keep=(TargetLoadError,),
                              verbose=verbose)
    elif settings["targets"]:
        loaded = load_targets(settings, verbose=verbose)
    else:
        raise KitUsageError("no targets: pass one, or set targets in [tool.attn-spec] and call with config=True")
    return run(loaded, checked_plan, progress=progress, exitfirst=exitfirst, diagnose=diagnose, verbose=verbose,
               not_loaded=not_loaded)


def config_keywords(**values) -> attn_settings.Layer:
    """The API's keyword arguments as the top settings layer (None: not given)."""
    return attn_settings.keywords(values, "the keyword argument {key}", base=None)


def check_property(property_id: str, target, *, convention=None, profile="default", seed=None, dtypes=None,
                   devices=None, masks=None, call_timeout=None):
    """Run one property with Hypothesis on ``target``; AssertionError with the lesson if it does not hold.

    ``target`` is your function or module (any convention; ``convention=`` when it cannot be
    detected) or an adapter. ``masks=("bool", "additive")`` declares that it takes additive float
    masks too. ``seed=None`` draws a random seed; the failure text names it. ``call_timeout``: seconds a
    call into the target may take on a small case (default 10; 0: none), as ``attn-spec check --call-timeout``.
    Returns the :class:`attn_spec.report.PropertyResult` (status "pass", or "skip" with the reason
    in ``message`` when the property does not apply to the target).
    """
    get_profile(profile)
    prop = select(only=[property_id])[0]
    with timeout(call_timeout):  # the layout probe's calls
        adapter = target if isinstance(target, Target) else make_target(target, convention=convention, masks=masks)
    adapter.masks = parse_masks(masks) or adapter.masks
    seed = random.randrange(2**32) if seed is None else seed
    run = Run(profile, seed, list(dtypes) if dtypes else None, list(devices) if devices else None,
              call_timeout=call_timeout)
    result, diagnosis, _ = run.property(prop, adapter)
    if result.status in ("fail", "error"):
        raise AssertionError(render(result, "text", diagnosis=diagnosis, traceback=True))
    return result


def reproduce(property_id: str, target, case, *, convention=None, masks=None, require=None, **options) -> None:
    """Run one property on one case; raises the Failure (with its diagnosis) if it does not hold. A failure
    that the kit's own formula shows too on the same inputs is the platform's: printed as a platform note.

    ``masks`` and ``options`` (layout, expect_mask, expect_score, hf_module_attr, hf_config): make_target's
    keywords, as a report's snippet gives them; ``require``: the capabilities the check required (--require)."""
    prop = select(only=[property_id])[0]
    obj = load_target(target) if isinstance(target, str) else target
    adapter = obj if isinstance(obj, Target) else make_target(obj, target if isinstance(target, str) else None,
                                                               convention, masks, **options)
    if require:
        adapter.required = required(require)
    try:
        Run().case(prop, adapter, case)
    except Failure as failure:
        restate(failure, f"{property_id}: ", _diagnosed(failure))
    except PlatformDefect as exc:  # the kit's own formula fails on these inputs too: not the target's failure
        note = {**exc.note, "cases": 1, "properties": [property_id]}
        print(f"{property_id} on {case.summary()}: {platform_head(note)}\n{REPRODUCE_PLATFORM}\n{note['reproduce']}")
        return
    except Uninformative as exc:
        print(f"{property_id} checks nothing on {case.summary()}: {exc}")
        return
    print(f"{property_id} holds on {case.summary()}")


def _diagnosed(failure: Failure) -> str:
    """What the diagnosis found for this one failure, and the target's own traceback when it raised."""
    diagnosis = failure.diagnosis
    lines = diagnosis_lines(diagnosis, pad="")
    trace = getattr(failure, "user_traceback", "") or getattr(diagnosis, "traceback", "")
    return "\n".join(lines + (["traceback of the target:", trace] if trace else []))


__all__ = ["check", "reproduce", "plan", "load_targets", "run", "Plan", "Run"]
