"""attn-spec inside pytest: the catalog as test items, and one property inside your own tests.

Installed with the kit (entry point ``pytest11``: ``attn_spec``); inert unless ``--attn-target`` is given.

    pytest --attn-target mypkg.attn:attention --attn-profile quick
    pytest --attn-target my.py:attention --attn-target my.py:MultiHeadAttention --attn-only causal-mask

Each target gets one item per property, ``attn-spec[TARGET]::PROPERTY-ID``, so ``-k causal-mask``
selects a property and ``-k 'attn-spec[my.py:attention]'`` a target. A failing item shows the
same lesson as ``attn-spec check`` (statement, what happened, likely cause, counterexample,
reproduction); a property that does not apply to the target is skipped with the reason.
The header prints the seed as ``--attn-seed=N``: paste it to rerun the same cases.

pytest-xdist (``-n auto``): every worker must collect the same items and run the same cases.
Items depend only on the command line. With no ``--attn-seed``, the controller draws the seed
once (the one its header prints) and hands it to each worker in ``workerinput`` from the
``pytest_configure_node`` hook. Deriving it from ``PYTEST_XDIST_TESTRUNUID`` instead would not
do: that variable exists only in the workers, so the controller's header would show another seed.

This module is imported by every pytest run once the kit is installed: it imports nothing heavy
at module level; torch, the runner and the user's target load only when ``--attn-target`` is given.
Disable it entirely with ``-p no:attn_spec``.
"""
from __future__ import annotations

import random
import re

import pytest

from attn_spec.errors import AttnSpecError

SEED_KEY = "attn_spec_seed"  # the controller's seed, in each xdist worker's workerinput


def pytest_addoption(parser) -> None:
    group = parser.getgroup("attn-spec", "attn-spec: check attention implementations against the property catalog")
    group.addoption("--attn-target", action="append", default=[], metavar="TARGET",
                    help="path/to/file.py:name or package.module:name; repeat for several targets. "
                         "Without it the plugin does nothing.")
    group.addoption("--attn-convention", metavar="NAME",
                    help="force the targets' convention: function, sdpa, module, torch-mha or adapter "
                         "(default: detected)")
    group.addoption("--attn-profile", default="default", metavar="NAME",
                    help="how hard to look: quick, default or thorough (default: default)")
    group.addoption("--attn-seed", type=int, metavar="N",
                    help="seed for reproducible cases (default: random, printed in the header)")
    group.addoption("--attn-only", action="append", default=[], metavar="IDS",
                    help="run only these property ids (comma-separated; may repeat)")
    group.addoption("--attn-skip", action="append", default=[], metavar="IDS",
                    help="skip these property ids (comma-separated; may repeat)")


def pytest_configure(config) -> None:
    if config.getoption("attn_target"):
        config.pluginmanager.register(AttnSpecRun(config), "attn-spec-run")


def _ids(values: list[str]) -> list[str]:
    return [i for text in values for i in re.split(r"[,\s]+", text) if i]


class AttnSpecRun:
    """The state of one pytest run with ``--attn-target``: loaded targets, settings, failures so far."""

    def __init__(self, config):
        from attn_spec.targets.conventions import make_target
        from attn_spec.checking.cases import DTYPES, available_devices
        from attn_spec.errors import TargetLoadError
        from attn_spec.targets.loading import load_target
        from attn_spec.properties import select
        from attn_spec.checking.strategies import get_profile
        from attn_spec.errors import KitUsageError

        option = config.option
        self.profile, self.convention = option.attn_profile, option.attn_convention
        self.only, self.skip = _ids(option.attn_only), _ids(option.attn_skip)
        self.seed = option.attn_seed
        if self.seed is None:  # an xdist worker takes the controller's seed; otherwise draw one
            self.seed = getattr(config, "workerinput", {}).get(SEED_KEY, random.randrange(2**32))
        self.dtypes, self.devices = list(DTYPES), available_devices()
        self.failed: dict[str, set[str]] = {}  # target spec -> ids that failed so far in this session
        try:
            get_profile(self.profile)
            self.properties = select(self.only, self.skip)
            self.targets = {spec: make_target(load_target(spec), spec, self.convention)
                            for spec in dict.fromkeys(option.attn_target)}
        except (KitUsageError, TargetLoadError) as exc:
            raise pytest.UsageError(f"attn-spec: {exc}") from None

    def pytest_report_header(self, config) -> list[str]:
        import torch

        from attn_spec.version import __version__

        lines = [f"attn-spec {__version__}: profile {self.profile}, --attn-seed={self.seed}, "
                 f"torch {torch.__version__}, devices {', '.join(self.devices)}"]
        lines += [f"attn-spec target: {spec} ({target.convention} convention)" for spec, target in self.targets.items()]
        return lines

    @pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect filter the items
    def pytest_collection_modifyitems(self, session, items) -> None:
        for spec in self.targets:
            name = f"attn-spec[{spec}]"
            items.extend(session.genitems(TargetCollector.from_parent(session, name=name, nodeid=name, spec=spec)))

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:
        """pytest-xdist, in the controller: every worker runs with the seed this header printed."""
        node.workerinput[SEED_KEY] = self.seed

    def rerun_command(self, spec: str, property_id: str) -> str:
        extra = [f"--attn-convention={self.convention}"] if self.convention else []
        return " ".join(["pytest", f"--attn-target={spec}", f"--attn-only={property_id}",
                         f"--attn-profile={self.profile}", f"--attn-seed={self.seed}", *extra])


class TargetCollector(pytest.Collector):
    """``attn-spec[TARGET]``: one item per selected property."""

    def __init__(self, *, spec: str, **kwargs):
        super().__init__(**kwargs)
        self.spec = spec

    def collect(self):
        run = self.config.pluginmanager.get_plugin("attn-spec-run")
        return [PropertyItem.from_parent(self, name=prop.id, prop=prop, run=run) for prop in run.properties]


class PropertyFailed(AttnSpecError, AssertionError):
    """A property does not hold; ``str()`` is the lesson shown as the failure."""


class PropertyItem(pytest.Item):
    """One property on one target, run with Hypothesis exactly as ``attn-spec check`` runs it."""

    def __init__(self, *, prop, run: AttnSpecRun, **kwargs):
        super().__init__(**kwargs)
        self.prop, self.run = prop, run

    def runtest(self) -> None:
        from attn_spec.checking.runner import run_property
        from attn_spec.report.text import failure_text

        spec = self.parent.spec
        result = run_property(self.prop, self.run.targets[spec], profile=self.run.profile, seed=self.run.seed,
                              dtypes=self.run.dtypes, devices=self.run.devices)
        if result.status == "skip":
            pytest.skip(f"{self.prop.id}: {result.message}")
        if result.status in ("fail", "error"):
            failed = self.run.failed.setdefault(spec, set())
            blockers = [b for b in self.prop.after if b in failed]
            failed.add(self.prop.id)
            note = (f"note: {blockers[0]} already failed on this target, and its failure explains this one: "
                    f"fix that first" if blockers else "")
            raise PropertyFailed("\n".join(filter(None, [
                failure_text(result), note, f"rerun: {self.run.rerun_command(spec, self.prop.id)}"])))

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, PropertyFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        return self.path, None, self.nodeid
