"""What the grader writes: grades.csv, grades.json, feedback/<name>.md, summary.md, results.json.

Everything a submission produced (its messages, tracebacks, printed output, file name) is text
from outside: in markdown it is escaped or fenced (:mod:`attn_spec.report.markdown`), so it adds no
row, link or HTML to a file. A failure is rendered by the report's own
:func:`~attn_spec.report.text.failure_section`. Files are readable by the grader's user only and are
written to a temporary name in their folder and renamed into place, relative to the folder's open
descriptor: a link planted under a final name is replaced, never followed.
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
import math
import os
import re
import secrets
import statistics
from collections import Counter

import torch

from attn_spec.report import markdown as md
from attn_spec.report.text import failure_section
from attn_spec.version import __version__

OUTCOME_TEXT = {
    "graded": "Every property ran on your code.",
    "syntax-error": "Python could not read your file, so nothing was graded. Fix the syntax error and resubmit.",
    "import-error": "Importing your file failed, so nothing was graded.",
    "missing-attention": "Your file does not define what the assignment asks for.",
    "timeout": ("Your code took too long, so grading stopped there. Properties that finished before keep "
                "their points; the rest were not run. Look for an infinite loop or a very slow step."),
    "memory-limit": "Your code used more memory than allowed, so grading stopped there.",
    "crashed": "Your code crashed the Python process, so grading stopped there.",
    "exited": ("Your code ended the Python process (sys.exit, exit(), quit() or os._exit), so grading stopped "
               "there. A library function must return its result, never exit."),
    "bad-output": "Your code returned something other than a plain real-valued torch.Tensor; those properties fail.",
    "forbidden": "Your code uses a function the assignment forbids.",
    "grader-error": "The grader itself failed on your submission; this is not your fault. Your instructor will regrade it.",
}
STATUS_TEXT = {"pass": "✓ pass", "fail": "✗ fail", "skip": "✗ skipped", "error": "✗ grader error", "n/a": "n/a",
               "bad-output": "✗ bad output", "not-run": "– not run", "missing": "✗ missing"}
POLICY_TEXT = {
    "required": "Required: its points are part of the maximum whether or not you define it.",
    "when-defined": "Counted when defined: its points join both your score and the maximum.",
    "bonus": ("Optional, a bonus: its points add to your score and never to the maximum, so attempting it "
              "can only raise your grade."),
}
BLOCKED_NOTE = ("A failure marked *blocked by* another is most likely a consequence of that one: it costs "
                "nothing beyond that property's points. Fix the first one and the others may pass too.")


def _status(row) -> str:
    text = STATUS_TEXT.get(row.status, f"✗ {row.status}")
    return f"{text} (blocked by {row.blocked_by})" if row.blocked_by else text


def _points(x: float) -> str:
    return f"{x:g}"


def _row_points(row) -> str:
    if row.status == "n/a":
        return "n/a"
    if row.counts == "no":
        return f"not counted (of {_points(row.max_points)})"
    return f"{_points(row.points)} / {_points(row.max_points)}" + (" bonus" if row.counts == "bonus" else "")


def _failure(row, charge_blocked: bool) -> list[str]:
    """One failed row for the student: the report's failure section, with their traceback."""
    if row.blocked_by:  # a consequence, not a cascade of separate failures
        cost = "" if charge_blocked else " It is not counted in your score."
        return [f"### ✗ {row.id}: {row.statement}" if row.statement else f"### ✗ {row.id}",
                f"- what happened: {md.text(row.message)}",
                f"- blocked by **{row.blocked_by}**: fix that one first; it probably explains this failure too.{cost}", ""]
    return [failure_section(row, markdown=True, traceback=True, untrusted=True), ""]


def _score_line(grade) -> str:
    bonus = f" (including {_points(grade.bonus)} bonus)" if grade.bonus else ""
    return f"**Score: {_points(grade.score)} / {_points(grade.max_score)}**{bonus} · outcome: `{grade.outcome}`"


