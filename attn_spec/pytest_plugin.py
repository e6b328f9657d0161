"""attn-spec inside pytest: the catalog as test items, and one property inside your own tests.

Installed with the kit (entry point ``pytest11``: ``attn_spec``); inert unless it has targets.

    pytest --attn-target mypkg.attn:attention --attn-profile quick
    pytest --attn-target my.py:attention --attn-target my.py:MultiHeadAttention --attn-only causal-mask
    pytest                      # with targets in [tool.attn-spec] of pyproject.toml, or attn_target in an ini file

Options, ini keys and environment variables come from one table (``attn_spec.settings``): each
setting is ``--attn-NAME``, the ini key ``attn_NAME`` (``[tool.pytest.ini_options]``, pytest.ini,
tox.ini, setup.cfg), ``ATTN_SPEC_NAME`` and ``NAME`` in ``[tool.attn-spec]``, in that order of
precedence (command line > environment > ini key > pyproject.toml > default). Targets are the one
exception: ``--attn-target`` adds to the configured targets instead of replacing them. Targets from the
command line are always checked; targets from configuration only when pytest runs without path
arguments (as ``testpaths`` applies), so ``pytest tests/test_one.py`` stays a quick run.

Each target gets one item per property, ``attn-spec[TARGET]::PROPERTY-ID`` (and one per
``require`` item, ``attn-spec[TARGET]::capability:mask``), so ``-k causal-mask`` selects a property
and ``-k 'attn-spec[my.py:attention]'`` a target. A failing item shows the same lesson as
``attn-spec check``; a property that does not apply is skipped with the reason; a failure listed in
the ``expect`` file is an xfail. The header prints the seed as ``--attn-seed=N``: paste it to rerun
the same cases.

``@pytest.mark.attn_spec(target=..., profile=..., ...)`` on a test function turns it into one test
per property on that target (``test_x[causal-mask]``); the marker's keywords are settings and win
over every other source for that test. The function's body is not run.

pytest-xdist (``-n auto``): every worker must collect the same items and run the same cases. The
controller resolves the settings and draws the seed once (the one its header prints) and hands both
to each worker in ``workerinput`` from the ``pytest_configure_node`` hook, so a worker on another
host, with another environment or folder, still runs the controller's check.

This module is imported by every pytest run once the kit is installed: it imports nothing heavy
at module level; torch, the runner and the user's target load only when there is something to check.
Disable it entirely with ``-p no:attn_spec``.
"""
from __future__ import annotations

import os
import random

import pytest

from attn_spec import settings as config_table
from attn_spec.errors import AttnSpecError

SEED_KEY = "attn_spec_seed"  # the controller's seed, in each xdist worker's workerinput
SETTINGS_KEY = "attn_spec_settings"  # the controller's resolved settings and whether it checks targets
MARKER = ("attn_spec(target, **settings): check TARGET (an object or a TARGET string) against the catalog, one "
          "test per property; keywords are attn-spec settings (profile, seed, only, skip, dtypes, ...)")


def pytest_addoption(parser) -> None:
    config_table.add_pytest_options(parser)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", MARKER)
    config.pluginmanager.register(AttnSpecSession(config), "attn-spec-session")


def _overridden(args) -> set[str]:
    """Ini keys given with ``-o KEY=VALUE`` / ``--override-ini``."""
    names, args = set(), list(args)
    for i, arg in enumerate(args):
        value = (args[i + 1] if arg in ("-o", "--override-ini") and i + 1 < len(args) else
                 arg[2:] if arg.startswith("-o") and len(arg) > 2 else
                 arg.partition("=")[2] if arg.startswith("--override-ini=") else "")
        names.add(value.partition("=")[0])
    return names


def _ini_layer(config) -> config_table.Layer:
    """The plugin's ini keys, named by file and section (``tox.ini [pytest] attn_profile``)."""
    values = {s.name: v for s in config_table.offered() if (v := config.getini(s.ini)) not in ("", [], None)}
    path, overridden = config.inipath, _overridden(config.invocation_params.args)
    section = {"setup.cfg": "[tool:pytest]", "pyproject.toml": "[tool.pytest.ini_options]"}.get(
        path.name if path else "", "[pytest]")
    if path and path.name == "pyproject.toml" and "ini_options" not in \
            config_table._read_toml(path).get("tool", {}).get("pytest", {}):
        section = "[tool.pytest]"

    def where(s):
        return f"pytest -o {s.ini}" if s.ini in overridden else f"{os.path.relpath(path)} {section} {s.ini}"

    return config_table.Layer(values, where, base=path.parent if path else None)


