"""Reports written as text or markdown: the summary table, each failure as a lesson, its matrices.

The two formats are two :class:`Writer` s of the same report: every function here writes through the
writer it is given (a heading, a list item, a code block) and never asks which format it writes.
:func:`attn_spec.report.render.render` picks the writer (``TEXT`` or ``MARKDOWN``).
"""
from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING

from tabulate import tabulate

from attn_spec import vocabulary
from attn_spec.report import markdown as md
from attn_spec.report.counterexample import Counterexample
from attn_spec.report.matrices import counterexample_matrices, picture_matrix

if TYPE_CHECKING:
    from attn_spec.report.results import PropertyResult, Report, TargetReport


class Writer:
    """Text: how it writes the few kinds of line a report has. ``item``: a line of a failure or root section;
    ``sub``: a line under an item; ``entry``: a line under a target's table (skipped, not run); ``note``: a
    line of its own (blocked, a warning); ``table``: tabulate's format; ``colours``: ANSI colours may be used."""
    item, sub, entry, note, table, colours = "  ", "    ", "  ", "", "simple", True

    def document(self, header: str) -> str:
        return header

    def heading(self, level: int, text: str) -> str:
        return text

    def section(self, text: str) -> str:
        """A target's title, set off by a blank line."""
        return f"\n{text}"

    def line(self, text: str) -> str:
        """A line of a header."""
        return text

    def strong(self, text: str) -> str:
        return text

    def block(self, text: str, lang: str = "", pad: str = "    ") -> str:
        """Text kept verbatim, each line indented by ``pad``."""
        return "\n".join(pad + x for x in text.splitlines())

    def said(self, text: str, untrusted: bool) -> str:
        """Text from code the reader did not write (plain text cannot be broken by it)."""
        return text


class MarkdownWriter(Writer):
    """Markdown: headings, list items, fenced blocks; text from outside the kit escaped (report.markdown)."""
    item, sub, entry, note, table, colours = "- ", "  - ", "- ", "- ", "github", False

    def document(self, header: str) -> str:
        return f"# Conformance report\n\n{header}"

    def heading(self, level: int, text: str) -> str:
        return f"{'#' * level} {text}"

    def section(self, text: str) -> str:
        return f"\n## {text}\n"

    def line(self, text: str) -> str:
        return f"{text}\n"  # a paragraph of its own

    def strong(self, text: str) -> str:
        return f"**{text}**"

    def block(self, text: str, lang: str = "", pad: str = "    ") -> str:
        return md.fence(text, lang)

    def said(self, text: str, untrusted: bool) -> str:
        return md.text(text) if untrusted else text


TEXT, MARKDOWN = Writer(), MarkdownWriter()
WRITERS = {"text": TEXT, "markdown": MARKDOWN}


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _short(text: str, limit: int = 100) -> str:
    """A quoted line of the target's own output, cut at ``limit`` (-v shows it all)."""
    line = _first_line(text)
    return line if len(line) <= limit else line[:limit - 1] + "…"


def header_lines(t: TargetReport) -> list[str]:
    """How the target is called, the probed behaviours, and the capabilities it has and lacks (with why)."""
    lines = list(t.notes)
    if t.behaviours:
        lines.append("behaviours: " + ", ".join(f"{key}={value}" for key, value in t.behaviours.items())
                     + " (what the target does where conventions differ, probed on tiny inputs: a description, "
                       "never a failure; attn-spec explain behaviours)")
    if t.capabilities:
        has = [f"max length {value}" if name == "length" else name if value == "yes" else f"{name} ({value})"
               for name, value in t.capabilities.items() if value not in ("no", "raises", "error", "n/a", "unchecked")
               and not (name in ("length", "head-dims", "float32") and value == "yes")]  # no limit, the baseline: not news
        lacks = [f"{name} ({value}: {_first_line(t.lacks[name])})" for name, value in t.capabilities.items()  # uncut
                 if value in ("no", "raises", "error")]
        lines.append("capabilities: " + (", ".join(has) or "none") + ("; lacks " + "; ".join(lacks) if lacks else ""))
    traits = vocabulary.traits(t.convention)
    if t.masks and (traits is None or traits.kind == "attention"):  # a mod or a serving kernel takes no mask
        declarable = "additive" not in t.masks and traits is not None and traits.declarable_masks
        lines.append("masks: " + ", ".join(t.masks) +
                     (" (additive float masks: declare them with --masks bool,additive)" if declarable else ""))
    if t.inference_only:
        lines.append("declared: an inference kernel (inference_only): a missing backward is a skip, not a failure")
    if t.state_changes:
        lines.append("changed global state (restored by the kit after every call): " + "; ".join(
            f"{c['state']} {c['change']} (first by {c['during']})" for c in t.state_changes))
    return lines


