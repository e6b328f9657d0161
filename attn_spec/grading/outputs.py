"""What the grader writes: grades.csv, grades.json, feedback/<name>.md, summary.md/.json/.html, results.json.

Everything a submission produced (its messages, tracebacks, printed output, file name) is text
from outside: in markdown it is escaped or fenced (:mod:`attn_spec.report.markdown`), so it adds no
row, link or HTML to a file. A failure is rendered by the report's own
:func:`attn_spec.report.render`. Files are readable by the grader's user only and are
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
from collections import Counter

import torch

from attn_spec.grading.summary import class_view, summary_html, summary_json, summary_markdown
from attn_spec.report import markdown as md
from attn_spec.report import render
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
SYMPTOM_NOTE = ("A failure marked *symptom of root N* is explained by that root's mistake: the grader replayed it "
                "and the mistake reproduces every call. A mistake is charged once, at the weight of the most "
                "important property it breaks; its other failures keep their points (not charged). Fix the root "
                "and its symptoms go with it.")


def _roots(grade, conv: str) -> list[dict]:
    return [d for d in grade.roots if d.get("convention") == conv]


def _status(row, roots: list[dict]) -> str:
    text = STATUS_TEXT.get(row.status, f"✗ {row.status}")
    index = next((i for i, d in enumerate(roots, 1) if row.id in d["explains"]), None)
    if index is not None:
        return f"{text} (root {index}: {roots[index - 1]['mistake']})" if row.id == roots[index - 1]["root"] else \
            f"{text} (symptom of root {index})"
    return f"{text} (vacuous: the output ignores its inputs)" if row.vacuous and row.status == "fail" else text


def _points(x: float) -> str:
    return f"{x:g}"


def _row_points(row) -> str:
    if row.status == "n/a":
        return "n/a"
    kept = (" (not charged)" if row.status == "fail" and row.points else
            " (the mistake's charge)" if row.status == "fail" and row.explained_by and row.blocked_by else "")
    return f"{_points(row.points)} / {_points(row.max_points)}" + (" bonus" if row.counts == "bonus" else "") + kept


def _failure(row) -> list[str]:
    """One failed row for the student: the report's failure section, with their traceback."""
    return [render(row, "markdown", traceback=True, untrusted=True), ""]


def root_markdown(d: dict, index: int, total: int, rows: dict, rubric=None) -> list[str]:
    """One root, as ``attn-spec check`` shows it: the named mistake, its fix and evidence, what it explains,
    the failure that shows it (counterexample and reproduce snippet) and the lesson. Its text is the
    kit's own (attn_spec.grading.roots builds it from the catalog), never the submission's."""
    lines = [f"### Root {index} of {total}: {d['sentence']} [{d['mistake']}]", "",
             f"- fix: {d['fix']}", f"- evidence: {d['evidence']}",
             f"- explains: {', '.join(d['explains'])}", *_charge_line(d, rows, rubric),
             f"- the lesson: `attn-spec explain {d['mistake']}`", ""]
    shown = rows.get(d["root"])
    if shown is not None:
        lines += _failure(shown)
    others = [rows[p] for p in d["explains"] if p != d["root"] and p in rows]
    if others:
        lines += ["Also failing because of this root:", ""]
        lines += [f"- {p.id} ({'not charged' if p.points else 'charged'}): "
                  f"{md.inline((p.message.strip().splitlines() or [''])[0])}" for p in others]  # whole, never cut
        lines.append("")
    return lines


