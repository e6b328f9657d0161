"""The instructor's view of a class: summary.md, summary.json and summary.html.

Read before the next lecture: the class's mistakes (each named root, how many students made it,
which, the fix, the lesson), then the failures no mistake model explains, grouped by property. Score
statistics leave the bonus out (a fraction of the assignment's maximum); the per-property counts
leave out students whose file was not graded on that property (it did not load, or grading stopped
before it). Submission names and messages are text from outside: escaped in markdown and HTML.
"""
from __future__ import annotations

import html
import json
import statistics
from collections import Counter

from attn_spec.report import markdown as md

UNGRADED = ("pass", "n/a", "not-run", "missing")  # row statuses that are no failure of the student's code
HEATMAP_MIN = 6  # students from which summary.html draws the students x roots heatmap


def _percent(g) -> float:
    """The score without its bonus, as a fraction of the assignment's maximum."""
    return (g.score - g.bonus) / g.max_score


def mistakes(grades) -> list[dict]:
    """One entry per (convention, mistake) some student made, most frequent first."""
    found: dict[tuple, dict] = {}
    for g in grades:
        for d in g.roots:
            key = (d["convention"], d["mistake"])
            entry = found.setdefault(key, {"mistake": d["mistake"], "convention": d["convention"],
                                           "sentence": d["sentence"], "fix": d["fix"], "students": [],
                                           "lesson": f"attn-spec explain {d['mistake']}"})
            if g.name not in entry["students"]:
                entry["students"].append(g.name)
    return sorted(found.values(), key=lambda e: (-len(e["students"]), e["convention"], e["mistake"]))


def unexplained(grades) -> list[dict]:
    """The failures no root explains, grouped by (convention, property): who, and the most common cause.
    ``of``: the students graded on that property (a load failure is not counted as failing it)."""
    failing: dict[tuple, list] = {}
    graded: Counter = Counter()
    causes: dict[tuple, Counter] = {}
    for g in grades:
        explained = {(d["convention"], p) for d in g.roots for p in d["explains"]}
        for r in g.properties:
            key = (r.convention, r.id)
            if r.status in ("n/a", "not-run", "missing"):
                continue
            graded[key] += 1
            if r.status not in UNGRADED and r.max_points and key not in explained:
                failing.setdefault(key, []).append(g.name)
                causes.setdefault(key, Counter())[r.cause or (r.message.strip().splitlines() or [""])[0]] += 1
    rows = [{"property": pid, "convention": conv, "students": names, "of": graded[(conv, pid)],
             "cause": causes[(conv, pid)].most_common(1)[0][0]} for (conv, pid), names in failing.items()]
    return sorted(rows, key=lambda e: (-len(e["students"]), e["convention"], e["property"]))


def class_view(grades, rubric) -> dict:
    """What summary.md, summary.json and summary.html show, as plain data."""
    scores = [_percent(g) for g in grades if g.max_score]
    return {"submissions": len(grades), "profile": rubric.profile, "seed": rubric.seed, "rubric": rubric.source,
            "scores": {"mean": statistics.mean(scores) if scores else None,
                       "median": statistics.median(scores) if scores else None,
                       "full_marks": sum(g.full_marks for g in grades), "bonus_left_out": True},
            "outcomes": dict(Counter(g.outcome for g in grades).most_common()),
            "mistakes": mistakes(grades), "unexplained": unexplained(grades),
            "students": [{"name": g.name, "score": g.score, "max_score": g.max_score, "bonus": g.bonus,
                          "outcome": g.outcome, "feedback_file": g.feedback_file,
                          "mistakes": [d["mistake"] for d in g.roots]} for g in grades]}