def platform_head(note: dict) -> str:
    """One platform defect in one line: the cases it took, what the kit's own formula showed, where, the workaround."""
    return (f"platform defect, not the target's ({_plural(note['cases'], 'case')} of {', '.join(note['properties'])} "
            f"drawn again): {note['what']} · torch {note['torch']} · {note['device']} · {note['dtype']} · "
            f"{'; '.join(note['shapes'])}" + (f" · workaround: {note['workaround']}" if note["workaround"] else ""))


REPRODUCE_PLATFORM = "reproduce (torch alone, no attn-spec code):"


def platform_lines(report: Report, w: Writer) -> list[str]:
    """Each platform defect, once, under the report's header, with the snippet that shows it in torch alone.
    No target was charged with the cases it took."""
    lines = []
    for note in report.platform:
        lines += ["", w.strong(platform_head(note)), w.line(REPRODUCE_PLATFORM), w.block(note["reproduce"], "python")]
    return lines


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _count(kind: str, n: int) -> str:
    if kind in ("stdout", "stderr"):
        return f"{kind}: {_plural(n, 'line')}"
    return f"{kind}: {n:,}"


def _output_in_full(output: dict, pad: str) -> list[str]:
    """All that was kept of each kind (``attn-spec check -v``)."""
    lines = []
    for kind, found in output.items():
        lines.append(f"{pad}{_count(kind, found['count'])}")
        items = found["all"] if isinstance(found["all"], list) else [{"text": found["all"], "count": 1}]
        for item in items:
            times = f" (x{item['count']:,})" if item["count"] > 1 else ""
            lines += [f"{pad}  {line}" for line in (item["text"] + times).splitlines()]
    return lines


def output_text(output: dict) -> str:
    """One phase's captured output: all that was kept (``-v``), else each kind's count and first occurrence."""
    if any("all" in found for found in output.values()):
        return "\n".join(_output_in_full(output, ""))
    return "\n".join(f"{_count(kind, found['count'])}; first: {found['first']}" for kind, found in output.items())


def output_lines(t: TargetReport, w: Writer) -> list[str]:
    """What the target printed, warned and logged (captured, never shown raw). By default each kind's
    count over the whole check and its first occurrence; with ``-v`` (``all`` kept) all of it, per phase."""
    before = ("import", "layout probe", "header probes")  # the phases before the properties, in their order
    phases = [(phase, t.output[phase]) for phase in before if phase in t.output] + \
        [(p.id, p.output) for p in t.properties if p.output] + \
        [(phase, output) for phase, output in t.output.items() if phase not in before]
    if not phases:
        return []
    if any("all" in found for _, output in phases for found in output.values()):
        lines = ["", "output of the target (captured):"]
        for phase, output in phases:
            full = "\n".join(_output_in_full(output, "    "))
            lines += [f"{w.entry}{phase}:", w.block(full, pad="")]
        return lines
    lines = ["", "output of the target (captured; attn-spec check -v shows all of it):"]
    for kind in ("stdout", "stderr", "warnings", "logging"):
        where = [(phase, output[kind]) for phase, output in phases if kind in output]
        if where:
            (phase, first), total = where[0], sum(found["count"] for _, found in where)
            lines.append(f"{w.entry}{_count(kind, total)} in {_plural(len(where), 'phase')}; "
                         f"first, in {phase}: {_short(first['first'])!r}")
    return lines


def picture_text(picture: dict) -> str:
    """A mod's picture: a mask as █ (attend) and · (masked), a bias as numbers."""
    rows = picture.get("matrix")
    if not rows:
        return picture["title"]
    if picture["kind"] == "mask":
        body = ["".join("█" if x else "·" for x in row) for row in rows]
        return f"{picture['title']} (█ attend, · masked):\n" + "\n".join("  " + line for line in body)
    return f"{picture['title']}:\n" + textwrap.indent(picture_matrix(rows), "  ")


