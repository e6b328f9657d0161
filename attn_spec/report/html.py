"""A self-contained HTML conformance report: inline CSS, no scripts, nothing fetched from a network.

For each failure the counterexample's matrices (usually the attention weights recovered from the
target, beside the reference's) are drawn as heatmaps: HTML tables whose cells are coloured by
value, with cells that differ outlined in red and masked-out cells hatched.
"""
from __future__ import annotations

import math
from html import escape

from attn_spec.report.counterexample import Counterexample
from attn_spec.report.matrices import CORNER, format_matrix, inputs_text
from attn_spec.report.text import REPRODUCE_PLATFORM, header_lines, platform_head, root_head, row_verdict

MAX_CELLS = CORNER  # rows and columns drawn per heatmap: all a counterexample keeps

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px;color:#222;max-width:1100px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px;margin:18px 0 6px}
.ok{color:#1a7f37}.bad{color:#cf222e}.meta{color:#555;font-size:13px}
table.summary{border-collapse:collapse;font-size:13px}
table.summary td,table.summary th{border:1px solid #ccc;padding:3px 8px;text-align:left}
td.pass{background:#dafbe1}td.fail,td.error{background:#ffebe9}td.skip{background:#f6f8fa}
.failure{border-left:4px solid #cf222e;padding:4px 12px;margin:14px 0;background:#fffafa}
.maps{display:flex;gap:28px;flex-wrap:wrap;align-items:flex-start}
table.heat{border-collapse:collapse;font:12px ui-monospace,monospace}
table.heat td{width:54px;height:30px;text-align:center;border:1px solid #fff}
table.heat td.diff{outline:3px solid #d62728;outline-offset:-3px}
table.heat td.masked{background-image:repeating-linear-gradient(45deg,rgba(0,0,0,.28) 0 2px,transparent 2px 7px)}
table.heat td.bad{background:#ff7f0e;color:#000}
table.heat caption{font-weight:600;padding:4px;text-align:left;white-space:nowrap}
.legend{font-size:12px;color:#555}pre{background:#f6f8fa;padding:8px;overflow-x:auto;font-size:12px}
"""


def _matrix(m):
    """The failing element's matrix of a counterexample's Matrix, as a list of rows, or None."""
    return None if m is None or m.corner is None else m.corner


def _mask(ce):
    """The mask's matrix at the failing element (True = may attend), where one was kept."""
    data = ce.mask
    for i in ce.element:
        data = data[i] if isinstance(data, list) and i < len(data) else data
    return data if isinstance(data, list) and data and isinstance(data[0], list) else None


def _colour(x: float, lo: float, hi: float) -> tuple[str, str]:
    """(background, text colour) on a white-to-blue scale between lo and hi."""
    t = 0.0 if hi <= lo else min(max((x - lo) / (hi - lo), 0.0), 1.0)
    start, end = (247, 251, 255), (8, 48, 107)
    r, g, b = (round(a + (z - a) * t) for a, z in zip(start, end))
    return f"rgb({r},{g},{b})", "#fff" if t > 0.55 else "#000"


def heatmap(rows, caption: str, *, lo: float, hi: float, mask=None, other=None, size=None) -> str:
    """One matrix as a coloured table; ``mask`` (True = may attend) hatches masked cells, ``other``
    (the matrix to compare with) outlines cells that differ from it."""
    cells = []
    for i, row in enumerate(rows[:MAX_CELLS]):
        tds = []
        for j, x in enumerate(row[:MAX_CELLS]):
            classes, finite = [], isinstance(x, (int, float)) and math.isfinite(x)
            if finite:
                bg, fg = _colour(x, lo, hi)
                style = f' style="background-color:{bg};color:{fg}"'
            else:
                classes.append("bad")
                style = ""
            if mask is not None and i < len(mask) and j < len(mask[i]) and not mask[i][j]:
                classes.append("masked")
            if other is not None and i < len(other) and j < len(other[i]):
                y = other[i][j]
                if not (isinstance(y, (int, float)) and finite and math.isfinite(y) and abs(x - y) <= 1e-6 * (1 + abs(y))):
                    classes.append("diff")
            cls = f' class="{" ".join(classes)}"' if classes else ""
            tds.append(f"<td{cls}{style} title=\"[{i}, {j}] = {x}\">{escape(f'{x:.3g}' if isinstance(x, float) else str(x))}</td>")
        cells.append("<tr>" + "".join(tds) + "</tr>")
    shape = "×".join(map(str, size or (len(rows), len(rows[0]))))  # the whole matrix's, where rows are its corner
    return f'<table class="heat"><caption>{escape(caption)} [{shape}]</caption>{"".join(cells)}</table>'


def _finite(*matrices) -> list[float]:
    return [x for m in matrices if m for row in m for x in row if isinstance(x, (int, float)) and math.isfinite(x)]


def heatmaps(ce) -> str:
    """Got beside expected (the slice that fails), on one colour scale, with differing cells outlined and,
    when the matrices are weights, masked cells hatched."""
    ce = Counterexample.from_dict(ce)
    index = ce.element
    got, expected = _matrix(ce.got), _matrix(ce.expected)
    mask = _mask(ce)  # present only when got is a matrix of weights
    if got is None:
        return ""
    labels = ce.labels or ("target", "reference")
    where = f" {list(index)}" if index else ""
    values = _finite(got, expected) or [0.0, 1.0]
    lo, hi = min(values + [0.0]), max(values)
    maps = [heatmap(got, f"got{where}: {labels[0]}", lo=lo, hi=hi, mask=mask, other=expected,
                    size=(ce.got.rows, ce.got.cols))]
    if expected is not None:
        maps.append(heatmap(expected, f"expected{where}: {labels[1]}", lo=lo, hi=hi, mask=mask,
                            size=(ce.expected.rows, ce.expected.cols)))
    legend = (f'<p class="legend">colour: {lo:.3g} (white) to {hi:.3g} (dark blue); red outline: differs from the '
              f'expected value; {"hatched: masked out; " if mask else ""}orange: NaN or inf</p>')
    if ce.nonfinite_both:
        legend += (f'<p class="legend">NaN or inf on both sides at {ce.nonfinite_both} entries: the target\'s own '
                   f'output was already non-finite there, so the comparison says nothing</p>')
    return f'<div class="maps">{"".join(maps)}</div>{legend}'


def _failure(p) -> str:
    parts = [f'<div class="failure"><h3 class="bad">✗ {escape(p.id)}: {escape(p.statement)}</h3>',
             f"<p><b>what happened:</b> {escape(p.message)}</p>"]
    if p.cause:
        parts.append(f"<p><b>likely cause:</b> {escape(p.cause)}</p>")
    ce = p.counterexample and Counterexample.from_dict(p.counterexample)
    if ce:
        parts.append(f"<p><b>counterexample</b> ({escape(ce.described)}):</p>")
        shown = inputs_text(ce)
        if shown:
            parts.append(f"<pre>inputs:\n{escape(shown)}</pre>")
        parts.append(heatmaps(ce) or f"<pre>{escape(format_matrix(ce.got) if ce.got else '')}</pre>")
        parts.append(f"<p><b>reproduce:</b></p><pre>{escape(ce.reproduce)}</pre>")
    parts.append("</div>")
    return "".join(parts)


def _picture(picture: dict) -> str:
    """A mod's mask (masked cells hatched) or bias as a heatmap."""
    rows = picture.get("matrix")
    if not rows:
        return f'<p class="meta">{escape(picture["title"])}</p>'
    values = [float(x) for row in rows for x in row]
    finite = [x for x in values if math.isfinite(x)] or [0.0, 1.0]
    mask = rows if picture["kind"] == "mask" else None
    table = heatmap([[float(x) for x in row] for row in rows], picture["title"], lo=min(finite + [0.0]),
                    hi=max(finite + [1e-12]), mask=mask)
    legend = "dark: may attend; hatched: masked out" if mask else "colour: the bias added to the score"
    return f'<div class="maps">{table}</div><p class="legend">{legend}</p>'


def _target(t) -> str:
    verdict = f'<span class="{"ok" if t.conforms else "bad"}">{escape(t.verdict)}</span>'
    out = [f"<h2>{escape(t.target)} ({escape(t.convention)} convention): {verdict}</h2>"]
    out += [f'<p class="meta">{escape(line)}</p>' for line in header_lines(t)]
    if t.picture:
        out.append(_picture(t.picture))
    rows = []
    for p in t.properties:
        if p.status == "not-run":
            continue
        verdict = row_verdict(p, t)
        rows.append(f'<tr><td>{escape(p.id)}</td><td class="{escape(p.status)}">{escape(verdict)}</td>'
                    f"<td>{p.examples}</td><td>{p.seconds:.2f}s</td></tr>")
    out.append('<table class="summary"><tr><th>property</th><th>verdict</th><th>examples</th><th>time</th></tr>'
               + "".join(rows) + "</table>")
    not_run = [p for p in t.properties if p.status == "not-run"]
    if not_run:
        out.append(f'<p class="meta">{len(not_run)} not run: {escape(not_run[0].message)}</p>')
    results = {p.id: p for p in t.failures}
    for i, d in enumerate(t.diagnoses, 1):
        out.append(_root(d, i, len(t.diagnoses), results))
    explained = {pid for d in t.diagnoses for pid in d.explains}
    for p in t.failures:
        if p.id in explained:
            continue
        if p.blocked_by:
            out.append(f"<p>{escape(p.id)} is blocked by {escape(p.blocked_by)}: fix that first ({escape(p.message)})</p>")
        else:
            out.append(_failure(p))
    return "".join(out)


def _root(d, index: int, total: int, results: dict) -> str:
    """One root cause: what it is, its fix, evidence and traceback, its failure, the failures it explains."""
    parts = [f"<h3>{escape(root_head(d, index, total))}</h3>"]
    if d.fix:
        parts.append(f"<p><b>fix:</b> {escape(d.fix)}</p>")
    parts.append(f"<p><b>evidence:</b> {escape(d.evidence)}</p>")
    parts.append(f"<p><b>explains:</b> {escape(', '.join(d.evidenced))}</p>")
    if d.unproven:
        parts.append(f"<p><b>blocked</b> (no evidence of their own): {escape(', '.join(d.unproven))}</p>")
    if d.traceback:
        parts.append(f"<p><b>traceback of the target:</b></p><pre>{escape(d.traceback)}</pre>")
    if d.root in results:
        parts.append(_failure(results[d.root]))
    others = [results[p] for p in d.explains if p != d.root and p in results]
    if others:
        parts.append("<p>also failing because of this root (fix it first):</p><ul>"
                     + "".join(f"<li>{escape(p.id)}: {escape(p.message)}</li>" for p in others) + "</ul>")
    return "".join(parts)


def to_html(report) -> str:
    """The whole report as one HTML document (inline CSS, no scripts, no external references)."""
    meta = (f"attn-spec {report.kit_version} · profile {report.profile} · seed {report.seed} · torch "
            f"{report.torch_version} · devices {', '.join(report.devices)} · dtypes {', '.join(report.dtypes)}")
    body = "".join(f'<p class="meta"><b>{escape(platform_head(note))}</b></p><p>{escape(REPRODUCE_PLATFORM)}</p>'
                   f"<pre>{escape(note['reproduce'])}</pre>" for note in report.platform)
    body += "".join(_target(t) for t in report.targets)
    warnings = "".join(f"<p class=\"meta\">warning: {escape(w)}</p>" for w in report.warnings)
    if len(report.targets) > 1:
        warnings += f"<p><b>{escape(report.summary_line())}</b></p>"
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>attn-spec conformance report"
            f"</title><style>{CSS}</style></head><body><h1>Conformance report</h1><p class=\"meta\">{escape(meta)}</p>"
            f"{body}{warnings}</body></html>\n")
