"""What the grader writes: grades.csv, grades.json, feedback/<name>.md, summary.md, results.json.

Every file is written to a temporary name in the output folder and renamed into place, so a
link planted under the final name is replaced, never followed.
"""
from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import statistics
import tempfile
from collections import Counter

import torch

from attn_spec.version import __version__
from attn_spec.report.text import counterexample_matrices

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
    "bad-output": "Your code returned something other than a plain torch.Tensor; those properties fail.",
    "forbidden": "Your code uses a function the assignment forbids.",
    "grader-error": "The grader itself failed on your submission; this is not your fault. Your instructor will regrade it.",
}
STATUS_TEXT = {"pass": "✓ pass", "fail": "✗ fail", "skip": "✗ skipped", "error": "✗ grader error", "n/a": "n/a",
               "bad-output": "✗ bad output", "not-run": "– not run", "missing": "✗ missing"}


def _status(row) -> str:
    text = STATUS_TEXT.get(row.status, f"✗ {row.status}")
    return f"{text} (blocked by {row.blocked_by})" if row.blocked_by else text


def _fence(text: str, lang: str = "") -> str:
    """A code block that the text itself cannot close."""
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def _points(x: float) -> str:
    return f"{x:g}"


def _failure(row, rubric) -> list[str]:
    lines = [f"### {row.id} ({row.convention}): {row.statement}" if row.statement else f"### {row.id} ({row.convention})"]
    lines.append(f"- What happened: {row.message}" if row.message else "- What happened: (no message)")
    if row.blocked_by:  # a consequence, not a cascade of separate failures
        return lines + [f"- Blocked by **{row.blocked_by}**: fix that one first; it probably explains this failure too.", ""]
    if row.cause:
        lines.append(f"- Likely cause: {row.cause}")
    ce = row.counterexample
    if ce:
        lines.append(f"- Counterexample: {ce.get('summary', '')}")
        if ce.get("got_text"):
            lines.append(_fence(counterexample_matrices(ce, colour=False)))
        if ce.get("traceback"):
            lines += ["- Your code raised:", _fence(ce["traceback"])]
        if ce.get("reproduce"):
            lines += [f"- Reproduce it on your machine (profile {rubric.profile}, seed {rubric.seed}):",
                      _fence(ce["reproduce"], "python")]
    return lines + [""]


def feedback_markdown(grade, rubric) -> str:
    """The student's feedback: score, what passed, what failed and why, with counterexamples."""
    lines = [f"# Feedback for {grade.name}", "",
             f"**Score: {_points(grade.score)} / {_points(grade.max_score)}** · outcome: `{grade.outcome}`", "",
             OUTCOME_TEXT.get(grade.outcome, "")]
    if grade.detail:
        lines += ["", _fence(grade.detail) if "\n" in grade.detail else f"Details: {grade.detail}"]
    if grade.forbidden:
        cut = f" Your score is reduced by {rubric.penalty:.0%}." if rubric.penalty else ""
        lines += ["", f"**Forbidden calls**: the assignment does not allow these.{cut}"]
        lines += [f"- `{hit['name']}` {hit['how']}" + (f" (line {hit['line']})" if hit.get("line") else "")
                  for hit in grade.forbidden]
    for conv in ("function", "module"):
        rows = [r for r in grade.properties if r.convention == conv]
        if not rows:
            continue
        name = rubric.conventions[conv].name
        lines += ["", f"## {name} ({conv} convention)", "", "| property | result | points |", "|---|---|---|"]
        lines += [f"| {r.id} | {_status(r)} | {_points(r.points)} / {_points(r.max_points)} |" for r in rows]
        failed = [r for r in rows if r.status not in ("pass", "n/a", "not-run", "missing") and r.max_points]
        if failed:
            lines += ["", "## What to fix" if conv == "function" else f"## What to fix in {name}", ""]
            for row in failed:
                lines += _failure(row, rubric)
    if grade.output.strip():
        lines += ["", "## What your code printed", "", _fence(grade.output)]
    return "\n".join(lines).rstrip() + "\n"