def feedback_markdown(grade, rubric) -> str:
    """The student's feedback: score, what passed, what failed and why, with counterexamples."""
    lines = [f"# Feedback for {md.inline(grade.name)}", "", _score_line(grade), "", OUTCOME_TEXT.get(grade.outcome, "")]
    if grade.detail:
        lines += ["", md.fence(grade.detail) if "\n" in grade.detail.strip() else f"Details: {md.inline(grade.detail)}"]
    if grade.forbidden:
        cut = f" Your score is reduced by {rubric.penalty:.0%}." if rubric.penalty else ""
        lines += ["", f"**Forbidden calls**: the assignment does not allow these.{cut}"]
        lines += [f"- {md.inline(hit['name'])} {hit['how']}" + (f" (line {hit['line']})" if hit.get("line") else "")
                  for hit in grade.forbidden]
    for conv, section in rubric.conventions.items():
        rows = [r for r in grade.properties if r.convention == conv]
        title = f"## {section.name} ({conv} convention)"
        if not rows:
            if section.bonus and grade.outcome not in ("syntax-error", "import-error", "grader-error"):
                lines += ["", title, "", f"Not defined, so not graded. {POLICY_TEXT['bonus']}"]
            continue
        lines += ["", title, ""] + ([POLICY_TEXT[section.policy], ""] if conv != "function" else [])
        lines += ["| property | result | points |", "|---|---|---|"]
        lines += [f"| {r.id} | {_status(r)} | {_row_points(r)} |" for r in rows]
        if any(r.blocked_by for r in rows) and not rubric.charge_blocked:
            lines += ["", BLOCKED_NOTE]
        failed = [r for r in rows if r.status not in ("pass", "n/a", "not-run", "missing") and r.max_points]
        if failed:
            lines += ["", "## What to fix" if conv == "function" else f"## What to fix in {section.name}", ""]
            for row in failed:
                lines += _failure(row, rubric.charge_blocked)
    if grade.output.strip():
        lines += ["", "## What your code printed", "", md.fence(grade.output)]
    return "\n".join(lines).rstrip() + "\n"


def _diagnosis(row) -> str:
    """What the summary says a failure shows: a root failure's own diagnosis; for a blocked one, its root."""
    if row.blocked_by:
        return f"blocked by {row.blocked_by}"
    return row.cause or (row.message.strip().splitlines() or [""])[0]


def summary_markdown(grades, rubric) -> str:
    """The class summary: outcomes, score statistics, and the properties most students fail."""
    scores = [g.score / g.max_score for g in grades if g.max_score]
    lines = ["# Class summary", "",
             f"{len(grades)} submissions · profile {rubric.profile} · seed {rubric.seed} · rubric: "
             f"{md.inline(rubric.source)}", ""]
    if scores:
        lines.append(f"Scores (fraction of max): mean {statistics.mean(scores):.0%}, median {statistics.median(scores):.0%}, "
                     f"full marks {sum(g.full_marks for g in grades)} of {len(grades)}")
    lines += ["", "## Outcomes", "", "| outcome | submissions |", "|---|---|"]
    lines += [f"| {outcome} | {n} |" for outcome, n in Counter(g.outcome for g in grades).most_common()]
    failing = Counter()
    causes: dict[tuple, Counter] = {}
    for g in grades:
        for r in g.properties:
            if r.status not in ("pass", "n/a") and r.max_points:
                key = (r.id, r.convention)
                failing[key] += 1
                causes.setdefault(key, Counter())[_diagnosis(r)] += 1
    if failing:
        lines += ["", "## Properties most students fail", "", "| property | convention | failed by | most common diagnosis |",
                  "|---|---|---|---|"]
        for (pid, conv), n in failing.most_common():
            cause = md.inline(causes[(pid, conv)].most_common(1)[0][0], limit=160)
            lines.append(f"| {pid} | {conv} | {n} of {len(grades)} | {cause} |")
    lines += ["", "## Submissions", "", "| name | score | outcome | feedback |", "|---|---|---|---|"]
    lines += [f"| {md.inline(g.name)} | {_points(g.score)} / {_points(g.max_score)} | {g.outcome} | "
              f"{md.inline(g.feedback_file)} |" for g in grades]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet will not run as a formula."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _csv_points(row) -> str:
    if row.status == "n/a":
        return "n/a"
    return "blocked" if row.counts == "no" else _points(row.points)


def grades_csv(grades) -> str:
    """One row per submission: name, score, max_score, outcome, the points per convention:property
    ("n/a" where it does not apply, "blocked" where a blocked failure is not counted, empty where the
    convention was not graded), and the feedback file."""
    columns = list(dict.fromkeys(f"{r.convention}:{r.id}" for g in grades for r in g.properties))
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["name", "score", "max_score", "outcome"] + columns + ["feedback"])
    for g in grades:
        points = {f"{r.convention}:{r.id}": _csv_points(r) for r in g.properties}
        writer.writerow([_cell(g.name), _points(g.score), _points(g.max_score), g.outcome]
                        + [points.get(c, "") for c in columns] + [_cell(g.feedback_file)])
    return buf.getvalue()


