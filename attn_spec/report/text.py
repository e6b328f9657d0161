"""Reports rendered as text or markdown: the summary table, each failure as a lesson, matrices side by side."""
from __future__ import annotations

import re
import textwrap
from typing import TYPE_CHECKING

import torch
from tabulate import tabulate

from attn_spec import vocabulary
from attn_spec.report import markdown as md

if TYPE_CHECKING:
    from attn_spec.report.results import PropertyResult, Report, TargetReport

MAX_SHOWN = 8  # rows and columns of a matrix printed in a report

RED, RESET = "\033[1;31m", "\033[0m"
_ANSI = re.compile(r"\033\[[0-9;]*m")


def format_matrix(t, highlight=None, index=None) -> str:
    """The top-left corner of one matrix of ``t`` (the slice ``index`` of its leading dims, the first by
    default), as an aligned plain table headed by its index and shape.

    ``highlight``: a bool tensor shaped like ``t``; those cells are printed in bold red.
    """
    t = t.detach().to("cpu", torch.float64)
    index = tuple(index or ()) or (0,) * max(t.dim() - 2, 0)
    prefix = ""
    if t.dim() > 2:
        prefix = "[" + ", ".join(map(str, index)) + "]"
        t, highlight = t[index], (None if highlight is None else highlight[index])
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


def worst_index(got, expected) -> tuple:
    """The index of the leading dims where ``got`` and ``expected`` differ most (NaN against a number
    counts as the largest difference), so that the slice printed is the one that fails."""
    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)) or got.shape != expected.shape \
            or got.dim() <= 2:
        return ()
    a, b = got.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64)
    diff = (a - b).abs()
    diff = torch.where(torch.isfinite(a) == torch.isfinite(b), diff.nan_to_num(0.0), torch.full_like(diff, torch.inf))
    per_slice = diff.flatten(-2).amax(dim=-1)  # [...]
    return tuple(int(i) for i in torch.unravel_index(per_slice.argmax(), per_slice.shape))


def nonfinite_both(got, expected) -> int:
    """How many entries are NaN or inf on both sides (a comparison that says nothing there)."""
    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)) or got.shape != expected.shape:
        return 0
    return int((~torch.isfinite(got.detach().cpu().double()) & ~torch.isfinite(expected.detach().cpu().double()))
               .sum())


def inputs_text(tensors: dict) -> str:
    """The inputs of a case: small ones as matrices side by side, large ones as shape and range."""
    small = {name: t for name, t in tensors.items() if t is not None and t.numel() <= 64}
    lines = [columns([format_matrix(t.double() if t.dtype == torch.bool else t) for t in small.values()],
                     list(small))] if small else []
    for name, t in tensors.items():
        if t is not None and name not in small:
            x = t.detach().to("cpu", torch.float64)
            lines.append(f"{name} {list(t.shape)}: min {x.min().item():.3g}, max {x.max().item():.3g}, "
                         f"mean {x.mean().item():.3g}")
    return "\n".join(lines)


def columns(blocks: list[str], titles: list[str], gap: int = 4) -> str:
    """Text blocks side by side under their titles."""
    split = [b.splitlines() for b in blocks]

    def width_of(x):
        return len(_ANSI.sub("", x))

    widths = [max([width_of(x) for x in lines] + [len(title)]) + gap for lines, title in zip(split, titles)]
    out = ["".join(title.ljust(w) for title, w in zip(titles, widths)).rstrip()]
    for i in range(max(map(len, split))):
        row = ""
        for lines, w in zip(split, widths):
            x = lines[i] if i < len(lines) else ""
            row += x + " " * (w - width_of(x))
        out.append(row.rstrip())
    return "\n".join(out)


def side_by_side(left: str, right: str, titles=("got", "expected"), gap: int = 4) -> str:
    return columns([left, right], list(titles), gap)


