"""Grade submissions: find them, run each in its own confined child, score what the catalog finds.

The grader process generates every input and judges every output with the ordinary catalog
(:func:`attn_spec.checking.runner.run_property` on a :class:`~attn_spec.grading.isolation.remote.RemoteTarget`);
the student's code only ever runs in a child forked from the zygote.
"""
from __future__ import annotations

import difflib
import importlib.machinery
import importlib.util
import itertools
import os
import pkgutil
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field


from attn_spec import reference
from attn_spec.errors import IsolationError
from attn_spec.report.results import PropertyResult, Status
from attn_spec.targets.conventions import PROJECTIONS, FunctionTarget, ModuleTarget
from attn_spec.grading.isolation import zygote
from attn_spec.grading.isolation.remote import RemoteTarget, Stopped, Zygote
from attn_spec.grading.rubric import CONVENTIONS, Rubric
from attn_spec.grading.submissions import Submission, prepare, remove, sandbox_ids
from attn_spec.targets.module_adapters import SeedAdapter
from attn_spec.checking.runner import lost, run_property
from attn_spec.grading.roots import diagnose_rows
from attn_spec.properties import select
from attn_spec.checking.tolerance import naive_multihead, seed_attention

OUTCOMES = ("graded", "syntax-error", "import-error", "missing-attention", "timeout", "memory-limit", "crashed",
            "exited", "bad-output", "forbidden")
GRADER_ERROR = "grader-error"  # a bug or failure of the grader itself, never the student's doing


class SandboxError(IsolationError):
    """The child could not confine itself (a problem of the machine or the kit, never of the submission)."""


@dataclass
class PropertyGrade(PropertyResult):
    """A property's result on one convention of a submission, with its points on top.

    ``status`` is a :class:`PropertyResult`'s (pass, fail, skip, error) or one of the grader's: n/a,
    bad-output, not-run, missing, or the outcome that stopped grading during it. ``counts``: how the
    row counts, "score" (in score and max_score), "bonus" (in score only), or "no" (n/a: nobody is graded
    on it here). ``explained_by``: the mistake of the checked root that explains this failure (see
    attn_spec.grading.roots); with ``blocked_by`` set, the failure is that root's symptom. A root is charged
    once, on its heaviest failures (``charges``); its other failures are not charged."""

    convention: str = ""
    points: float = 0.0
    max_points: float = 0.0
    counts: str = "score"
    explained_by: str = ""

    @classmethod
    def read_status(cls, value):
        """A runner's Status, or one of the grader's own row statuses (n/a, missing, an outcome), kept as its string."""
        return Status(value) if value in {s.value for s in Status} else str(value)


@dataclass
class Grade:
    name: str
    outcome: str
    score: float = 0.0  # bonus points included
    max_score: float = 0.0  # bonus points not included
    bonus: float = 0.0  # the part of score from conventions the rubric counts as a bonus
    detail: str = ""  # what the outcome means for this submission, in words
    properties: list = field(default_factory=list)
    forbidden: list = field(default_factory=list)  # [{"name", "line"?, "how"}]
    found: list = field(default_factory=list)  # conventions the submission defines
    output: str = ""  # its stdout + stderr, truncated
    sandbox: dict = field(default_factory=dict)
    seconds: float = 0.0
    entry: str = ""
    feedback: str = ""
    feedback_file: str = ""  # its file under feedback/, one to one with the name (outputs.feedback_stem)
    roots: list = field(default_factory=list)  # the checked roots, plain data: Diagnosis.to_dict() + convention

    @property
    def full_marks(self) -> bool:
        return bool(self.max_score) and self.score - self.bonus >= self.max_score

    def to_dict(self) -> dict:
        return asdict(self)


# ---------------------------------------------------------------- grading one submission


