"""``attn-spec grade``: grade a class's attention submissions safely, fairly and fast.

- :mod:`~attn_spec.grading.rubric`: the TOML rubric (points, profile and seed, limits, forbidden calls).
- :mod:`~attn_spec.grading.submissions`: finds submissions; their scratch folders and sandbox users.
- :mod:`~attn_spec.grading.grader`: grades each submission with the catalog, and scores it.
- :mod:`~attn_spec.grading.roots`: the roots of its failures: the child's diagnosis, re-checked by the grader.
- :mod:`~attn_spec.grading.isolation.remote`: the grader's side of a submission's process (``RemoteTarget``).
- :mod:`~attn_spec.grading.isolation.zygote` and :mod:`~attn_spec.grading.isolation.sandbox`: the warm worker and the
  confined child that runs the student's code.
- :mod:`~attn_spec.grading.isolation.wire` and :mod:`~attn_spec.grading.isolation.scan`: the data-only wire format and
  the static source checks.
- :mod:`~attn_spec.grading.outputs`: grades.csv, grades.json, feedback, Gradescope results.
- :mod:`~attn_spec.grading.summary`: the instructor's view (summary.md, .json, .html: the class's mistakes).

What is and is not isolated is documented in docs/grading.md.
"""
