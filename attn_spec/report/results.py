"""Conformance results as data: one PropertyResult per property, one TargetReport per target, one Report per run."""
from __future__ import annotations

import enum
import json
import math
from dataclasses import dataclass, field

import torch

from attn_spec.report.counterexample import Counterexample


class Status(enum.StrEnum):
    """What became of one property on one target. The values are the JSON report's (public) strings, and a
    Status equals its string: ``result.status == "fail"`` holds for ``Status.FAIL``."""
    PASS = "pass"
    FAIL = "fail"
    ERROR = "error"  # a bug of the kit's own (its traceback in the message), never hidden
    SKIP = "skip"  # not checked, and the message says why
    NOT_RUN = "not-run"  # -x stopped before it


@dataclass
class PropertyResult:
    id: str
    status: Status  # a str given is read as a Status (an unknown one raises ValueError)
    message: str = ""
    statement: str = ""
    cause: str = ""
    counterexample: Counterexample | None = None
    examples: int = 0
    seconds: float = 0.0
    blocked_by: str | None = None
    vacuous: bool = False  # it would have held only trivially: the output ignores its inputs (see properties.informative)
    expected: bool = False  # listed in an expectations file (--expect): does not fail the gate
    found_after_calls: int | None = None  # calls into the target, since the check began, when it first failed
    case: object = field(default=None, repr=False, compare=False)  # the minimal failing case (not serialised)
    output: dict | None = None  # what the target printed, warned and logged meanwhile (attn_spec.targets.capture)
    platform: list = field(default_factory=list, repr=False)  # a note per case lost to a platform defect (checking.platform)
    hung: bool = field(default=False, repr=False, compare=False)  # it failed on a call past its deadline (not replayed)

    def __setattr__(self, name, value):
        if name == "status":
            value = self.read_status(value)
        super().__setattr__(name, value)

    @classmethod
    def read_status(cls, value) -> Status:
        """``value`` as a Status (a string that names none raises ValueError: a typo is a bug, never a verdict)."""
        return Status(value)

    def to_dict(self) -> dict:
        ce = self.counterexample
        return {"id": self.id, "status": str(self.status), "message": self.message, "cause": self.cause,
                "blocked_by": self.blocked_by, "vacuous": self.vacuous, "expected": self.expected,
                "counterexample": ce.to_dict() if isinstance(ce, Counterexample) else ce,
                "examples": self.examples, "seconds": round(self.seconds, 4),
                "found_after_calls": self.found_after_calls, "output": self.output}