def _add_configured_targets(settings: config_table.Settings, configured: config_table.Settings) -> None:
    """``--attn-target`` adds: the configured targets (environment, ini key, pyproject.toml) after the
    command line's, each once."""
    extra = [t for t in configured["targets"] if t not in settings["targets"]]
    if extra:
        settings.values["targets"] = [*settings["targets"], *extra]
        settings.sources["targets"] += f" and {configured.sources['targets']}"


class AttnSpecSession:
    """The plugin's state in one pytest run: settings, seed, and (once needed) the loaded targets."""

    def __init__(self, config):
        self.config = config
        shipped = getattr(config, "workerinput", {}).get(SETTINGS_KEY)
        if shipped:  # an xdist worker runs the controller's check
            self.settings = config_table.Settings.from_wire(shipped["settings"])
            self.active, self.seed = shipped["active"], config.workerinput[SEED_KEY]
        else:
            whole_suite = getattr(config, "args_source", None) != pytest.Config.ArgsSource.ARGS
            try:
                below = (_ini_layer(config),)
                self.settings = config_table.load(config_table.command_line(config.option, pytest_flags=True),
                                                  start=config.invocation_params.dir, below=below)
                from_flags = self.settings.sources["targets"].startswith("the command line")
                if from_flags and whole_suite:
                    _add_configured_targets(self.settings, config_table.load(start=config.invocation_params.dir,
                                                                             below=below))
            except config_table.SettingError as exc:
                raise pytest.UsageError(f"attn-spec: {exc}") from None
            self.active = bool(self.settings["targets"]) and (from_flags or whole_suite)
            seed = self.settings["seed"]
            self.seed = random.randrange(2**32) if seed is None else seed
        self.checker = Checker(self.settings, self.seed) if self.active else None

    def pytest_report_header(self, config) -> list[str]:
        if not self.active:
            return []
        import torch

        from attn_spec.version import __version__

        c = self.checker
        lines = [f"attn-spec {__version__}: profile {c.profile}, --attn-seed={self.seed}, "
                 f"torch {torch.__version__}, devices {', '.join(c.plan.devices)}"
                 + (f", shapes {' '.join(self.settings['shapes'])}" if self.settings["shapes"] else "")]
        by_source: dict[str, list[str]] = {}  # settings not on the command line, where the user may not look
        for name, source in self.settings.sources.items():
            if source != "default" and not source.startswith("the command line"):
                by_source.setdefault(source.rsplit(" attn_", 1)[0], []).append(name)
        if by_source:
            lines.append("attn-spec settings: " + "; ".join(f"{', '.join(names)} from {source}"
                                                            for source, names in by_source.items()))
        lines += [f"attn-spec target: {spec} ({target.convention} convention)" for spec, target in c.targets.items()]
        return lines

    def pytest_terminal_summary(self, terminalreporter) -> None:
        """Each target's envelope, the limits it declares (attn_spec.targets.capabilities.envelope): the items
        checked only within them, and pytest's own summary line cannot say so (``attn-spec check`` puts them in
        its verdict: ``CONFORMS up to 1024 positions``)."""
        if not self.active or self.checker is None:
            return
        from attn_spec.targets.capabilities import envelope

        for spec, target in self.checker.targets.items():
            if not getattr(target, "is_attention", True):
                continue
            try:
                if target.supported is None:  # an xdist controller ran no item: probe here (tiny calls)
                    self.checker.run.probe(target)
                limits = envelope(target.supported)
            except Exception as exc:  # noqa: BLE001 - the summary never fails the run; the items said what failed
                terminalreporter.write_line(f"attn-spec[{spec}]: its limits could not be probed: {exc}")
                continue
            if limits:
                terminalreporter.write_line(f"attn-spec[{spec}]: checked {', '.join(e['phrase'] for e in limits)} "
                                            f"(the limits it declares: nothing outside them was drawn)")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_pycollect_makeitem(self, collector, name, obj):
        """A marked test function becomes its property items while it is collected, so that pytest's
        "collected N items" counts them (expanded after collection, it counted the function instead)."""
        outcome = yield
        made = outcome.get_result()
        if isinstance(made, (list, pytest.Function)):
            outcome.force_result([new for item in (made if isinstance(made, list) else [made])
                                  for new in _marked(item, self)])

    @pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect filter the items
    def pytest_collection_modifyitems(self, session, items) -> None:
        if self.active:
            for spec in self.checker.targets:
                name = f"attn-spec[{spec}]"
                items.extend(session.genitems(TargetCollector.from_parent(session, name=name, nodeid=name, spec=spec)))

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """pytest-xdist, in the controller: every worker runs with these settings and the seed this header printed."""
        node.workerinput[SEED_KEY] = self.seed
        node.workerinput[SETTINGS_KEY] = {"settings": self.settings.to_wire(), "active": self.active}