def _charge_line(d: dict, rows: dict, rubric=None) -> list[str]:
    """What the root cost and why: once, at the weight of the most important property it breaks, or at the
    rubric's price of the mistake."""
    explained = [rows[p] for p in d["explains"] if p in rows]
    lost = [r for r in explained if r.points < r.max_points]
    if not lost:
        return []
    total = _points(sum(r.max_points - r.points for r in lost))
    if rubric is not None and rubric.charge_blocked:
        return [f"- charged: {total} points, every property it breaks (the rubric charges each failure)"]
    price = rubric.conventions[d["convention"]].mistakes.get(d["mistake"]) if rubric is not None else None
    if price is not None:
        return [f"- charged: {total} point{'' if total == '1' else 's'}, the rubric's price of {d['mistake']} "
                f"([{d['convention']}.mistakes]), taken from {', '.join(r.id for r in lost)}; the others are "
                "not charged"]
    (row,) = lost
    why = ("the only property it breaks" if len(explained) == 1 else
           f"the most important of the {len(explained)} properties it breaks; the others are not charged")
    return [f"- charged: {_points(row.max_points - row.points)} point{'' if row.max_points == 1 else 's'}, the "
            f"weight of {row.id}, {why} (a mistake is charged once, whichever property names it)"]


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
        roots, by_id = _roots(grade, conv), {r.id: r for r in rows}
        lines += ["| property | result | points |", "|---|---|---|"]
        lines += [f"| {r.id} | {_status(r, roots)} | {_row_points(r)} |" for r in rows]
        if any(r.blocked_by and r.explained_by for r in rows) and not rubric.charge_blocked:
            lines += ["", SYMPTOM_NOTE]
        explained = {p for d in roots for p in d["explains"]}
        failed = [r for r in rows if r.status not in ("pass", "n/a", "not-run", "missing") and r.max_points
                  and r.id not in explained]
        if roots or failed:
            lines += ["", "## What to fix" if conv == "function" else f"## What to fix in {section.name}", ""]
            for i, d in enumerate(roots, 1):
                lines += root_markdown(d, i, len(roots), by_id, rubric)
            if roots and failed:
                lines += ["### Other failures (no mistake model explains them)", ""]
            for row in failed:
                lines += _failure(row)
    if grade.output.strip():
        lines += ["", "## What your code printed", "", md.fence(grade.output)]
    return "\n".join(lines).rstrip() + "\n"


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet will not run as a formula."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def _csv_points(row) -> str:
    if row.status == "n/a":
        return "n/a"
    return _points(row.points)


def grades_csv(grades) -> str:
    """One row per submission: name, score, max_score, outcome, the points per convention:property
    ("n/a" where it does not apply, empty where the convention was not graded), and the feedback file."""
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


def _mistakes_markdown(grade) -> list[str]:
    """The named mistakes of a submission, one line each: what it is, the fix, what it explains."""
    if not grade.roots:
        return []
    lines = [f"**Mistakes found ({len(grade.roots)})**: each is charged once; the other failures it explains "
             "are not charged.", ""]
    for d in grade.roots:
        lines.append(f"- `{d['mistake']}` ({d['convention']}): {d['sentence']} Fix: {d['fix']} "
                     f"Explains {', '.join(d['explains'])}. Lesson: `attn-spec explain {d['mistake']}`.")
    return lines


def gradescope_json(grade, rubric) -> str:
    """Gradescope's results.json for one submission (score, execution_time, output, tests[]). A test's status
    follows its score (Gradescope's own default): a failure a root explains that keeps its points (a symptom,
    not charged) is "passed", and its output says that it fails and why it costs nothing."""
    tests = []
    for row in grade.properties:
        if row.status == "n/a":
            continue
        text = "\n".join(_failure(row)) if row.status != "pass" else f"{row.id}: {row.statement}"
        kept = row.status != "pass" and 0 < row.max_points <= row.points
        if row.explained_by:
            charge = ("fails, not charged: " if kept else "") + f"explained by the mistake {row.explained_by}"
            text = f"{charge} (attn-spec explain {row.explained_by})\n\n" + text
        tests.append({"name": f"{rubric.conventions[row.convention].name}: {row.id}", "score": row.points,
                      "max_score": 0.0 if row.counts != "score" else row.max_points,  # they add up to max_score
                      "status": "passed" if row.status == "pass" or kept else "failed",
                      "output": text, "output_format": "md", "visibility": "visible",
                      "tags": [row.convention, row.status] + (["bonus"] if row.counts == "bonus" else [])
                      + (["symptom"] if row.status == "fail" and row.points else [])})
    head = f"**{grade.outcome}**: {OUTCOME_TEXT.get(grade.outcome, '')}"
    detail = md.text(grade.detail) if grade.detail else ""
    output = "\n\n".join([head, *([detail] if detail else []), *(["\n".join(_mistakes_markdown(grade))]
                                                                 if grade.roots else [])])
    data = {"score": grade.score, "execution_time": grade.seconds, "output": output,
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


def summary_files(view: dict) -> dict[str, str]:
    """summary.md, summary.json and summary.html: the instructor's view (attn_spec.grading.summary)."""
    return {"summary.md": summary_markdown(view), "summary.json": summary_json(_jsonable(view)),
            "summary.html": summary_html(view)}


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
                 **summary_files(class_view(grades, rubric))}
        if gradescope:
            files["results.json"] = gradescope_json(grades[0], rubric)
        for name, text in files.items():
            _write(out_fd, name, text)
            written.append(os.path.join(out, name))
    finally:
        os.close(out_fd)
    return written
