"""Reports: the result model (``results``: Status, PropertyResult, TargetReport, Report; ``counterexample``:
Counterexample), written at the end by :func:`render` as text and markdown (``text``, two writers), HTML
(``html``), JSON and CI formats (``ci``: JUnit XML, GitHub annotations, expectations files); matrices are
formatted in ``matrices`` alone."""
from attn_spec.report.counterexample import Counterexample
from attn_spec.report.render import render
from attn_spec.report.results import PropertyResult, Report, Status, TargetReport
from attn_spec.report.text import failure_section, header_lines

__all__ = ["Counterexample", "PropertyResult", "Report", "Status", "TargetReport", "failure_section", "header_lines",
           "render"]