@dataclass
class TargetReport:
    target: str
    convention: str
    properties: list[PropertyResult] = field(default_factory=list)
    calls: int = 0
    behaviours: dict = field(default_factory=dict)  # probed behaviours (attn_spec.targets.behaviours), key -> value
    capabilities: dict = field(default_factory=dict)  # attn_spec.targets.capabilities: name -> yes | no | raises | n/a ...
    lacks: dict = field(default_factory=dict)  # name -> why, for each capability that is not "yes"
    diagnoses: list = field(default_factory=list)  # attn_spec.diagnosis.roots.Diagnosis: one per root cause
    diagnosis_seconds: float = 0.0  # the time the diagnosis took (replays and model fits)
    inference_only: bool = False  # declared an inference kernel: a missing backward is a skip
    state_changes: list = field(default_factory=list)  # global state the target changed: {state, change, during}
    output: dict = field(default_factory=dict)  # phase outside the properties ("import", "layout probe", "header probes") -> output
    masks: list = field(default_factory=list)  # the mask forms the target was called with: bool, additive
    notes: list = field(default_factory=list)  # how the target is called: a detected layout, the mask HF builds
    picture: dict | None = None  # a FlexAttention mod's mask or bias: {"title", "kind", "matrix"}
    envelope: list = field(default_factory=list)  # what the target declares it does not take, which narrowed the
    # check: {"capability", "phrase", "why"} each (attn_spec.targets.capabilities.envelope), named in the verdict

    @property
    def checked(self) -> bool:
        """Some property of the catalog ran on some input and passed (requirements do not count)."""
        return any(p.status == "pass" and ":" not in p.id for p in self.properties)

    @property
    def conforms(self) -> bool:
        """Nothing failed, and something was checked: a target with every property skipped does not conform."""
        return self.checked and all(p.status in ("pass", "skip", "not-run") or p.expected for p in self.properties)

    @property
    def failures(self) -> list[PropertyResult]:
        """Failures that fail the gate (not listed in an expectations file)."""
        return [p for p in self.properties if p.status in ("fail", "error") and not p.expected]

    @property
    def expected_failures(self) -> list[PropertyResult]:
        return [p for p in self.properties if p.status in ("fail", "error") and p.expected]

    @property
    def verdict(self) -> str:
        """``CONFORMS``, ``CONFORMS (2 expected failures: a, b)`` or ``DOES NOT CONFORM (1 of 3 properties fail)``:
        the one line the text, markdown, HTML and JUnit reports all head a target with. A target that declares
        limits conforms within them, and the line says so: ``CONFORMS up to 1024 positions, causal masks only``
        (its ``envelope``), so that a gate reading this line alone is not told more than was checked. Failures
        whose relation never ran (a root's ``not_judged``: the table's "not run (root N)") are counted apart:
        ``1 of 27 properties fail, 15 more not run``."""
        run = [p for p in self.properties if p.status != "not-run"]
        expected = self.expected_failures
        known = (f"{len(expected)} expected failure{'s' if len(expected) != 1 else ''}: "
                 f"{', '.join(p.id for p in expected)}") if expected else ""
        if self.conforms:
            within = "".join(f"{',' if i else ''} {limit['phrase']}" for i, limit in enumerate(self.envelope))
            return f"CONFORMS{within} ({known})" if known else f"CONFORMS{within}"
        if not self.failures and not self.checked:
            return "NOTHING CHECKED (no property ran on any input the target takes)"
        unjudged = {pid for d in self.diagnoses for pid in d.not_judged}  # "not run (root N)" in the table
        failed = [p for p in self.failures if p.id not in unjudged]
        not_run = f", {len(self.failures) - len(failed)} more not run" if len(failed) < len(self.failures) else ""
        return (f"DOES NOT CONFORM ({len(failed)} of {len(run)} properties fail{not_run}{self._per_root()}"
                f"{'; ' + known if known else ''})")

    def _per_root(self) -> str:
        """``: 12 at root 1, 3 at root 2`` where there are several roots: how many failures each accounts for."""
        if len(self.diagnoses) < 2:
            return ""
        failing = {p.id for p in self.failures}
        counts = [sum(pid in failing for pid in d.explains) for d in self.diagnoses]
        return ": " + ", ".join(f"{n} at root {i}" for i, n in enumerate(counts, 1))

    def to_dict(self) -> dict:
        return {"target": self.target, "convention": self.convention, "conforms": self.conforms,
                "verdict": self.verdict, "envelope": [dict(limit) for limit in self.envelope],
                "checked": self.checked, "masks": list(self.masks),
                "calls": self.calls, "behaviours": dict(self.behaviours),
                "conventions": dict(self.behaviours),  # deprecated alias of "behaviours", kept for one release
                "capabilities": dict(self.capabilities), "lacks": dict(self.lacks), "notes": list(self.notes),
                "picture": self.picture, "diagnoses": [d.to_dict() for d in self.diagnoses],
                "inference_only": self.inference_only, "state_changes": list(self.state_changes),
                "output": dict(self.output), "properties": [p.to_dict() for p in self.properties]}