class Grader:
    """Grades submissions one at a time with one zygote (``--jobs``: several judges, see pool.py)."""

    def __init__(self, rubric: Rubric, launched: zygote.Launch | None = None):
        self.rubric = rubric
        self.launched = launched or zygote.launch()
        self.base = self.launched.base
        try:
            self.zygote = Zygote(self.launched)
            self.ids = sandbox_ids(1)[0]  # the (uid, gid) its children run as; each judge has its own
            self.props = select()
            self.not_applicable = calibrate(self.props, rubric)  # while the zygote warms up
            self.counter = itertools.count(1)
            self.zygote.wait_ready()
        except BaseException:
            self.launched.close()
            raise

    def close(self) -> None:
        self.launched.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def grade(self, sub: Submission) -> Grade:
        start = time.monotonic()
        try:
            grade = self._grade(sub, self.ids)
        except Exception as exc:  # noqa: BLE001 - one submission's grader failure must not stop the class
            grade = Grade(sub.name, GRADER_ERROR, detail=f"the grader failed ({type(exc).__name__}: {exc}); "
                          f"this is not the student's doing:\n{traceback.format_exc()}")
        grade.entry, grade.seconds = sub.entry or "", round(time.monotonic() - start, 3)
        _score(grade, self.rubric)
        return grade

    def _grade(self, sub: Submission, ids) -> Grade:
        grade = Grade(sub.name, "graded")
        if sub.problem:
            return self._not_loaded(grade, "import-error", sub.problem)
        scratch = os.path.join(self.base, f"{os.getpid()}-{next(self.counter):05d}")  # one judge process each
        os.mkdir(scratch, 0o700)
        try:
            problem = prepare(sub, scratch, ids, self.rubric.limits["folder_mb"])
            if problem:
                return self._not_loaded(grade, "import-error", problem)
            limits = self.rubric.limits
            config = {"scratch": scratch, "entry": sub.entry, "limits": limits, "forbidden": list(self.rubric.forbidden),
                      "names": {c: self.rubric.conventions[c].name for c in CONVENTIONS},
                      "devices": list(self.rubric.devices), "uid": ids[0] if ids else None, "gid": ids[1] if ids else None}
            child = self.zygote.spawn(config)
            try:
                self._run(grade, child, sub)
            finally:
                child.close()
                grade.output = child.output.text()
                _note_calls(grade, child)  # close() read the rest: calls made while loading, say
        finally:
            remove(scratch)
        return grade

    def _unrun(self, conv: str, status: str, message: str) -> list[PropertyGrade]:
        """Rows for a convention whose properties cannot run (n/a ones stay n/a)."""
        return [self._row(p, conv, "n/a", self.not_applicable[(conv, p.id)]) if (conv, p.id) in self.not_applicable
                else self._row(p, conv, status, message) for p in self.props if conv in p.conventions]

    def _not_loaded(self, grade: Grade, outcome: str, detail: str) -> Grade:
        grade.outcome, grade.detail = outcome, detail
        for conv, section in self.rubric.conventions.items():
            if section.required:
                grade.properties += self._unrun(conv, "not-run", "not run: the submission could not be loaded")
        return grade

    def _row(self, prop, conv, status, message="", result=None) -> PropertyGrade:
        """The graded row: ``result`` (or a bare one with ``message``) under ``status``, with its points."""
        result = result or PropertyGrade(prop.id, status, message=message)  # a grader's status: n/a, an outcome
        fields = {f: getattr(result, f) for f in PropertyResult.__dataclass_fields__}
        fields.update(status=status, statement=prop.statement, seconds=round(result.seconds, 3), case=None,
                      counterexample=result.counterexample and dict(result.counterexample))  # grades hold plain
        # data only (the counterexample as the JSON report writes it; the case is in it)
        return PropertyGrade(**fields, convention=conv, max_points=self.rubric.conventions[conv].points_for(prop.id))

    def _load(self, grade: Grade, child, sub: Submission) -> dict | None:
        """Scan and import; the load report, or None (with the outcome set) when nothing can be graded."""
        seconds = self.rubric.limits["import_seconds"]
        try:
            scanned, _ = child.receive(seconds, "loading the submission")
            if scanned.get("stage") != "scanned":  # sent before any student code ran: trusted
                raise SandboxError(f"the sandbox could not be set up: {scanned.get('message')}")
            grade.sandbox = scanned.get("sandbox") if isinstance(scanned.get("sandbox"), dict) else {}
            grade.forbidden += [dict(hit, how="named in the source") for hit in scanned.get("forbidden", [])]
            if "unreadable" in scanned:
                self._not_loaded(grade, "import-error", str(scanned["unreadable"]))
                return None
            if "syntax_error" in scanned:
                err = scanned["syntax_error"]
                where = f"line {err['line']}: " if err.get("line") else ""
                text = f"\n    {err['text']}" if err.get("text") else ""
                self._not_loaded(grade, "syntax-error", f"{sub.entry}, {where}{err['message']}{text}")
                return None
            if "too_large" in scanned:
                self._not_loaded(grade, "import-error", str(scanned["too_large"]))
                return None
            loaded, _ = child.receive(seconds, "importing the submission")
        except Stopped as stop:
            self._not_loaded(grade, stop.outcome, stop.detail)
            return None
        if loaded.get("ok") is not True:
            self._not_loaded(grade, *_load_problem(loaded, sub))
            return None
        # Sent after the submission's code ran: plain data of the expected kinds, or nothing.
        found, kinds = loaded.get("found"), loaded.get("kinds")
        return {"found": [c for c in CONVENTIONS if isinstance(found, list) and c in found],
                "kinds": {c: v[:60] for c, v in kinds.items() if c in CONVENTIONS and isinstance(v, str)}
                if isinstance(kinds, dict) else {}}

    def _grade_property(self, prop, target: RemoteTarget, conv: str) -> PropertyGrade:
        try:
            result = run_property(prop, target, profile=self.rubric.profile, seed=self.rubric.seed,
                                  dtypes=list(self.rubric.dtypes), devices=list(self.rubric.devices))
        except Stopped as stop:
            return self._row(prop, conv, stop.outcome, stop.detail)
        status = "bad-output" if target.bad_output and result.status == "fail" else result.status
        target.bad_output = False
        return self._row(prop, conv, status, result=result)

    def _run(self, grade: Grade, child, sub: Submission) -> None:
        loaded = self._load(grade, child, sub)
        if loaded is None:
            return
        grade.found = loaded["found"]
        missing, targets = [], {}
        for conv in CONVENTIONS:
            section = self.rubric.conventions[conv]
            if conv not in grade.found:
                if section.required:
                    kind = loaded["kinds"].get(conv)
                    want = "function" if conv == "function" else "class"
                    missing.append(f"{section.name} is a {kind}, not a {want}" if kind
                                   else f"{section.name} is not defined")
                    grade.properties += self._unrun(conv, "missing", missing[-1])
                continue
            target = targets[conv] = RemoteTarget(child, conv, f"{sub.entry}:{section.name}")
            rows = []
            for prop in (p for p in self.props if conv in p.conventions):
                if (conv, prop.id) in self.not_applicable:
                    rows.append(self._row(prop, conv, "n/a", self.not_applicable[(conv, prop.id)]))
                elif child.stopped:
                    rows.append(self._row(prop, conv, "not-run", f"not run: {child.stopped.detail}"))
                else:
                    rows.append(self._grade_property(prop, target, conv))
            grade.properties += rows
        child.read_hits()
        _note_calls(grade, child)  # before the outcome is decided
        if child.stopped:
            grade.outcome, grade.detail = child.stopped.outcome, child.stopped.detail
        elif missing:
            grade.outcome, grade.detail = "missing-attention", "; ".join(missing)
        elif grade.forbidden:
            grade.outcome = "forbidden"
        elif any(p.status == "bad-output" for p in grade.properties):
            grade.outcome = "bad-output"
            grade.detail = next(p.message for p in grade.properties if p.status == "bad-output")
        self._diagnose(grade, child, targets)

    def _diagnose(self, grade: Grade, child, targets: dict) -> None:
        """The roots of each convention's failures (attn_spec.grading.roots), once the outcome is decided:
        a diagnosis that times out or dies costs the student nothing but the diagnosis (each failure is
        then charged on its own)."""
        for conv, target in targets.items():
            rows = [r for r in grade.properties if r.convention == conv]
            if child.stopped or not any(r.status == "fail" for r in rows):
                continue
            try:
                roots = diagnose_rows(child, target, conv, rows, self.rubric.dtypes, self.rubric.devices[0])
            except Stopped:
                return
            grade.roots += [dict(d.to_dict(), convention=conv) for d in roots]