class Checker:
    """What the items of one set of settings share: loaded targets, the plan, failures so far."""

    def __init__(self, settings, seed: int, targets: dict | None = None):
        from attn_spec import api
        from attn_spec.errors import KitUsageError, TargetLoadError

        self.settings, self.profile, self.convention = settings, settings["profile"], settings["convention"]
        self.failed: dict[str, set[str]] = {}  # target key -> ids that failed so far in this session
        self.named: dict[str, dict[str, str]] = {}  # target key -> mistake id -> the property that named it first
        self.probed: dict[str, object] = {}  # target key -> TargetReport with the header's probes
        try:
            self.plan = api.plan(settings)
            self.plan.seed = seed
            self.run = self.plan.run(verbose=True)  # each item: its property, then the diagnosis of a failure
            self.targets = targets if targets is not None else \
                dict(zip(settings["targets"], api.load_targets(settings)))
        except (KitUsageError, TargetLoadError) as exc:
            raise pytest.UsageError(f"attn-spec: {exc}") from None
        from attn_spec.targets.capabilities import required
        for target in self.targets.values():  # as check_target does: a required capability's probe fails
            target.required = required(settings["require"])
        self.expected = self.plan.expectations.ids if self.plan.expectations else {}

    def items(self, parent, key: str, name=lambda pid: pid) -> list:
        """One item per property and per ``require`` entry, for the target ``key``, under ``parent``."""
        from attn_spec.checking.runner import applicable
        from attn_spec.targets.behaviours import parse_requirements
        from attn_spec.targets.capabilities import parse_capabilities, parse_length

        require = self.settings["require"]
        ids = [f"convention:{k}" for k in parse_requirements(require)] + \
              (["capability:length"] if parse_length(require) is not None else []) + \
              [f"capability:{key}" for key in ("head-dims", "dtypes") if any(r.startswith(f"{key}=") for r in require)] + \
              [f"capability:{c}" for c in parse_capabilities(require) if c != "length" or parse_length(require) is None]
        return ([PropertyItem.from_parent(parent, name=name(p.id), prop=p, checker=self, key=key)
                 for p in applicable(self.plan.properties, self.targets[key])] +
                [RequirementItem.from_parent(parent, name=name(i), requirement=i, checker=self, key=key)
                 for i in ids])

    def rerun_command(self, spec: str, property_id: str) -> str:
        extra = [f"--attn-convention={self.convention}"] if self.convention else []
        extra += [f"--attn-dtypes={','.join(self.plan.dtypes)}"] if self.settings["dtypes"] else []
        extra += [f"--attn-devices={','.join(self.plan.devices)}"] if self.settings["devices"] else []
        extra += ["--attn-inference-only"] if self.settings["inference-only"] else []
        extra += [f"--attn-masks={','.join(self.settings['masks'])}"] if self.settings["masks"] else []
        extra += [f"--attn-shapes='{' '.join(self.settings['shapes'])}'"] if self.settings["shapes"] else []
        return " ".join(["pytest", f"--attn-target={spec}", f"--attn-only={property_id}",
                         f"--attn-profile={self.profile}", f"--attn-seed={self.plan.seed}", *extra])


