"""What a CI gate needs: JUnit XML, GitHub Actions annotations, and an expectations file."""
from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from attn_spec.report.text import TEXT, failure_section, output_text

if TYPE_CHECKING:
    from attn_spec.report.results import Report

_NOT_XML = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")  # what XML 1.0 cannot hold


def _xml_safe(element: ET.Element) -> None:
    """Replace, in every text and attribute, the characters XML 1.0 forbids (a target's message or
    output may hold control characters) by U+FFFD, so that the file always parses."""
    for e in element.iter():
        e.text = e.text and _NOT_XML.sub("\ufffd", e.text)
        e.attrib.update({k: _NOT_XML.sub("\ufffd", v) for k, v in e.attrib.items()})


def to_junit(report: Report) -> str:
    """JUnit XML: one <testsuite> per target, one <testcase> per property."""
    suites = ET.Element("testsuites", name="attn-spec")
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    total_time = 0.0
    for t in report.targets:
        counts = {"tests": len(t.properties),
                  "failures": sum(p.status == "fail" and not p.expected for p in t.properties),
                  "errors": sum(p.status == "error" and not p.expected for p in t.properties),
                  "skipped": sum(p.status == "skip" or p.expected for p in t.properties)}
        seconds = sum(p.seconds for p in t.properties)
        suite = ET.SubElement(suites, "testsuite", name=t.target, time=f"{seconds:.3f}",
                              **{k: str(v) for k, v in counts.items()})
        props = ET.SubElement(suite, "properties")
        for name, value in (("verdict", t.verdict), ("convention", t.convention), ("profile", report.profile),
                            ("seed", report.seed),
                            ("torch", report.torch_version), ("kit_version", report.kit_version)):
            ET.SubElement(props, "property", name=name, value=str(value))
        for p in t.properties:
            case = ET.SubElement(suite, "testcase", name=p.id, classname=f"attn-spec.{t.target}",
                                 time=f"{p.seconds:.3f}")
            if p.expected:
                kind = "skip" if p.status == "skip" else "failure"
                ET.SubElement(case, "skipped", message=f"expected {kind} (listed in {report.expect}): {p.message}")
            elif p.status in ("fail", "error"):
                element = ET.SubElement(case, "failure" if p.status == "fail" else "error",
                                        message=p.message, type=p.cause or p.status)
                element.text = failure_section(p, TEXT)
            elif p.status in ("skip", "not-run"):
                ET.SubElement(case, "skipped", message=p.message if p.status == "skip" else f"not run: {p.message}")
            if p.output:  # what the target printed, warned and logged meanwhile
                ET.SubElement(case, "system-out").text = output_text(p.output)
        for key in totals:
            totals[key] += counts[key]
        total_time += seconds
    suites.attrib.update({k: str(v) for k, v in totals.items()}, time=f"{total_time:.3f}")
    _xml_safe(suites)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _escape(text: str) -> str:  # GitHub workflow-command escaping
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def github_annotations(report: Report) -> list[str]:
    """``::error`` lines for unexpected failures, ``::warning`` lines for the report's warnings, and a
    ``::notice`` with each target's verdict (and the run's summary line when there are several)."""
    lines = [f"::notice title={_escape(f'attn-spec: {t.target}')}::{_escape(t.verdict)}" for t in report.targets]
    if len(report.targets) > 1:
        lines.append(f"::notice title=attn-spec::{_escape(report.summary_line())}")
    for t in report.targets:
        for p in t.properties:
            if p.status in ("fail", "error") and not p.expected:
                body = p.message + (f" (likely cause: {p.cause})" if p.cause else "")
                lines.append(f"::error title={_escape(f'attn-spec {p.id} on {t.target}')}::{_escape(body)}")
    lines += [f"::warning title=attn-spec::{_escape(w)}" for w in report.warnings]
    return lines


@dataclass
class Expectations:
    """Properties a target is known to fail or skip: one id per line, '#' starts a comment."""

    path: str
    ids: dict[str, str] = field(default_factory=dict)  # id -> its comment

    @classmethod
    def read(cls, path: str) -> "Expectations":
        expectations = cls(path)
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            entry, _, comment = line.partition("#")
            if entry.strip():
                expectations.ids[entry.strip()] = comment.strip()
        return expectations

    def apply(self, report: Report, catalog=()) -> None:
        """Mark listed failures as expected; warn about ids that match nothing or now pass. ``catalog``: the
        property ids there are (the caller's catalog: a report reads none)."""
        known = set(catalog) | {p.id for t in report.targets for p in t.properties}
        for unknown in sorted(set(self.ids) - known):
            report.warnings.append(f"{self.path}: {unknown!r} matches no property id")
        report.expect = self.path
        for t in report.targets:
            for p in t.properties:
                if p.id not in self.ids or p.status == "not-run":
                    continue
                if p.status in ("fail", "error", "skip"):
                    p.expected = True
                else:
                    report.warnings.append(f"{self.path}: {p.id} now passes on {t.target}; "
                                           f"remove it from the expectations file to tighten the gate")