class _SeedModule(reference.MultiHeadAttention):
    """The seed's module computed in the inputs' dtype (the reference's forward computes in float64)."""

    def forward(self, x_q, x_kv, mask=None):
        weights = {name: getattr(self, name).weight for name in PROJECTIONS}
        return naive_multihead(x_q, x_kv, weights, self.n_heads, mask)  # [Tq, D]


def calibrate(props, rubric: Rubric) -> dict[tuple[str, str], str]:
    """(convention, id) -> why, for properties nobody can be graded on here.

    The kit's own correct attention (the seed's formula, differentiable, in each convention) is
    checked in this process exactly as submissions will be (same profile, seed, dtypes, devices).
    A property it skips (the function convention has no scale argument; this machine has no
    second device; plain attention has no grouped-query form) is not applicable: it counts for
    nothing, for everyone. One it fails is a bug in the kit: reported, and not graded. Never
    decided by a submission: a skip of a submission's own doing is worth no points.
    """
    references = {"function": FunctionTarget(seed_attention, "reference"),
                  "module": ModuleTarget(SeedAdapter(_SeedModule), "reference")}
    found = {}
    for conv, target in references.items():
        for prop in props:
            if conv not in prop.conventions:
                continue
            result = run_property(prop, target, profile=rubric.profile, seed=rubric.seed,
                                  dtypes=list(rubric.dtypes), devices=list(rubric.devices))
            if result.status == "skip":
                found[(conv, prop.id)] = f"does not apply here: {result.message}"
            elif result.status != "pass":
                found[(conv, prop.id)] = f"not graded: the kit's own attention fails it here ({result.message})"[:500]
                warnings.warn(f"attn-spec grade: {prop.id} ({conv}) fails on the kit's own attention; not graded")
    return found


