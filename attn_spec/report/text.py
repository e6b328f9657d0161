"""Reports rendered as text or markdown: the summary table, each failure as a lesson, matrices side by side."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from tabulate import tabulate

if TYPE_CHECKING:
    from attn_spec.report.results import PropertyResult, Report, TargetReport

MAX_SHOWN = 8  # rows and columns of a matrix printed in a report

RED, RESET = "\033[1;31m", "\033[0m"
_ANSI = re.compile(r"\033\[[0-9;]*m")


def format_matrix(t, highlight=None) -> str:
    """The top-left corner of the first matrix in ``t``, as an aligned plain table.

    ``highlight``: a bool tensor shaped like ``t``; those cells are printed in bold red.
    """
    t = t.detach().to("cpu", torch.float64)
    prefix = ""
    while t.dim() > 2:
        prefix += "[0]"
        t, highlight = t[0], (None if highlight is None else highlight[0])
    if t.dim() < 2:
        t = t.reshape(1, -1)
        highlight = None if highlight is None else highlight.reshape(1, -1)
    shown = t[:MAX_SHOWN, :MAX_SHOWN].tolist()
    marked = (highlight[:MAX_SHOWN, :MAX_SHOWN].tolist() if highlight is not None
              else [[False] * len(row) for row in shown])
    rows = [[f"{RED}{x:.4g}{RESET}" if m else f"{x:.4g}" for x, m in zip(row, mrow)]
            + (["…"] if t.shape[1] > MAX_SHOWN else []) for row, mrow in zip(shown, marked)]
    if t.shape[0] > MAX_SHOWN:
        rows.append(["⋮"] * len(rows[0]))
    table = tabulate(rows, tablefmt="plain", disable_numparse=True, stralign="right")
    return (f"{prefix} " if prefix else "") + f"[{t.shape[0]}x{t.shape[1]}]\n" + table


def side_by_side(left: str, right: str, titles=("got", "expected"), gap: int = 4) -> str:
    a, b = left.splitlines(), right.splitlines()

    def width_of(x):
        return len(_ANSI.sub("", x))

    width = max([width_of(x) for x in a] + [len(titles[0])]) + gap
    lines = [titles[0].ljust(width) + titles[1]]
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else ""
        lines.append(x + " " * (width - width_of(x)) + (b[i] if i < len(b) else ""))
    return "\n".join(lines)


def counterexample_matrices(ce: dict, colour: bool) -> str:
    """got beside expected; with ``colour``, the cells that differ in bold red."""
    got, expected = ce.get("got"), ce.get("expected")
    if colour and got is not None and expected is not None:
        got, expected = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
        if got.shape == expected.shape:
            differ = ~torch.isclose(got, expected, rtol=1e-3, atol=1e-6, equal_nan=True)
            return side_by_side(format_matrix(got, differ), format_matrix(expected, differ))
    if ce.get("expected_text"):
        return side_by_side(ce["got_text"], ce["expected_text"])
    return ce["got_text"]


def _short(text: str, limit: int = 100) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[:limit - 1] + "…"


def header_lines(t: TargetReport) -> list[str]:
    """The probed behaviours, and the capabilities the target has and lacks (with why)."""
    lines = []
    if t.behaviours:
        lines.append("behaviours: " + ", ".join(f"{key}={value}" for key, value in t.behaviours.items()))
    if t.capabilities:
        has = [name for name, value in t.capabilities.items() if value == "yes"]
        lacks = [f"{name} ({value}: {_short(t.lacks[name])})" for name, value in t.capabilities.items()
                 if value in ("no", "raises")]
        lines.append("capabilities: " + (", ".join(has) or "none") + ("; lacks " + "; ".join(lacks) if lacks else ""))
    return lines


def _summary_rows(target: TargetReport):
    roots = {pid: (i, d.root) for i, d in enumerate(target.diagnoses, 1) for pid in d.explains}
    for p in target.properties:
        if p.status == "not-run":
            continue  # one line below the table says how many and why
        verdict = p.status if not p.blocked_by else f"fail (blocked by {p.blocked_by})"
        if p.status == "fail" and p.id in roots:
            i, shown = roots[p.id]
            verdict = f"fail (root {i})" if shown == p.id else f"fail (root {i}: blocked by {shown})"
        verdict += " (expected)" if p.expected else ""
        yield [p.id, verdict, p.examples, f"{p.seconds:.2f}s"]


def failure_section(p: PropertyResult, markdown: bool, colour: bool = False, cause: bool = True) -> str:
    """One failure as a lesson: statement, what happened, likely cause, counterexample, reproduction."""
    lines = []
    head = f"{p.id}: {p.statement}" if p.statement else p.id
    lines.append(f"### ✗ {head}" if markdown else f"✗ {head}")
    pad = "" if markdown else "  "
    bullet = "- " if markdown else pad
    lines.append(f"{bullet}what happened: {p.message}")
    if p.cause and cause:
        lines.append(f"{bullet}likely cause: {p.cause}")
    ce = p.counterexample
    if ce:
        lines.append(f"{bullet}counterexample ({ce['summary']}):")
        if ce.get("got_text"):
            block = counterexample_matrices(ce, colour and not markdown)
            lines.append("```\n" + block + "\n```" if markdown else "\n".join(pad * 2 + x for x in block.splitlines()))
        lines.append(f"{bullet}reproduce:")
        snippet = ce["reproduce"]
        lines.append("```python\n" + snippet + "\n```" if markdown else "\n".join(pad * 2 + x for x in snippet.splitlines()))
    return "\n".join(lines)


def failure_text(result) -> str:
    """The lesson for one failed PropertyResult, as the CLI report prints it, plus the target's traceback."""
    text = failure_section(result, markdown=False)
    trace = (result.counterexample or {}).get("traceback")
    return f"{text}\n  traceback of the target:\n{trace}" if trace else text


