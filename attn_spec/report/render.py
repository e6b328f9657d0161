"""One entry for every format a verdict is written in: ``render(what, fmt)``.

``what``: a :class:`~attn_spec.report.results.Report` (text, markdown, html, json, junit) or one failed
:class:`~attn_spec.report.results.PropertyResult` (text, markdown: the failure as a lesson). The CLI, the
pytest plugin, grading's feedback and ``Report``'s own ``__str__``/``_repr_html_`` all come through here.
"""
from __future__ import annotations

from attn_spec.errors import KitUsageError
from attn_spec.report.text import WRITERS, failure_section
from attn_spec.report.text import render as render_text

REPORT_FORMATS = ("text", "markdown", "json", "junit", "html")


def render(what, fmt: str = "text", *, colour: bool = False, diagnosis=None, traceback: bool = False,
           untrusted: bool = False, reproduce: bool = True) -> str:
    """``what`` written in ``fmt``. A report: ``colour`` (text only) highlights the cells that differ. A failure:
    ``diagnosis`` (the root found for it on its own: attn_spec.diagnosis.run.diagnose_one) is added
    below it; ``traceback`` ends with the target's; ``untrusted``: its message comes from code the reader did not
    write (a submission's), escaped in markdown; ``reproduce``: with the copy-paste snippet."""
    if hasattr(what, "targets"):
        if fmt in WRITERS:
            return render_text(what, WRITERS[fmt], colour)
        if fmt == "json":
            return what.to_json() + "\n"
        if fmt == "junit":
            from attn_spec.report.ci import to_junit
            return to_junit(what)
        if fmt == "html":
            from attn_spec.report.html import to_html
            return to_html(what)
        raise KitUsageError(f"no report format {fmt!r}: one of {', '.join(REPORT_FORMATS)}")
    if fmt not in WRITERS:
        raise KitUsageError(f"a failure renders as text or markdown, not {fmt!r}")
    return failure_section(what, WRITERS[fmt], colour, reproduce=reproduce, traceback=traceback, untrusted=untrusted,
                           diagnosis=diagnosis)
