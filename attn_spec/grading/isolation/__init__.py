"""Grading's process boundary: the warm zygote that forks one sandboxed child per submission
(``zygote``, ``sandbox``), the byte protocol between them (``wire``), the grader's side of it
(``remote``), the child's side of the diagnosis (``diagnosis``), and the static scan for forbidden
calls (``scan``). No grading policy lives here."""