@dataclass
class Report:
    targets: list[TargetReport]
    kit_version: str
    profile: str
    seed: int
    torch_version: str = torch.__version__
    devices: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # e.g. stale lines of an expectations file
    expect: str | None = None  # the expectations file applied (--expect), if any
    not_loaded: list[dict] = field(default_factory=list)  # {target, message}: TARGETs that could not be loaded
    shapes: list[str] = field(default_factory=list)  # fixed shapes checked (--shapes, the scale profile)
    rows_judged: dict = field(default_factory=dict)  # shape -> how its long cases' rows are judged (checking.rows)

    @property
    def conforms(self) -> bool:
        return all(t.conforms for t in self.targets) and not self.not_loaded

    @property
    def platform(self) -> list[dict]:
        """Each platform defect that took cases from a property (attn_spec.checking.platform), once: the
        properties it took them from merged, with how many cases it took."""
        merged: dict = {}
        for p in (p for t in self.targets for p in t.properties):
            for note in p.platform:
                key = (note["what"], note["device"], note["dtype"])
                if key not in merged:
                    merged[key] = {**note, "properties": [], "cases": 0}
                merged[key]["cases"] += 1
                if p.id not in merged[key]["properties"]:
                    merged[key]["properties"].append(p.id)
        return list(merged.values())

    def summary(self) -> dict:
        """The counts of the whole run (the summary line of a multi-target run)."""
        props = [p for t in self.targets for p in t.properties]
        return {"targets": len(self.targets), "conforming": sum(t.conforms for t in self.targets),
                "failures": sum(len(t.failures) for t in self.targets),
                "expected_failures": sum(len(t.expected_failures) for t in self.targets),
                "skips": sum(p.status == "skip" for p in props), "not_run": sum(p.status == "not-run" for p in props),
                "seed": self.seed}

    def summary_line(self) -> str:
        """``3 targets: 2 conform, 1 does not · 4 failures, 13 expected failures, 9 skips · seed 2026 ...``"""
        s = self.summary()

        def n(count, word):
            return f"{count} {word}{'' if count == 1 else 's'}"

        verdicts = f"{s['conforming']} conform{'s' if s['conforming'] == 1 else ''}"
        if s["targets"] > s["conforming"]:
            verdicts += f", {s['targets'] - s['conforming']} {'does' if s['targets'] - s['conforming'] == 1 else 'do'} not"
        counts = [n(s["failures"], "failure"), n(s["expected_failures"], "expected failure"), n(s["skips"], "skip")]
        counts += [f"{s['not_run']} not run"] if s["not_run"] else []
        return (f"{n(s['targets'], 'target')}: {verdicts} · {', '.join(counts)} · "
                f"seed {s['seed']} (--seed {s['seed']} reruns these cases)")

    def to_dict(self) -> dict:
        return {"kit_version": self.kit_version, "profile": self.profile, "seed": self.seed,
                "torch_version": self.torch_version, "devices": self.devices, "dtypes": self.dtypes,
                "conforms": self.conforms, "warnings": list(self.warnings), "expect": self.expect,
                "not_loaded": list(self.not_loaded), "summary": self.summary(), "shapes": list(self.shapes),
                "rows_judged": dict(self.rows_judged), "platform": self.platform,
                "targets": [t.to_dict() for t in self.targets]}

    def to_json(self) -> str:
        """Strict RFC 8259 JSON: NaN and the infinities, which JSON cannot write as numbers, become the
        strings "NaN", "Infinity" and "-Infinity" (``float(x)`` and JavaScript's ``Number(x)`` read them)."""
        return json.dumps(finite_json(self.to_dict()), indent=2, allow_nan=False)

    def __str__(self) -> str:
        return self.render("text")

    def render(self, fmt: str = "text", **options) -> str:
        """The report in ``fmt`` (text, markdown, html, json, junit): :func:`attn_spec.report.render`."""
        from attn_spec.report.render import render
        return render(self, fmt, **options)

    def to_markdown(self) -> str:
        return self.render("markdown")

    def _repr_markdown_(self) -> str:
        return self.render("markdown")

    def _repr_html_(self) -> str:
        """Jupyter's rich display: the self-contained HTML report with heatmaps (attn_spec.report.html)."""
        return self.render("html")


def finite_json(data):
    """``data`` with every non-finite float replaced by "NaN", "Infinity" or "-Infinity"."""
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else ("Infinity" if data > 0 else "-Infinity")
    if isinstance(data, dict):
        return {key: finite_json(value) for key, value in data.items()}
    if isinstance(data, (list, tuple)):
        return [finite_json(value) for value in data]
    return data


def tensor_to_data(t, limit: int = 256):
    """A small tensor as nested lists of floats; a large one as None (the report shows a corner)."""
    if t is None or not isinstance(t, torch.Tensor) or t.numel() > limit:
        return None
    return t.detach().to("cpu", torch.float64).tolist()