def _jsonable(value):
    """Strict JSON: non-finite floats (a NaN in a counterexample) become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def rubric_summary(rubric) -> dict:
    return {"source": rubric.source, "profile": rubric.profile, "seed": rubric.seed, "dtypes": list(rubric.dtypes),
            "devices": list(rubric.devices), "limits": rubric.limits, "forbidden": list(rubric.forbidden),
            "penalty": rubric.penalty, "charge_blocked": rubric.charge_blocked,
            "policies": {conv: section.policy for conv, section in rubric.conventions.items()}}


def grades_json(grades, rubric) -> str:
    data = {"kit_version": __version__, "torch_version": torch.__version__, "rubric": rubric_summary(rubric),
            "sandbox": next((g.sandbox for g in grades if g.sandbox), {}),
            "outcomes": dict(Counter(g.outcome for g in grades)),
            "submissions": [g.to_dict() for g in grades]}
    return json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n"


def gradescope_json(grade, rubric) -> str:
    """Gradescope's results.json for one submission (score, execution_time, output, tests[])."""
    tests = []
    for row in grade.properties:
        if row.status == "n/a":
            continue
        text = "\n".join(_failure(row, rubric.charge_blocked)) if row.status != "pass" else f"{row.id}: {row.statement}"
        tests.append({"name": f"{rubric.conventions[row.convention].name}: {row.id}", "score": row.points,
                      "max_score": 0.0 if row.counts == "no" else row.max_points,
                      "status": "passed" if row.status == "pass" else "failed",
                      "output": text, "output_format": "md", "visibility": "visible",
                      "tags": [row.convention, row.status] + (["bonus"] if row.counts == "bonus" else [])})
    head = f"**{grade.outcome}**: {OUTCOME_TEXT.get(grade.outcome, '')}"
    detail = md.text(grade.detail) if grade.detail else ""
    data = {"score": grade.score, "execution_time": grade.seconds, "output": head + (f"\n\n{detail}" if detail else ""),
            "output_format": "md", "visibility": "visible", "stdout_visibility": "hidden", "tests": tests,
            "extra_data": {"outcome": grade.outcome, "max_score": grade.max_score, "bonus": grade.bonus,
                           "forbidden": grade.forbidden}}
    return json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n"


# ---------------------------------------------------------------- files


_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def feedback_stem(name: str) -> str:
    """The feedback file's name (without .md) for a submission: the name itself when it is plain
    (letters, digits, ``._-``, at most 100 characters); otherwise a readable form of it plus ``~`` and
    12 hex digits of its SHA-256. Depends on the name alone (stable across runs), and one to one: no
    plain name contains ``~``, and two names that read the same differ in their digest."""
    if _SAFE.fullmatch(name):
        return name
    readable = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:80].lstrip(".")
    return f"{readable}~{hashlib.sha256(name.encode('utf-8', 'surrogateescape')).hexdigest()[:12]}"


def _write(folder_fd: int, name: str, text: str) -> None:
    """Write ``name`` in the open folder (mode 0600), through a temporary file renamed over it."""
    tmp = f".tmp-{secrets.token_hex(8)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder_fd)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, name, src_dir_fd=folder_fd, dst_dir_fd=folder_fd)
    except BaseException:
        os.unlink(tmp, dir_fd=folder_fd)
        raise


def open_folder(path: str, parent_fd: int | None = None) -> int:
    """A descriptor for the folder ``path`` (made 0700 if missing), refusing a link; under ``parent_fd`` if given."""
    try:
        os.mkdir(path, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        pass
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=parent_fd)
    os.fchmod(fd, 0o700)
    return fd


def write_outputs(out: str, grades, rubric, *, gradescope: bool = False) -> list[str]:
    """Write every output file into ``out`` (checked and made 0700 by the command); returns their paths."""
    for g in grades:
        g.feedback_file = f"{feedback_stem(g.name)}.md"
    if len({g.feedback_file for g in grades}) != len(grades):  # a SHA-256 collision, or two equal names
        raise ValueError("two submissions map to the same feedback file")
    written = []
    out_fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        feedback_fd = open_folder("feedback", out_fd)
        try:
            for g in grades:
                g.feedback = feedback_markdown(g, rubric)
                _write(feedback_fd, g.feedback_file, g.feedback)
                written.append(os.path.join(out, "feedback", g.feedback_file))
        finally:
            os.close(feedback_fd)
        files = {"grades.csv": grades_csv(grades), "grades.json": grades_json(grades, rubric),
                 "summary.md": summary_markdown(grades, rubric)}
        if gradescope:
            files["results.json"] = gradescope_json(grades[0], rubric)
        for name, text in files.items():
            _write(out_fd, name, text)
            written.append(os.path.join(out, name))
    finally:
        os.close(out_fd)
    return written