class TargetCollector(pytest.Collector):
    """``attn-spec[TARGET]``: one item per selected property."""

    def __init__(self, *, spec: str, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec

    def collect(self):
        return self.config.pluginmanager.get_plugin("attn-spec-session").checker.items(self, self.spec)


def _domain(item) -> str:
    """How ``-v`` names the item: its node id, or inside a test module what follows the file (as for functions)."""
    if isinstance(item.parent, (pytest.Module, pytest.Class)):
        return item.nodeid.split("::", 1)[1].replace("::", ".")
    return item.nodeid


class PropertyFailed(AttnSpecError, AssertionError):
    """A property does not hold; ``str()`` is the lesson shown as the failure."""


class _AttnItem(pytest.Item):
    def __init__(self, *, checker: Checker, key: str, rerun: str = "", **kwargs):
        super().__init__(**kwargs)
        self.checker, self.key, self.rerun = checker, key, rerun

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PropertyFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, _domain(self)

    def fail(self, lesson: str, property_id: str, note: str = "") -> None:
        if property_id in self.checker.expected:
            pytest.xfail(f"{property_id}: expected failure (listed in {self.checker.plan.expectations.path})")
        rerun = self.rerun or self.checker.rerun_command(self.key, property_id)
        raise PropertyFailed("\n".join(filter(None, [lesson, note, f"rerun: {rerun}"])))


class PropertyItem(_AttnItem):
    """One property on one target, run with Hypothesis exactly as ``attn-spec check`` runs it."""

    def __init__(self, *, prop, **kwargs):
        super().__init__(**kwargs)
        self.prop = prop

    def runtest(self) -> None:
        from attn_spec.report import render

        c = self.checker
        failed = c.failed.setdefault(self.key, set())
        named = c.named.setdefault(self.key, {})  # mistake id -> the first item that named it
        result, diagnosis, blocker = c.run.property(self.prop, c.targets[self.key], failed=failed, shortlist=named)
        for kind, found in (result.output or {}).items():  # shown as pytest shows a test's captured output
            text = found["all"] if isinstance(found["all"], str) else "\n".join(
                item["text"] + (f" (x{item['count']})" if item["count"] > 1 else "") for item in found["all"])
            self.add_report_section("call", f"{kind} of the target", text)
        if result.status == "skip":
            pytest.skip(f"{self.prop.id}: {result.message}")
        if result.status in ("fail", "error"):
            if not result.vacuous:  # a property that held only trivially explains nothing else
                failed.add(self.prop.id)
            note = (f"note: {blocker} already failed on this target, and its failure explains this one: "
                    f"fix that first" if blocker else "")
            if diagnosis is not None and diagnosis.named:
                if diagnosis.mistake in named:
                    note = (f"note: {named[diagnosis.mistake]} already failed on this target with the same root "
                            f"({diagnosis.mistake}): fix that first")
                named.setdefault(diagnosis.mistake, self.prop.id)
            self.fail(render(result, "text", diagnosis=diagnosis, traceback=True), self.prop.id, note)


class RequirementItem(_AttnItem):
    """One ``require`` entry (a capability, or a behaviour such as fully-masked=zeros) on one target."""

    def __init__(self, *, requirement: str, **kwargs):
        super().__init__(**kwargs)
        self.requirement = requirement

    def runtest(self) -> None:
        c = self.checker
        if self.key not in c.probed:
            c.probed[self.key] = c.run.probe(c.targets[self.key])
        kind, _, name = self.requirement.partition(":")
        wanted = [r for r in c.settings["require"] if (r.partition("=")[0] if "=" in r else r) == name]
        (result,) = [r for r in c.run.requirements(c.probed[self.key], wanted, c.targets[self.key])
                     if r.id == self.requirement]
        if result.status == "fail":
            self.fail(f"✗ {result.id}: {result.statement}\n  what happened: {result.message}", result.id)


def _marked(item, session: AttnSpecSession) -> list:
    """``item`` itself, or, for a test function marked ``@pytest.mark.attn_spec``, its property items."""
    marks = [m for m in getattr(item, "own_markers", []) if m.name == "attn_spec"]
    if not marks or not isinstance(item, pytest.Function):
        return [item]
    new = []
    for mark in marks:
        try:
            checker, key = _marker_checker(item, mark, session)
        except (pytest.UsageError, AttnSpecError) as exc:
            new.append(MarkerError.from_parent(item.parent, name=item.name, message=str(exc)))
            continue
        many = len(marks) > 1
        made = checker.items(item.parent, key, name=lambda pid: f"{item.name}[{key + ':' if many else ''}{pid}]")
        for one in made:
            one.rerun = f"pytest '{one.nodeid}' --attn-seed={checker.plan.seed}"
        new += made
    return new


def _marker_checker(item, mark, session: AttnSpecSession):
    from attn_spec.api import target_options
    from attn_spec.targets.conventions import make_target
    from attn_spec.targets.deadline import timeout
    from attn_spec.targets.loading import load_target, spec_of

    keywords = dict(mark.kwargs)
    target = keywords.pop("target", mark.args[0] if mark.args else None)
    label = f"@pytest.mark.attn_spec on {item.name} ({{key}}=)"
    if target is None or "targets" in keywords:
        raise AttnSpecError(f"{label.format(key='target')}: give one target, as target=obj or a TARGET string")
    layer = config_table.keywords(keywords, label, base=item.path.parent)
    settings = config_table.overlay(session.settings, layer)
    seed = settings["seed"] if "seed" in layer.values else session.seed
    if isinstance(target, str):
        key, obj = target, load_target(target)
    else:
        key, obj = spec_of(target) or getattr(target, "__qualname__", type(target).__name__), target
    with timeout(settings["call-timeout"]):  # the layout probe's calls
        made = make_target(obj, key, settings["convention"], settings["masks"] or None,
                           inference_only=settings["inference-only"], **target_options(settings))
    return Checker(settings, seed, {key: made}), key


class MarkerError(pytest.Item):
    """A marked test whose marker cannot be used (a bad setting, a target that cannot be loaded)."""

    def __init__(self, *, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message = message

    def runtest(self) -> None:
        pytest.fail(self.message, pytrace=False)

    def reportinfo(self):
        return self.path, None, _domain(self)