def row_verdict(p, target: TargetReport) -> str:
    """A property's verdict in the summary table. One word per meaning: *explained by* a root whose evidence
    reproduces this failure too, *blocked by* a failure that leaves it no evidence of its own (the catalog's
    order put it there), *not run* where its relation never ran (the target raised, or returned no tensor)."""
    verdict = str(p.status) if not p.blocked_by else f"fail (blocked by {p.blocked_by})"
    for i, d in enumerate(target.diagnoses, 1):
        if p.status == "fail" and p.id in d.explains:
            verdict = (f"fail (root {i})" if d.root == p.id else f"not run (root {i})" if p.id in d.not_judged
                       else f"fail (root {i}: blocked by {d.root})" if p.id in d.unproven
                       else f"fail (root {i}: explained by {d.mistake if d.named else d.root})")
            break
    return verdict + (" (expected)" if p.expected else "")


def _summary_rows(target: TargetReport):
    for p in target.properties:
        if p.status == "not-run":
            continue  # one line below the table says how many and why
        yield [p.id, row_verdict(p, target), p.examples, f"{p.seconds:.2f}s"]


def counterexample_lines(ce, w: Writer, colour: bool = False, *, untrusted: bool = False) -> list[str]:
    """A counterexample: what the case was, its inputs (the failing element), got beside expected, each
    labelled with what it really is."""
    ce = Counterexample.from_dict(ce)
    summary = ce.described if ce.described.startswith("the call") else f"the case: {ce.described}"
    lines = [f"{w.item}counterexample ({w.said(summary, untrusted)}):"]
    blocks = []
    if ce.inputs:
        from attn_spec.report.matrices import inputs_text
        shown = inputs_text(ce)
        if shown:
            blocks.append("inputs:\n" + shown)
    if ce.got is not None:
        labels = ce.labels or ("got", "expected")
        named = f"got = {labels[0]}" + (f"; expected = {labels[1]}" if ce.expected is not None else "")
        both = ce.nonfinite_both
        blocks.append(named + ":\n" + counterexample_matrices(ce, colour and w.colours)
                      + (f"\nNaN or inf on both sides at {both} entries: the target's own output was already "
                         f"non-finite there, so the comparison says nothing" if both else ""))
    return lines + [w.block(text) for text in blocks]


def failure_section(p: PropertyResult, w: Writer = TEXT, colour: bool = False, *, reproduce: bool = True,
                    traceback: bool = False, untrusted: bool = False, diagnosis=None) -> str:
    """One failure as a lesson: statement, what happened, likely cause, counterexample, reproduction.

    ``reproduce``: with the copy-paste snippet; ``diagnosis``: the root found for this failure on its own
    (attn_spec.diagnosis.run.diagnose_one; a named one is the likely cause), then its fix and evidence;
    ``traceback``: then the target's traceback, if it raised; ``untrusted`` (markdown only): the message and
    cause come from code the reader did not write (a student's submission), so they are escaped and cannot
    add markup (see report.markdown).
    """
    head = f"{p.id}: {p.statement}" if p.statement else p.id
    cause = diagnosis.sentence if diagnosis is not None and diagnosis.named else p.cause
    lines = [w.heading(3, f"✗ {head}"), f"{w.item}what happened: {w.said(p.message, untrusted)}"]
    if cause:
        lines.append(f"{w.item}likely cause: {w.said(cause, untrusted)}")
    ce = p.counterexample
    if ce:
        lines += counterexample_lines(ce, w, colour, untrusted=untrusted)
        if reproduce:
            lines += [f"{w.item}reproduce:", w.block(ce["reproduce"], "python")]
    lines += diagnosis_lines(diagnosis, w.item)
    trace = ((ce or {}).get("traceback") or getattr(diagnosis, "traceback", "")) if traceback else None
    if trace:
        lines += [f"{w.item}traceback of the target:", w.block(trace, pad="")]
    return "\n".join(lines)


def diagnosis_lines(d, pad: str = "  ") -> list[str]:
    """A root found for one failure on its own (pytest, check_property, reproduce): what, fix, evidence."""
    if d is None:
        return []
    what = (f"diagnosis (a guess): {d.sentence} [{d.mistake}]" if d.guess else
            f"diagnosis: {d.sentence}" + (f" [{d.mistake}] · attn-spec explain {d.mistake}" if d.mistake else ""))
    return [f"{pad}{what}"] + ([f"{pad}fix: {d.fix}"] if d.fix else []) + [f"{pad}evidence: {d.evidence}"]


