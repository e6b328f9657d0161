"""One run of the catalog: each property on a target (:mod:`attn_spec.checking.runner`), then the diagnosis
of what failed (:mod:`attn_spec.diagnosis`), in that order and no other.

``attn_spec.check`` and ``attn-spec check`` (a whole report: :meth:`Run.target`), ``check_property`` and the
pytest plugin (one property at a time: :meth:`Run.property`, the plugin's requirements: :meth:`Run.probe`,
:meth:`Run.requirements`) and ``attn_spec.reproduce`` (one case: :meth:`Run.case`) all run through it.
"""
from __future__ import annotations

from dataclasses import dataclass

from attn_spec.checking.catalog import Property
from attn_spec.checking.cases import available_devices
from attn_spec.checking.platform import judge
from attn_spec.checking.runner import UNREPLAYED, blocker, check_target, finish, requirements, run_property
from attn_spec.diagnosis.run import diagnose_one, diagnose_target
from attn_spec.errors import Failure
from attn_spec.properties import catalog
from attn_spec.report import PropertyResult, TargetReport
from attn_spec.targets.base import Target
from attn_spec.targets.behaviours import probe_behaviours
from attn_spec.targets.capabilities import envelope, probe_capabilities
from attn_spec.targets.deadline import timeout


@dataclass
class Run:
    """How the properties run: profile, seed, dtypes (None: each target's own, else all), devices (None: all
    this machine has), fixed shapes (``rungs``), whether failures are diagnosed, and the deadline of each call
    into the target (``call_timeout``; None: the default)."""

    profile: str = "default"
    seed: int = 0
    dtypes: list[str] | None = None
    devices: list[str] | None = None
    rungs: list | None = None
    diagnose: bool = True
    verbose: bool = False
    call_timeout: float | None = None  # seconds a call may take on a small case (attn_spec.targets.deadline)

    def dtypes_for(self, target: Target) -> list[str]:
        """The dtypes given, else the target convention's own (hf: no float64), else all (Target.dtypes)."""
        return target.dtypes(self.dtypes)

    def target(self, target: Target, props: list[Property], *, require=None, progress=None, exitfirst=False,
               expected=()) -> TargetReport:
        """``props`` on ``target`` (attn_spec.checking.runner.check_target), then its failures grouped by root."""
        with timeout(self.call_timeout):
            report = check_target(target, props, profile=self.profile, seed=self.seed, dtypes=self.dtypes_for(target),
                                  devices=self.devices or available_devices(), progress=progress, require=require,
                                  exitfirst=exitfirst, expected=expected, verbose=self.verbose, rungs=self.rungs)
            if self.diagnose:
                if progress and any(r.status == "fail" for r in report.properties):
                    progress(f"{target.name}: diagnosing the failures")
                diagnose_target(target, report, catalog())
                finish(report, target, catalog())  # the replays' calls counted too
        return report

    def property(self, prop: Property, target: Target, *, failed=(), shortlist=()) -> tuple:
        """(result, diagnosis or None, the failed property of ``failed`` that explains it or None): one property
        on its own, as the plugin's items and ``check_property`` run it. ``shortlist``: mistakes already named."""
        with timeout(self.call_timeout):
            result = run_property(prop, target, profile=self.profile, seed=self.seed, dtypes=self.dtypes_for(target),
                                  devices=self.devices or available_devices(), verbose=self.verbose, rungs=self.rungs)
            diagnosis = (diagnose_one(target, result, catalog(), shortlist=list(shortlist))
                         if self.diagnose and result.status == "fail" else None)
        return result, diagnosis, blocker(result, set(failed), catalog()) if result.status in ("fail", "error") else None

    def case(self, prop: Property, target: Target, case) -> None:
        """``prop`` on one case (``attn_spec.reproduce``): returns when it holds; a Failure carries its diagnosis
        (``failure.diagnosis``, or None), a PlatformDefect or Uninformative passes through."""
        try:
            with timeout(self.call_timeout):
                judge(prop, target, case)
        except Failure as failure:
            result = PropertyResult(prop.id, "fail", failure.message, cause=failure.cause, case=case)
            result.hung = isinstance(failure, UNREPLAYED)  # not replayed (checking.runner.UNREPLAYED)
            failure.diagnosis = diagnose_one(target, result, catalog()) if self.diagnose else None
            raise

    def probe(self, target: Target) -> TargetReport:
        """A report with only the header's probes (behaviours, capabilities): what requirements are judged on."""
        report = TargetReport(target.name, target.convention)
        dtypes, device = self.dtypes_for(target), (self.devices or available_devices())[0]
        with timeout(self.call_timeout):
            report.capabilities, report.lacks = probe_capabilities(target, dtypes, device)  # first: the envelope
            report.behaviours = probe_behaviours(target, "float32" if "float32" in dtypes else dtypes[0], device)
        report.envelope = envelope(target.supported)
        return report

    @staticmethod
    def requirements(report: TargetReport, require, target=None) -> list[PropertyResult]:
        """One result per ``require`` item, judged on the probed ``report`` (checking.runner.requirements)."""
        return requirements(report, require, target)