def _platform_only(row) -> bool:
    """A property that lost every case to a platform defect (the kit's own plain formula fails on the same
    inputs: checking.platform) was not checked, through no doing of the student's: never charged."""
    return row.status == "skip" and bool(row.platform) and row.message == f"not checked: {lost(row)}"


def _note_calls(grade: Grade, child) -> None:
    """The forbidden calls the child has reported so far (``child.forbidden``, read from its pipe, where it
    cannot erase them), each once."""
    noted = {hit["name"] for hit in grade.forbidden if hit["how"] == "called while grading"}
    grade.forbidden += [{"name": name, "how": "called while grading"} for name in sorted(child.forbidden - noted)]


def _module_exists(name: str) -> bool | None:
    """Whether the module ``name`` can be found in the grader's Python, importing nothing new: a top-level
    name is looked up on sys.path, a submodule inside its parent when the grader has imported that parent
    (torch.nn, say). None: it cannot tell without importing a package the submission named."""
    parts = name.split(".")
    for depth in range(1, len(parts) + 1):
        full = ".".join(parts[:depth])
        if full in sys.modules:
            continue
        parent = sys.modules.get(".".join(parts[:depth - 1])) if depth > 1 else None
        if depth > 1 and not hasattr(parent, "__path__"):
            return None if parent is None else False  # an unimported parent, or one that is no package
        try:
            spec = (importlib.util.find_spec(full) if depth == 1 else
                    importlib.machinery.PathFinder.find_spec(full, list(parent.__path__)))
        except (ImportError, ValueError):
            return None
        if spec is None:
            return False
        if depth < len(parts):
            return None  # found but not imported here: looking inside it would import it
    return True


def _close_module(name: str) -> str:
    """`` (did you mean 'torch.nn.functional'?)`` for a misspelt submodule of a package the grader has imported."""
    parent, _, leaf = name.rpartition(".")
    package = sys.modules.get(parent)
    if not leaf or not hasattr(package, "__path__"):
        return ""
    close = difflib.get_close_matches(leaf, [m.name for m in pkgutil.iter_modules(package.__path__)], n=1)
    return f" (did you mean {f'{parent}.{close[0]}'!r}?)" if close else ""