def root_head(d, index: int, total: int) -> str:
    """The one line that names a root: the mistake and what it does, or what is known without one."""
    if d.guess:
        return f"root {index} of {total}: no mistake model reproduces it; the nearest (a guess): {d.sentence}"
    return f"root {index} of {total}: {d.sentence}" + (f" [{d.mistake}]" if d.mistake else "")


def root_section(d, index: int, total: int, results: dict, markdown: bool, colour: bool = False) -> str:
    """One root cause: what it is, its fix and evidence, the failure that shows it, the ones it explains."""
    pad = "" if markdown else "  "
    bullet = "- " if markdown else pad
    lines = [f"### {root_head(d, index, total)}" if markdown else root_head(d, index, total)]
    if d.fix:
        lines.append(f"{bullet}fix: {d.fix}")
    lines.append(f"{bullet}evidence: {d.evidence}")
    lines.append(f"{bullet}explains: {', '.join(d.explains)}"
                 + (f" (attn-spec explain {d.mistake} for the lesson)" if d.mistake else ""))
    if d.traceback:
        lines.append(f"{bullet}traceback of the target:")
        lines.append("```\n" + d.traceback + "\n```" if markdown else "\n".join(pad * 2 + x for x in d.traceback.splitlines()))
    shown = results.get(d.root)
    if shown is not None:
        lines.append("\n" + failure_section(shown, markdown, colour, cause=not d.mistake or d.guess))
    others = [results[p] for p in d.explains if p != d.root and p in results]
    if others:
        lines.append(f"{bullet}{'also failing because of this root' if d.mistake and not d.guess else 'blocked by it'}"
                     f" (fix it first):")
        lines += [f"{'  - ' if markdown else pad * 2}{p.id}: {_short(p.message, 160)}" for p in others]
    return "\n".join(lines)


def render(report: Report, *, markdown: bool, colour: bool = False) -> str:
    """The report as text (``colour``: ANSI highlighting of differing cells) or markdown."""
    out = []
    header = (f"attn-spec {report.kit_version} · profile {report.profile} · seed {report.seed} · "
              f"torch {report.torch_version} · devices {', '.join(report.devices)} · dtypes {', '.join(report.dtypes)}")
    out.append(f"# Conformance report\n\n{header}" if markdown else header)
    for t in report.targets:
        title = f"{t.target} ({t.convention} convention): {t.verdict}"
        out.append(f"\n## {title}\n" if markdown else f"\n{title}")
        for line in header_lines(t):
            out.append(f"{line}\n" if markdown else line)
        out.append(tabulate(list(_summary_rows(t)), headers=["property", "verdict", "examples", "time"],
                            tablefmt="github" if markdown else "simple"))
        skipped = [p for p in t.properties if p.status == "skip"]
        for p in skipped:
            out.append(f"{'- ' if markdown else '  '}skipped {p.id}: {p.message}")
        not_run = [p for p in t.properties if p.status == "not-run"]
        if not_run:
            out.append(f"{'- ' if markdown else '  '}{len(not_run)} not run: {not_run[0].message}")
        results = {p.id: p for p in t.failures}
        for i, d in enumerate(t.diagnoses, 1):
            out.append("\n" + root_section(d, i, len(t.diagnoses), results, markdown, colour))
        explained = {pid for d in t.diagnoses for pid in d.explains}
        for p in t.failures:
            if p.id in explained:
                continue
            if p.blocked_by:
                out.append(f"\n{'- ' if markdown else ''}{p.id} is blocked by {p.blocked_by}: fix that first "
                           f"({p.message})")
            else:
                out.append("\n" + failure_section(p, markdown, colour))
    out += [f"\n{'- ' if markdown else ''}warning: {w}" for w in report.warnings]
    if len(report.targets) > 1:
        out.append(f"\n**{report.summary_line()}**" if markdown else f"\n{report.summary_line()}")
    return "\n".join(out) + "\n"
