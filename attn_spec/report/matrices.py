"""Matrices as the reports print them: the only place a matrix is formatted.

A counterexample's tensors arrive as :class:`Matrix` (the failing element's
matrix, kept whole up to CORNER x CORNER, so a small case prints uncut); got and expected are printed side by
side when they fit in WIDTH columns, else one above the other.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from tabulate import tabulate

CORNER = 16  # rows and columns of one matrix a counterexample keeps (and prints whole): a case this small prints uncut
INPUT_LIMIT = 64  # entries of an input kept as values (larger ones: shape and range)
DATA_LIMIT = 256  # entries of got/expected kept as values in the JSON


@dataclass(frozen=True)
class Matrix:
    """One tensor of a counterexample: ``shape``; ``data``, all its values as nested floats when it has at most
    the limit's entries (else None); ``element``, the index of its leading dims shown; ``corner``, that element's
    matrix (its top-left CORNER x CORNER; 1-D tensors as one row); ``stats`` (min, max, mean) of a large input.
    ``text``: the matrix as rendered, only for one read back from a JSON report whose values were too large."""
    shape: tuple
    data: list | None = None
    element: tuple = ()
    corner: list | None = None
    stats: tuple | None = None
    text: str | None = None

    @classmethod
    def of(cls, t: torch.Tensor, element=(), *, limit: int = DATA_LIMIT, stats: bool = False) -> Matrix:
        x = t.detach().to("cpu", torch.float64)
        element = tuple(element)[:max(x.dim() - 2, 0)]
        element += (0,) * (max(x.dim() - 2, 0) - len(element))
        m = x[element] if element else x
        m = m.reshape(1, -1) if m.dim() < 2 else m
        summary = (x.min().item(), x.max().item(), x.mean().item()) if stats and x.numel() else None
        return cls(tuple(x.shape), x.tolist() if x.numel() <= limit else None, element,
                   m[:CORNER, :CORNER].tolist(), summary)

    @property
    def rows(self) -> int:
        return self.shape[-2] if len(self.shape) >= 2 else 1

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def cut(self) -> bool:
        """The matrix is larger than what is kept of it (a long case: the report says so, with its size)."""
        return self.rows > CORNER or self.cols > CORNER


RED, RESET = "\033[1;31m", "\033[0m"
_ANSI = re.compile(r"\033\[[0-9;]*m")
WIDTH = 120  # columns of text two matrices side by side may take


def format_matrix(m, highlight=None) -> str:
    """One matrix, headed by its element of the leading dims (``[1, 0]``) and its size (``[3x4]``), as an aligned
    plain table. ``m``: a Matrix, or a tensor (its first element). A matrix larger than CORNER x CORNER (a long
    case) shows its top-left corner, with … and ⋮ where it goes on. ``highlight``: a bool matrix (nested lists
    or a 2-D tensor) of the cells to print in bold red."""
    if isinstance(m, torch.Tensor):
        m = Matrix.of(m)
    if m.corner is None:  # read back from a JSON report without its values: as it was rendered
        return m.text or ""
    marked = highlight.tolist() if isinstance(highlight, torch.Tensor) else highlight
    rows = []
    for i, row in enumerate(m.corner):
        cells = [f"{RED}{x:.4g}{RESET}" if marked and marked[i][j] else f"{x:.4g}" for j, x in enumerate(row)]
        rows.append(cells + (["…"] if m.cols > CORNER else []))
    if m.rows > CORNER:
        rows.append(["⋮"] * len(rows[0]))
    table = tabulate(rows, tablefmt="plain", disable_numparse=True, stralign="right")
    prefix = f"[{', '.join(map(str, m.element))}] " if m.element else ""
    return f"{prefix}[{m.rows}x{m.cols}]\n" + table


def width_of(line: str) -> int:
    return len(_ANSI.sub("", line))


def columns(blocks: list[str], titles: list[str], gap: int = 4) -> str:
    """Text blocks side by side under their titles."""
    split = [b.splitlines() for b in blocks]
    widths = [max([width_of(x) for x in lines] + [len(title)]) + gap for lines, title in zip(split, titles)]
    out = ["".join(title.ljust(w) for title, w in zip(titles, widths)).rstrip()]
    for i in range(max(map(len, split))):
        row = ""
        for lines, w in zip(split, widths):
            x = lines[i] if i < len(lines) else ""
            row += x + " " * (w - width_of(x))
        out.append(row.rstrip())
    return "\n".join(out)


def side_by_side(blocks: list[str], titles: list[str]) -> str:
    """Blocks side by side under their titles, as many to a row as fit in WIDTH columns (at least one)."""
    rows, row = [], []
    for block, title in zip(blocks, titles):
        if row and max(map(width_of, columns(*zip(*(row + [(block, title)]))).splitlines())) > WIDTH:
            rows.append(row)
            row = []
        row.append((block, title))
    rows.append(row)
    return "\n".join(columns(list(b), list(t)) for b, t in (zip(*row) for row in rows if row))


def inputs_text(ce) -> str:
    """The inputs of a counterexample: small ones as matrices side by side (the failing element of each), large
    ones as shape and range."""
    small = {name: m for name, m in ce.inputs.items() if m is not None and m.data is not None}
    lines = [side_by_side([format_matrix(m) for m in small.values()], list(small))] if small else []
    for name, m in ce.inputs.items():
        if m is not None and name not in small and m.stats is not None:
            lo, hi, mean = m.stats
            lines.append(f"{name} {list(m.shape)}: min {lo:.3g}, max {hi:.3g}, mean {mean:.3g}")
    return "\n".join(lines)


def counterexample_matrices(ce, colour: bool) -> str:
    """got beside expected (the failing element); with ``colour``, the cells that differ in bold red."""
    got, expected = ce.got, ce.expected
    differ = None
    if colour and got is not None and expected is not None and got.corner is not None and expected.corner is not None:
        a, b = torch.tensor(got.corner, dtype=torch.float64), torch.tensor(expected.corner, dtype=torch.float64)
        if a.shape == b.shape:
            differ = ~torch.isclose(a, b, rtol=1e-3, atol=1e-6, equal_nan=True)
    if expected is None:
        return format_matrix(got, differ)
    return side_by_side([format_matrix(got, differ), format_matrix(expected, differ)], ["got", "expected"])


def picture_matrix(rows: list) -> str:
    """A FlexAttention bias (a mod's picture) as numbers."""
    return format_matrix(torch.tensor(rows, dtype=torch.float64))
