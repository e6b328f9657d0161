"""Reports: the result model (``results``), rendered as text and markdown (``text``), HTML (``html``)
and CI formats (``ci``: JUnit XML, GitHub annotations, expectations files)."""
from attn_spec.report.results import PropertyResult, Report, TargetReport, tensor_to_data
from attn_spec.report.text import counterexample_matrices, failure_section, format_matrix, header_lines, render

__all__ = ["PropertyResult", "Report", "TargetReport", "tensor_to_data", "counterexample_matrices",
           "failure_section", "format_matrix", "header_lines", "render"]