def summary_markdown(grades, rubric) -> str:
    """The class summary: outcomes, score statistics, and the properties most students fail."""
    scores = [g.score / g.max_score for g in grades if g.max_score]
    lines = ["# Class summary", "",
             f"{len(grades)} submissions · profile {rubric.profile} · seed {rubric.seed} · rubric: {rubric.source}", ""]
    if scores:
        lines.append(f"Scores (fraction of max): mean {statistics.mean(scores):.0%}, median {statistics.median(scores):.0%}, "
                     f"full marks {sum(1 for g in grades if g.max_score and g.score == g.max_score)} of {len(grades)}")
    lines += ["", "## Outcomes", "", "| outcome | submissions |", "|---|---|"]
    lines += [f"| {outcome} | {n} |" for outcome, n in Counter(g.outcome for g in grades).most_common()]
    failing = Counter()
    causes: dict[tuple, Counter] = {}
    for g in grades:
        for r in g.properties:
            if r.status not in ("pass", "n/a") and r.max_points:
                key = (r.id, r.convention)
                failing[key] += 1
                causes.setdefault(key, Counter())[r.cause or r.message.split("\n")[0][:100]] += 1
    if failing:
        lines += ["", "## Properties most students fail", "", "| property | convention | failed by | most common diagnosis |",
                  "|---|---|---|---|"]
        for (pid, conv), n in failing.most_common():
            cause = causes[(pid, conv)].most_common(1)[0][0].replace("|", "\\|")
            lines.append(f"| {pid} | {conv} | {n} of {len(grades)} | {cause} |")
    lines += ["", "## Submissions", "", "| name | score | outcome |", "|---|---|---|"]
    lines += [f"| {g.name} | {_points(g.score)} / {_points(g.max_score)} | {g.outcome} |" for g in grades]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """A CSV cell a spreadsheet will not run as a formula."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


def grades_csv(grades) -> str:
    columns = list(dict.fromkeys(f"{r.convention}:{r.id}" for g in grades for r in g.properties))
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["name", "score", "max_score", "outcome"] + columns)
    for g in grades:
        points = {f"{r.convention}:{r.id}": _points(r.points) for r in g.properties}
        writer.writerow([_cell(g.name), _points(g.score), _points(g.max_score), g.outcome]
                        + [points.get(c, "") for c in columns])
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
            "penalty": rubric.penalty}


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
        text = "\n".join(_failure(row, rubric)) if row.status != "pass" else f"{row.id}: {row.statement}"
        tests.append({"name": f"{rubric.conventions[row.convention].name}: {row.id}", "score": row.points,
                      "max_score": row.max_points, "status": "passed" if row.status == "pass" else "failed",
                      "output": text, "output_format": "md", "visibility": "visible",
                      "tags": [row.convention, row.status]})
    head = f"**{grade.outcome}**: {OUTCOME_TEXT.get(grade.outcome, '')}"
    data = {"score": grade.score, "execution_time": grade.seconds, "output": head + (f"\n\n{grade.detail}" if grade.detail else ""),
            "output_format": "md", "visibility": "visible", "stdout_visibility": "hidden", "tests": tests,
            "extra_data": {"outcome": grade.outcome, "max_score": grade.max_score, "forbidden": grade.forbidden}}
    return json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n"


def safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name).lstrip(".") or "_"


def _write(path: str, text: str) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def write_outputs(out: str, grades, rubric, *, gradescope: bool = False) -> list[str]:
    """Write every output file into ``out``; returns their paths."""
    feedback_dir = os.path.join(out, "feedback")
    os.makedirs(feedback_dir, exist_ok=True)
    written, used = [], set()
    for g in grades:
        g.feedback = feedback_markdown(g, rubric)
        stem = base = safe_name(g.name)
        while stem in used:  # two names that differ only in characters a file name cannot hold
            stem = f"{base}-{len(used)}"
        used.add(stem)
        written.append(os.path.join(feedback_dir, stem + ".md"))
        _write(written[-1], g.feedback)
    files = {"grades.csv": grades_csv(grades), "grades.json": grades_json(grades, rubric),
             "summary.md": summary_markdown(grades, rubric)}
    if gradescope:
        files["results.json"] = gradescope_json(grades[0], rubric)
    for name, text in files.items():
        written.append(os.path.join(out, name))
        _write(written[-1], text)
    return written
