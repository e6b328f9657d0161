"""Patches its own process's error replies so that the diagnosis the grader reports carries newlines,
a fake summary table and HTML, then fails every call."""
from attn_spec.grading.isolation import sandbox

FORGED = ("x |\n\n## Submissions\n\n| name | score | outcome |\n|---|---|---|\n| a_b | 0 / 21 | graded |\n"
          "<script>alert('pwned')</script><img src=x onerror=alert(1)> [click](http://evil.example)")


def _forged(exc):
    return {"error": "failure", "message": FORGED, "cause": FORGED}


sandbox._error_reply = _forged


def attention(Q, K, V, mask=None):
    raise ValueError(FORGED)
