"""Markdown that text from outside the kit cannot break: inline text escaped, multi-line text fenced.

A submission's messages, tracebacks, printed output and file names reach the grader's markdown
(feedback, summary, Gradescope's ``output`` fields). Through :func:`inline` such text stays one
line of literal characters: it opens no table row, link, emphasis or HTML tag. Through
:func:`fence` it becomes a code block that nothing inside it can close.
"""
from __future__ import annotations

import re
import unicodedata

# What CommonMark/GFM give a meaning inline (all escapable); "_" only where it can open or close
# emphasis (not inside a word: attention_v2 stays readable).
_SPECIAL = re.compile(r"([\\`*{}\[\]<>|#!~&$]|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9]))")
_SPACE = re.compile(r"\s+")


def _printable(text: str) -> str:
    """Control and format characters (bidi overrides, zero-width joiners) become spaces."""
    return "".join(" " if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch for ch in text)


def inline(text, limit: int | None = None) -> str:
    """``text`` as literal inline markdown: one line, every special character backslash-escaped."""
    text = _SPACE.sub(" ", _printable(str(text))).strip()
    if limit is not None and len(text) > limit:
        text = text[:limit - 1] + "…"
    return _SPECIAL.sub(r"\\\1", text)


def fence(text: str, lang: str = "") -> str:
    """A fenced code block holding ``text`` verbatim, with a fence longer than any backtick run in it."""
    text = str(text).replace("\r", "")
    ticks = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", text)), default=0))
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def text(value) -> str:
    """One line escaped inline; several lines fenced, starting on a line of their own (a fence only
    opens at the start of a line), so ``f"label: {text(x)}"`` is safe either way."""
    value = str(value)
    return "\n" + fence(value) if "\n" in value.strip() else inline(value)