def root_head(d, index: int, total: int) -> str:
    """The one line that names a root: the mistake and what it does, or what is known without one."""
    if d.guess:
        return f"root {index} of {total}: no mistake model reproduces it; the nearest (a guess): {d.sentence}"
    return f"root {index} of {total}: {d.sentence}" + (f" [{d.mistake}]" if d.mistake else "")


def root_section(d, index: int, total: int, results: dict, w: Writer, colour: bool = False) -> str:
    """One root cause: what it is, its fix and evidence, the failure that shows it, the ones it explains."""
    lines = [w.heading(3, root_head(d, index, total))]
    if d.fix:
        lines.append(f"{w.item}fix: {d.fix}")
    lines.append(f"{w.item}evidence: {d.evidence}")
    lines.append(f"{w.item}explains: {', '.join(d.evidenced)}"
                 + (f" (attn-spec explain {d.mistake} for the lesson)" if d.mistake else ""))
    if d.unproven:
        lines.append(f"{w.item}blocked (failing too, with no evidence of their own; fix the root first): "
                     f"{', '.join(p for p in d.explains if p in d.unproven)}")
    if d.traceback:
        lines += [f"{w.item}traceback of the target:", w.block(d.traceback)]
    shown = results.get(d.root)
    if shown is not None:
        lines.append("\n" + failure_section(shown, w, colour))
    others = [results[p] for p in d.explains if p != d.root and p in results]
    if others:
        lines.append(f"{w.item}also failing because of this root (fix it first):")
        lines += [f"{w.sub}{p.id}: {_first_line(p.message)}" for p in others]
    return "\n".join(lines)


def _first_line(text: str) -> str:
    """A message's first line, whole: an explanatory sentence is never cut."""
    return text.strip().splitlines()[0] if text.strip() else ""


def render(report: Report, w: Writer = TEXT, colour: bool = False) -> str:
    """The report through ``w`` (TEXT or MARKDOWN); ``colour``: ANSI highlighting of differing cells (text)."""
    header = (f"attn-spec {report.kit_version} · profile {report.profile} · seed {report.seed} · "
              f"torch {report.torch_version} · devices {', '.join(report.devices)} · dtypes {', '.join(report.dtypes)}")
    if report.shapes:
        header += f" · shapes {' '.join(report.shapes)}"
    for shape, rule in report.rows_judged.items():
        header += f"\n{shape}: {rule}"
    out = [w.document(header)]
    out += platform_lines(report, w)
    for t in report.targets:
        out.append(w.section(f"{t.target} ({t.convention} convention): {t.verdict}"))
        out += [w.line(line) for line in header_lines(t)]
        if t.picture:
            out.append(w.line(w.block(picture_text(t.picture), pad="")))
        out.append(tabulate(list(_summary_rows(t)), headers=["property", "verdict", "examples", "time"],
                            tablefmt=w.table))
        out += [f"{w.entry}skipped {p.id}: {p.message}" for p in t.properties if p.status == "skip"]
        not_run = [p for p in t.properties if p.status == "not-run"]
        if not_run:
            out.append(f"{w.entry}{len(not_run)} not run: {not_run[0].message}")
        out += output_lines(t, w)
        results = {p.id: p for p in t.failures}
        out += ["\n" + root_section(d, i, len(t.diagnoses), results, w, colour) for i, d in enumerate(t.diagnoses, 1)]
        explained = {pid for d in t.diagnoses for pid in d.explains}
        for p in (p for p in t.failures if p.id not in explained):
            out.append(f"\n{w.note}{p.id} is blocked by {p.blocked_by}: fix that first "
                       f"({p.message})" if p.blocked_by else "\n" + failure_section(p, w, colour))
    for missing in report.not_loaded:
        out += [w.section(f"{missing['target']}: NOT LOADED"), missing["message"]]
    out += [f"\n{w.note}warning: {warning}" for warning in report.warnings]
    if len(report.targets) > 1:
        out.append("\n" + w.strong(report.summary_line()))
    return "\n".join(out) + "\n"