def counterexample_matrices(ce: dict, colour: bool) -> str:
    """got beside expected (the slice that fails, when there are leading dims); with ``colour``, the cells
    that differ in bold red."""
    got, expected = ce.get("got"), ce.get("expected")
    index = tuple(ce.get("slice") or ())
    if colour and got is not None and expected is not None:
        got, expected = torch.tensor(got, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
        if got.shape == expected.shape:
            differ = ~torch.isclose(got, expected, rtol=1e-3, atol=1e-6, equal_nan=True)
            return side_by_side(format_matrix(got, differ, index), format_matrix(expected, differ, index))
    if ce.get("expected_text"):
        return side_by_side(ce["got_text"], ce["expected_text"])
    return ce["got_text"]


def _short(text: str, limit: int = 100) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
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
               and not (name == "length" and value == "yes")]  # no limit up to the probe's ceiling: not news
        lacks = [f"{name} ({value}: {_short(t.lacks[name])})" for name, value in t.capabilities.items()
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


def platform_lines(report: Report, markdown: bool) -> list[str]:
    """Each platform defect, once, under the report's header, with the snippet that shows it in torch alone.
    No target was charged with the cases it took."""
    lines = []
    for note in report.platform:
        lines += ["", f"**{platform_head(note)}**" if markdown else platform_head(note),
                  f"{REPRODUCE_PLATFORM}\n" if markdown else REPRODUCE_PLATFORM,
                  md.fence(note["reproduce"], "python") if markdown else textwrap.indent(note["reproduce"], "    ")]
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


def output_lines(t: TargetReport, markdown: bool) -> list[str]:
    """What the target printed, warned and logged (captured, never shown raw). By default each kind's
    count over the whole check and its first occurrence; with ``-v`` (``all`` kept) all of it, per phase."""
    before = ("import", "layout probe", "header probes")  # the phases before the properties, in their order
    phases = [(phase, t.output[phase]) for phase in before if phase in t.output] + \
        [(p.id, p.output) for p in t.properties if p.output] + \
        [(phase, output) for phase, output in t.output.items() if phase not in before]
    if not phases:
        return []
    bullet = "- " if markdown else "  "
    if any("all" in found for _, output in phases for found in output.values()):
        lines = ["", "output of the target (captured):"]
        for phase, output in phases:
            full = _output_in_full(output, "    ")
            lines += [f"{bullet}{phase}:"] + (["```", *full, "```"] if markdown else full)
        return lines
    lines = ["", "output of the target (captured; attn-spec check -v shows all of it):"]
    for kind in ("stdout", "stderr", "warnings", "logging"):
        where = [(phase, output[kind]) for phase, output in phases if kind in output]
        if where:
            (phase, first), total = where[0], sum(found["count"] for _, found in where)
            lines.append(f"{bullet}{_count(kind, total)} in {_plural(len(where), 'phase')}; "
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
    return f"{picture['title']}:\n" + textwrap.indent(format_matrix(torch.tensor(rows, dtype=torch.float64)), "  ")


def _summary_rows(target: TargetReport):
    roots = {pid: (i, d.root, d) for i, d in enumerate(target.diagnoses, 1) for pid in d.explains}
    for p in target.properties:
        if p.status == "not-run":
            continue  # one line below the table says how many and why
        verdict = p.status if not p.blocked_by else f"fail (blocked by {p.blocked_by})"
        if p.status == "fail" and p.id in roots:
            i, shown, d = roots[p.id]
            verdict = (f"fail (root {i})" if shown == p.id else f"not run (root {i})" if p.id in d.not_judged
                       else f"fail (root {i}: blocked by {shown})")
        verdict += " (expected)" if p.expected else ""
        yield [p.id, verdict, p.examples, f"{p.seconds:.2f}s"]


def failure_section(p: PropertyResult, markdown: bool, colour: bool = False, *, reproduce: bool = True,
                    traceback: bool = False, untrusted: bool = False) -> str:
    """One failure as a lesson: statement, what happened, likely cause, counterexample, reproduction.

    ``reproduce``: end with the copy-paste snippet; ``traceback``: then the target's traceback, if it
    raised; ``untrusted`` (markdown only): the message and cause come from code the reader did not
    write (a student's submission), so they are escaped and cannot add markup (see report.markdown).
    """
    lines = []
    head = f"{p.id}: {p.statement}" if p.statement else p.id
    lines.append(f"### ✗ {head}" if markdown else f"✗ {head}")
    pad = "" if markdown else "  "
    bullet = "- " if markdown else pad

    def said(text: str) -> str:
        return md.text(text) if markdown and untrusted else text

    def block(text: str, lang: str = "") -> str:
        return md.fence(text, lang) if markdown else "\n".join(pad * 2 + x for x in text.splitlines())

    lines.append(f"{bullet}what happened: {said(p.message)}")
    if p.cause:
        lines.append(f"{bullet}likely cause: {said(p.cause)}")
    ce = p.counterexample
    if ce:
        summary = ce["summary"] if ce["summary"].startswith("the call") else f"the case: {ce['summary']}"
        lines.append(f"{bullet}counterexample ({said(summary)}):")
        blocks = []
        if ce.get("inputs_text"):
            blocks.append("inputs:\n" + ce["inputs_text"])
        if ce.get("got_text"):
            labels = ce.get("labels") or ("got", "expected")
            named = f"got = {labels[0]}" + (f"; expected = {labels[1]}" if ce.get("expected_text") else "")
            both = ce.get("nonfinite_both")
            blocks.append(named + ":\n" + counterexample_matrices(ce, colour and not markdown)
                          + (f"\nNaN or inf on both sides at {both} entries: the target's own output was already "
                             f"non-finite there, so the comparison says nothing" if both else ""))
        lines += [block(text) for text in blocks]
        if reproduce:
            lines += [f"{bullet}reproduce:", block(ce["reproduce"], "python")]
    trace = (ce or {}).get("traceback") if traceback else None
    if trace:
        lines += [f"{bullet}traceback of the target:", md.fence(trace) if markdown else trace]
    return "\n".join(lines)


def diagnosis_lines(d, pad: str = "  ") -> list[str]:
    """A root found for one failure on its own (pytest, check_property, reproduce): what, fix, evidence."""
    if d is None:
        return []
    what = (f"diagnosis (a guess): {d.sentence} [{d.mistake}]" if d.guess else
            f"diagnosis: {d.sentence}" + (f" [{d.mistake}] · attn-spec explain {d.mistake}" if d.mistake else ""))
    return [f"{pad}{what}"] + ([f"{pad}fix: {d.fix}"] if d.fix else []) + [f"{pad}evidence: {d.evidence}"]


def failure_text(result, diagnosis=None) -> str:
    """The lesson for one failed PropertyResult, as the CLI report prints it, with the root found for it
    on its own (``diagnosis``, see attn_spec.diagnosis.run.diagnose_one) and the target's traceback."""
    if diagnosis is not None and diagnosis.named:
        result.cause = diagnosis.sentence  # the likely cause is the mistake that reproduces the failure
    lines = [failure_section(result, markdown=False)] + diagnosis_lines(diagnosis)
    trace = (result.counterexample or {}).get("traceback") or getattr(diagnosis, "traceback", "")
    if trace:
        lines += ["  traceback of the target:", trace]
    return "\n".join(lines)


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
    lines.append(f"{bullet}explains: {', '.join(d.evidenced)}"
                 + (f" (attn-spec explain {d.mistake} for the lesson)" if d.mistake else ""))
    if d.unproven:
        lines.append(f"{bullet}blocked (failing too, with no evidence of their own; fix the root first): "
                     f"{', '.join(p for p in d.explains if p in d.unproven)}")
    if d.traceback:
        lines.append(f"{bullet}traceback of the target:")
        lines.append("```\n" + d.traceback + "\n```" if markdown else "\n".join(pad * 2 + x for x in d.traceback.splitlines()))
    shown = results.get(d.root)
    if shown is not None:
        lines.append("\n" + failure_section(shown, markdown, colour))
    others = [results[p] for p in d.explains if p != d.root and p in results]
    if others:
        lines.append(f"{bullet}{'also failing because of this root' if d.named else 'blocked by it'}"
                     f" (fix it first):")
        lines += [f"{'  - ' if markdown else pad * 2}{p.id}: {_short(p.message, 160)}" for p in others]
    return "\n".join(lines)


def render(report: Report, *, markdown: bool, colour: bool = False) -> str:
    """The report as text (``colour``: ANSI highlighting of differing cells) or markdown."""
    out = []
    header = (f"attn-spec {report.kit_version} · profile {report.profile} · seed {report.seed} · "
              f"torch {report.torch_version} · devices {', '.join(report.devices)} · dtypes {', '.join(report.dtypes)}")
    if report.shapes:
        header += f" · shapes {' '.join(report.shapes)}"
    for shape, rule in report.rows_judged.items():
        header += f"\n{shape}: {rule}"
    out.append(f"# Conformance report\n\n{header}" if markdown else header)
    out += platform_lines(report, markdown)
    for t in report.targets:
        title = f"{t.target} ({t.convention} convention): {t.verdict}"
        out.append(f"\n## {title}\n" if markdown else f"\n{title}")
        for line in header_lines(t):
            out.append(f"{line}\n" if markdown else line)
        if t.picture:
            text = picture_text(t.picture)
            out.append(f"```\n{text}\n```\n" if markdown else text)
        out.append(tabulate(list(_summary_rows(t)), headers=["property", "verdict", "examples", "time"],
                            tablefmt="github" if markdown else "simple"))
        skipped = [p for p in t.properties if p.status == "skip"]
        for p in skipped:
            out.append(f"{'- ' if markdown else '  '}skipped {p.id}: {p.message}")
        not_run = [p for p in t.properties if p.status == "not-run"]
        if not_run:
            out.append(f"{'- ' if markdown else '  '}{len(not_run)} not run: {not_run[0].message}")
        out += output_lines(t, markdown)
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
    for missing in report.not_loaded:
        title = f"{missing['target']}: NOT LOADED"
        out.append(f"\n## {title}\n" if markdown else f"\n{title}")
        out.append(missing["message"])
    out += [f"\n{'- ' if markdown else ''}warning: {w}" for w in report.warnings]
    if len(report.targets) > 1:
        out.append(f"\n**{report.summary_line()}**" if markdown else f"\n{report.summary_line()}")
    return "\n".join(out) + "\n"
