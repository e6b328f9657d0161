"""The target's own output: prints, warnings and log records, captured per property as pytest does.

While a property runs (and while a target is imported and its header probed), ``sys.stdout`` and
``sys.stderr`` are bounded sinks, every warning is recorded (filter ``always``), and the root
logger has a recording handler. The report summarises each phase: how much, and the first
occurrence; ``attn-spec check -v`` shows all that was kept. Nothing reaches the real stdout, so
``--format json|junit|markdown`` stays parseable however chatty the target is.

Only Python-level output is captured (as pytest's ``--capture=sys``): a C extension that writes
to file descriptor 1 or 2 itself bypasses ``sys.stdout`` and is not.
"""
from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings

KEEP = 64 * 1024  # characters of each stream kept per phase; the rest is counted, not kept
KEEP_ITEMS = 100  # distinct warnings, and log records, kept per phase
FIRST = 200  # characters of a first occurrence shown in the summary


def _printable(text: str) -> str:
    """``text`` as valid UTF-8 (a lone surrogate would make writing the report fail)."""
    return text.encode("utf-8", "replace").decode("utf-8")


def _first_line(text: str) -> str:
    line = text.lstrip("\n").split("\n", 1)[0]
    return line if len(line) <= FIRST else line[:FIRST - 1] + "…"


class _Sink(io.TextIOBase):
    """A text stream that keeps the first KEEP characters and counts everything."""

    encoding, errors = "utf-8", "replace"

    def __init__(self, name: str):
        super().__init__()
        self.name, self.parts, self.kept, self.chars, self.line_ends, self.last = name, [], 0, 0, 0, "\n"
        self.buffer = _BinarySink(self)

    def write(self, text) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            self.chars += len(text)
            self.line_ends += text.count("\n")
            self.last = text[-1]
            if self.kept < KEEP:
                self.parts.append(text[:KEEP - self.kept])
                self.kept += len(self.parts[-1])
        return len(text)

    @property
    def lines(self) -> int:
        return self.line_ends + (self.last != "\n")  # a last line without its newline counts too

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def summary(self, verbose: bool) -> dict | None:
        if not self.chars:
            return None
        text = _printable("".join(self.parts))
        found = {"count": self.lines, "chars": self.chars, "first": _first_line(text)}
        if verbose:
            found["all"] = text + (f"\n… {self.chars - self.kept} more characters not kept" if self.chars > self.kept else "")
        return found


class _BinarySink(io.RawIOBase):
    """``sys.stdout.buffer``: bytes go to the text sink, decoded."""

    def __init__(self, text: _Sink):
        super().__init__()
        self.text = text

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        self.text.write(bytes(data).decode("utf-8", "replace"))
        return len(data)


class _Items:
    """Warnings or log records: a count, and each distinct text with its count (the first KEEP_ITEMS)."""

    def __init__(self):
        self.count, self.distinct = 0, {}

    def add(self, text: str) -> None:
        text = _printable(text)
        self.count += 1
        if text in self.distinct or len(self.distinct) < KEEP_ITEMS:
            self.distinct[text] = self.distinct.get(text, 0) + 1

    def summary(self, verbose: bool) -> dict | None:
        if not self.count:
            return None
        found = {"count": self.count, "first": _first_line(next(iter(self.distinct)))}
        if verbose:
            found["all"] = [{"text": text, "count": n} for text, n in self.distinct.items()]
        return found


class _LogHandler(logging.Handler):
    def __init__(self, items: _Items):
        super().__init__(logging.NOTSET)
        self.items = items

    def emit(self, record) -> None:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a bad format string in the user's log call
            message = str(record.msg)
        self.items.add(f"{record.levelname} {record.name}: {message}")


class Captured:
    """What one phase (a property, the import, the header probes) printed, warned and logged."""

    def __init__(self):
        self.stdout, self.stderr = _Sink("<stdout>"), _Sink("<stderr>")
        self.warnings, self.logging = _Items(), _Items()

    def _warning(self, message, category, filename, lineno, file=None, line=None):
        self.warnings.add(f"{category.__name__}: {message} ({filename}:{lineno})")

    def summary(self, verbose: bool = False) -> dict | None:
        """``{"stdout": {"count": lines, "chars", "first"}, "warnings": {"count", "first"}, ...}`` for the
        kinds that occurred (``all`` too with ``verbose``); None when the phase was silent."""
        found = {kind: getattr(self, kind).summary(verbose) for kind in ("stdout", "stderr", "warnings", "logging")}
        return {kind: value for kind, value in found.items() if value} or None


@contextlib.contextmanager
def capture():
    """Capture Python-level output until the block ends; yields the :class:`Captured`."""
    captured = Captured()
    handler, root = _LogHandler(captured.logging), logging.getLogger()
    streams = sys.stdout, sys.stderr
    with warnings.catch_warnings():  # restores the filters and showwarning afterwards
        warnings.simplefilter("always")
        warnings.showwarning = captured._warning
        sys.stdout, sys.stderr = captured.stdout, captured.stderr
        root.addHandler(handler)
        try:
            yield captured
        finally:
            root.removeHandler(handler)
            sys.stdout, sys.stderr = streams