def _import_problem(loaded: dict, sub: Submission, message: str) -> str:
    """A failed import in the student's words: which line imports what, and whether that module exists."""
    where = (f"line {loaded['line']} of {str(loaded.get('file') or sub.entry)[:200]}"
             if isinstance(loaded.get("line"), int) else sub.entry or "it")
    module, kind = loaded["module"], str(loaded.get("type", ""))
    if kind != "ModuleNotFoundError":  # the module was found; a name in it, or its own import, failed
        return f"{where} raised {kind[:80] or 'ImportError'} while importing: {message}"
    exists = _module_exists(module)
    if exists is False:
        return (f"{where} imports the module {module!r}, which does not exist: no such module in Python, its "
                f"installed packages or the submission's own files{_close_module(module)}. Check its spelling, "
                f"or submit the file it is in.")
    return (f"{where} imports the module {module!r}, which is installed where it is graded but could not be "
            f"imported by the submission ({message})")


def _load_problem(loaded: dict, sub: Submission) -> tuple[str, str]:
    outcome = loaded.get("outcome") if loaded.get("outcome") in OUTCOMES else "import-error"
    message = str(loaded.get("message", ""))[:2000]
    if outcome == "syntax-error":
        return outcome, f"{loaded.get('file') or sub.entry}, line {loaded.get('line')}: {message}"
    if outcome == "import-error" and isinstance(loaded.get("module"), str):
        return outcome, _import_problem(loaded, sub, message)
    trace = str(loaded.get("traceback", ""))[-3000:]
    return outcome, (f"importing it raised {str(loaded.get('type', 'an exception'))[:80]}: {message}"
                     + (f"\n{trace}" if trace else ""))


def root_rows(rows) -> dict[tuple[str, str], list]:
    """The failing rows each checked root explains, by (convention, the root's property): its own row
    (``explained_by`` set, ``blocked_by`` None) and its symptoms (``blocked_by`` the root's property)."""
    found: dict[tuple[str, str], list] = {}
    for row in rows:
        if row.status == "fail" and row.explained_by:
            found.setdefault((row.convention, row.blocked_by or row.id), []).append(row)
    return found


def charges(rows, weight: float | None = None) -> dict[int, float]:
    """id(row) -> the points a root's failing ``rows`` lose: its charge, taken from the most important property
    it breaks first (the most points; its own property on a tie). The charge is that property's points, or
    ``weight`` when the rubric prices the mistake ([function.mistakes]), at most what the rows are worth. So a
    mistake costs the same whichever property the diagnosis names it on: a mask bug whose root is
    mask-semantics (1 point) that also breaks causal-mask (2) costs 2."""
    ordered = sorted(rows, key=lambda row: (row.max_points, row.blocked_by is None), reverse=True)
    left = ordered[0].max_points if weight is None else weight
    lost = {}
    for row in ordered:
        lost[id(row)], left = min(left, row.max_points), left - min(left, row.max_points)
    return lost


def _score(grade: Grade, rubric: Rubric) -> None:
    """Points for passed properties; a checked root is charged once (``charges``: the weight of the most
    important property it breaks, or the rubric's price of the mistake), and its other failures keep their
    points (unless the rubric charges them too). Everything else earns nothing (fail closed), a vacuous failure included. max_score is
    every counted row's points, pass or fail, so it is the same for every student (n/a rows are n/a for
    everyone); a property the platform kept from being checked costs nothing; a bonus convention's rows
    add to the score only. The forbidden penalty scales the total."""
    lost = {}
    for (conv, _), rows in root_rows(grade.properties).items():
        lost.update(charges(rows, rubric.conventions[conv].mistakes.get(rows[0].explained_by)))
    for row in grade.properties:
        if id(row) in lost and not rubric.charge_blocked:
            row.points = row.max_points - lost[id(row)]
        else:
            row.points = row.max_points if row.status == "pass" or _platform_only(row) else 0.0
        if row.status == "n/a":
            row.max_points, row.counts = 0.0, "no"
        else:
            row.counts = "bonus" if rubric.conventions[row.convention].bonus else "score"
    keep = 1.0 - rubric.penalty if grade.forbidden else 1.0
    base = sum(row.points for row in grade.properties if row.counts == "score")
    bonus = sum(row.points for row in grade.properties if row.counts == "bonus")
    grade.score, grade.bonus = round((base + bonus) * keep, 4), round(bonus * keep, 4)
    grade.max_score = round(sum(row.max_points for row in grade.properties if row.counts == "score"), 4)
