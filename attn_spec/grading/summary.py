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


STYLE = ("body{font-family:sans-serif;margin:2em;max-width:70em}table{border-collapse:collapse;margin:1em 0}"
         "td,th{border:1px solid #ccc;padding:3px 6px;font-size:13px;text-align:left}th.r{writing-mode:vertical-rl;"
         "transform:rotate(180deg)}td.x{background:#c0392b}td.o{background:#f4f4f4}td.n{text-align:right}"
         "svg text{font-size:11px;font-family:sans-serif}rect.bar{fill:#2e86c1}")
BINS = 11  # the histogram's bins: 0-9%, 10-19%, ..., 90-99%, and full marks (100%) on its own


def histogram(view: dict) -> str:
    """The class's scores (fraction of the maximum, bonus left out) as an inline SVG bar chart: one bar per
    tenth and one for full marks, its count above it, the students' names in its tooltip. No script: it renders
    anywhere."""
    bins: list[list[str]] = [[] for _ in range(BINS)]
    for st in view["students"]:
        if st["max_score"]:
            fraction = max(0.0, (st["score"] - st["bonus"]) / st["max_score"])
            bins[min(BINS - 1, int(fraction * (BINS - 1) + 1e-9))].append(st["name"])
    top, width, height = max(1, *(len(b) for b in bins)), 44, 120
    bars = []
    for i, names in enumerate(bins):
        h = round(height * len(names) / top)
        x, label = 40 + i * width, "100%" if i == BINS - 1 else f"{i * 10}-{i * 10 + 9}%"
        tip = html.escape(f"{label}: {', '.join(names) or 'nobody'}")
        bars.append(f"<g><title>{tip}</title><rect class='bar' x='{x + 4}' y='{20 + height - h}' width='{width - 8}' "
                    f"height='{h}'/><text x='{x + width / 2}' y='{14 + height - h}' text-anchor='middle'>"
                    f"{len(names) or ''}</text><text x='{x + width / 2}' y='{height + 36}' "
                    f"text-anchor='middle'>{label}</text></g>")
    return (f"<h2>Scores</h2><svg role='img' aria-label='histogram of the scores' width='{80 + BINS * width}' "
            f"height='{height + 50}'><line x1='40' y1='{20 + height}' x2='{40 + BINS * width}' y2='{20 + height}' "
            f"stroke='#555'/>{''.join(bars)}</svg>")


def _html_names(names: list[str]) -> str:
    return html.escape(", ".join(names))


def summary_html(view: dict) -> str:
    """summary.md's tables as a page (scores, outcomes, the class's mistakes with their students, what no
    mistake explains, each submission), with the class at a glance: a histogram of the scores, and a
    students x mistakes heatmap once the class has :data:`HEATMAP_MIN` students or more (a filled cell:
    the student made that mistake)."""
    e = html.escape
    out = ["<!doctype html><meta charset='utf-8'><title>Class summary</title>", f"<style>{STYLE}</style>",
           f"<h1>Class summary</h1><p>{view['submissions']} submissions · profile {e(view['profile'])} · "
           f"seed {view['seed']} · rubric: {e(view['rubric'])}</p>"]
    s = view["scores"]
    if s["mean"] is not None:
        out.append(f"<p>Scores (fraction of max, bonus left out): mean {s['mean']:.0%}, median {s['median']:.0%}, "
                   f"full marks {s['full_marks']} of {view['submissions']}</p>")
        out.append(histogram(view))
    out.append(_html_table("Outcomes", ("outcome", "submissions"),
                           [(e(outcome), n) for outcome, n in view["outcomes"].items()]))
    if view["mistakes"]:
        out.append(_html_table("The class's mistakes", ("mistake", "convention", "students", "which", "fix", "lesson"),
                               [(e(m["mistake"]), e(m["convention"]), f"{len(m['students'])} of {view['submissions']}",
                                 _html_names(m["students"]), e(m["fix"]), f"<code>{e(m['lesson'])}</code>")
                                for m in view["mistakes"]]))
    if view["mistakes"] and view["submissions"] >= HEATMAP_MIN:
        columns = [m["mistake"] for m in view["mistakes"]]
        out.append("<h2>Who made which mistake</h2><table><tr><th>student</th>"
                   + "".join(f"<th class='r'>{e(c)}</th>" for c in columns) + "</tr>")
        for st in view["students"]:
            cells = "".join(f"<td class='{'x' if c in st['mistakes'] else 'o'}'></td>" for c in columns)
            out.append(f"<tr><td>{e(st['name'])}</td>{cells}</tr>")
        out.append("</table>")
    if view["unexplained"]:
        out.append(_html_table("Failures no mistake explains",
                               ("property", "convention", "failed by", "which", "most common cause"),
                               [(e(u["property"]), e(u["convention"]), f"{len(u['students'])} of {u['of']}",
                                 _html_names(u["students"]), e(u["cause"][:300])) for u in view["unexplained"]]))
    out.append(_html_table("Submissions", ("name", "score", "outcome", "mistakes", "feedback"),
                           [(e(st["name"]), f"{st['score']:g} / {st['max_score']:g}", e(st["outcome"]),
                             e(", ".join(st["mistakes"]) or "-"),
                             f"<a href='feedback/{e(st['feedback_file'])}'>{e(st['feedback_file'])}</a>")
                            for st in view["students"]]))
    return "\n".join(out) + "\n"


def _html_table(title: str, headers, rows) -> str:
    """A titled HTML table; the cells are already escaped."""
    head = "".join(f"<th>{h}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<h2>{title}</h2><table><tr>{head}</tr>{body}</table>"