def _names(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(md.inline(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def summary_markdown(view: dict) -> str:
    lines = ["# Class summary", "",
             f"{view['submissions']} submissions · profile {view['profile']} · seed {view['seed']} · rubric: "
             f"{md.inline(view['rubric'])}", ""]
    s = view["scores"]
    if s["mean"] is not None:
        lines.append(f"Scores (fraction of max, bonus left out): mean {s['mean']:.0%}, median {s['median']:.0%}, "
                     f"full marks {s['full_marks']} of {view['submissions']}")
    lines += ["", "## Outcomes", "", "| outcome | submissions |", "|---|---|"]
    lines += [f"| {outcome} | {n} |" for outcome, n in view["outcomes"].items()]
    if view["mistakes"]:
        lines += ["", "## The class's mistakes", "",
                  "Each is a root the grader named and checked: its mistake model reproduces every call of the "
                  "failures it explains.", "",
                  "| mistake | convention | students | which | fix | lesson |", "|---|---|---|---|---|---|"]
        lines += [f"| {e['mistake']} | {e['convention']} | {len(e['students'])} of {view['submissions']} | "
                  f"{_names(e['students'])} | {md.inline(e['fix'], limit=200)} | `{e['lesson']}` |"
                  for e in view["mistakes"]]
    if view["unexplained"]:
        lines += ["", "## Failures no mistake explains", "", "| property | convention | failed by | which | most common cause |",
                  "|---|---|---|---|---|"]
        lines += [f"| {e['property']} | {e['convention']} | {len(e['students'])} of {e['of']} | {_names(e['students'], 6)} | "
                  f"{md.inline(e['cause'], limit=160)} |" for e in view["unexplained"]]
    lines += ["", "## Submissions", "", "| name | score | outcome | mistakes | feedback |", "|---|---|---|---|---|"]
    lines += [f"| {md.inline(st['name'])} | {st['score']:g} / {st['max_score']:g} | {st['outcome']} | "
              f"{', '.join(st['mistakes']) or '-'} | {md.inline(st['feedback_file'])} |" for st in view["students"]]
    return "\n".join(lines) + "\n"


def summary_json(view: dict) -> str:
    return json.dumps(view, indent=2, allow_nan=False) + "\n"


def summary_html(view: dict) -> str:
    """summary.md's tables as a page, with a students x mistakes heatmap once the class has
    :data:`HEATMAP_MIN` students or more (a filled cell: the student made that mistake)."""
    e = html.escape
    out = ["<!doctype html><meta charset='utf-8'><title>Class summary</title>",
           "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
           "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px}th.r{writing-mode:vertical-rl;"
           "transform:rotate(180deg)}td.x{background:#c0392b}td.o{background:#f4f4f4}</style>",
           f"<h1>Class summary</h1><p>{view['submissions']} submissions · profile {e(view['profile'])} · "
           f"seed {view['seed']}</p>"]
    if view["mistakes"]:
        out.append(_html_table("The class's mistakes", ("mistake", "convention", "students", "fix", "lesson"),
                               [(e(m["mistake"]), e(m["convention"]), len(m["students"]), e(m["fix"]),
                                 f"<code>{e(m['lesson'])}</code>") for m in view["mistakes"]]))
    if view["mistakes"] and view["submissions"] >= HEATMAP_MIN:
        columns = [m["mistake"] for m in view["mistakes"]]
        out.append("<h2>Who made which mistake</h2><table><tr><th>student</th>"
                   + "".join(f"<th class='r'>{e(c)}</th>" for c in columns) + "</tr>")
        for st in view["students"]:
            cells = "".join(f"<td class='{'x' if c in st['mistakes'] else 'o'}'></td>" for c in columns)
            out.append(f"<tr><td>{e(st['name'])}</td>{cells}</tr>")
        out.append("</table>")
    if view["unexplained"]:
        out.append(_html_table("Failures no mistake explains", ("property", "convention", "failed by", "most common cause"),
                               [(e(u["property"]), e(u["convention"]), f"{len(u['students'])} of {u['of']}",
                                 e(u["cause"][:300])) for u in view["unexplained"]]))
    return "\n".join(out) + "\n"


def _html_table(title: str, headers, rows) -> str:
    """A titled HTML table; the cells are already escaped."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<h2>{title}</h2><table><tr>{head}</tr>{body}</table>"
