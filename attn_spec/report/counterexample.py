"""A counterexample as data: what the runner found, kept typed until a renderer writes it.

The runner builds one :class:`Counterexample` per failure (:meth:`Counterexample.of`) from the tensors
the property showed; nothing in it is text to print but the reproduce snippet and the traceback. Every
tensor is a :class:`Matrix`: its values when small (the JSON's ``got``, ``expected``, ``inputs``) and
the matrix of the *failing element* of its leading dims, the same element for the inputs as for the
output. The renderers (``report.matrices``, ``text``, ``html``) write it; :meth:`to_dict` is the JSON
report's form, which also carries the rendered matrices (``got_text``, ``expected_text``,
``inputs_text``: public fields), and :meth:`from_dict` reads that form back (a grade sent between
processes).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from attn_spec.report.matrices import DATA_LIMIT, INPUT_LIMIT, Matrix, format_matrix, inputs_text

def element_of(t: torch.Tensor, element: tuple, lead: tuple) -> tuple:
    """``element`` (an index of the output's leading dims ``lead``) as an index of ``t``'s, aligned from the
    right: a dim of size 1 broadcasts (0); a dim with fewer entries that divide the output's is grouped (GQA's
    K and V: head h reads kv head h // (H / H_kv)); a dim ``t`` lacks is dropped."""
    own = tuple(t.shape[:max(t.dim() - 2, 0)])
    pairs = list(zip(element[::-1], lead[::-1]))[:len(own)][::-1]
    pairs = [(0, 1)] * (len(own) - len(pairs)) + pairs
    index = []
    for (i, n_out), n in zip(pairs, own):
        index.append(0 if n == 1 else i if n == n_out else i // (n_out // n) if n_out % n == 0 else min(i, n - 1))
    return tuple(index)


def failing_element(got, expected) -> tuple:
    """The index of the leading dims where ``got`` and ``expected`` differ most (NaN against a number counts as
    the largest difference): the element of the batch the counterexample shows, for inputs and output alike."""
    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)) or got.shape != expected.shape \
            or got.dim() <= 2:
        return ()
    a, b = got.detach().to("cpu", torch.float64), expected.detach().to("cpu", torch.float64)
    diff = (a - b).abs()
    diff = torch.where(torch.isfinite(a) == torch.isfinite(b), diff.nan_to_num(0.0), torch.full_like(diff, torch.inf))
    per_element = diff.flatten(-2).amax(dim=-1)  # [...]
    return tuple(int(i) for i in torch.unravel_index(per_element.argmax(), per_element.shape))


def nonfinite_both(got, expected) -> int:
    """How many entries are NaN or inf on both sides (a comparison that says nothing there)."""
    if not (isinstance(got, torch.Tensor) and isinstance(expected, torch.Tensor)) or got.shape != expected.shape:
        return 0
    return int((~torch.isfinite(got.detach().cpu().double()) & ~torch.isfinite(expected.detach().cpu().double()))
               .sum())


@dataclass(frozen=True)
class Counterexample(Mapping):
    """The failing case of one property, typed. ``labels``: what ``got`` and ``expected`` really are (the
    target's output, the float64 reference, the target's own output on another input...); ``element``: the
    failing element of the leading dims (the JSON's ``slice``); ``inputs``: the tensors of the call shown, each
    at that element; ``mask``: the allowed pattern (True = may attend) the heatmaps hatch, expanded to got's
    shape, or None; ``has_mask``: whether one applies at all. Read as a mapping it is :meth:`to_dict` (old
    code reading ``ce["reproduce"]`` keeps working)."""
    case: dict
    summary: str | dict  # what the case was, in words, or its sizes by name (a mod's B, H, S_q, S_kv)
    got: Matrix | None
    expected: Matrix | None
    labels: tuple
    element: tuple
    inputs: dict
    seed: int
    reproduce: str
    nonfinite_both: int = 0
    mask: list | None = None
    has_mask: bool = False
    traceback: str | None = None
    rendered: dict = field(default_factory=dict, compare=False, repr=False)  # to_dict's cache

    @classmethod
    def of(cls, *, case: dict, summary: str, got, expected, labels, inputs: dict, seed: int, reproduce: str,
           mask=None, traceback: str | None = None) -> Counterexample:
        """From the tensors a failure showed: the failing element chosen once, for the output and the inputs."""
        element = failing_element(got, expected)
        lead = tuple(got.shape[:len(element)]) if isinstance(got, torch.Tensor) else ()
        shown = {name: Matrix.of(t.double() if t.dtype == torch.bool else t, element_of(t, element, lead),
                                 limit=INPUT_LIMIT, stats=True) if isinstance(t, torch.Tensor) else None
                 for name, t in inputs.items()}  # a None input (no mask) stays listed, as None
        kept = None
        has_mask = mask is not None and isinstance(got, torch.Tensor) and mask.dtype == torch.bool \
            and mask.shape[-2:] == got.shape[-2:]
        if has_mask:
            try:
                full = mask.expand(got.shape)
                kept = full.detach().cpu().double().tolist() if full.numel() <= DATA_LIMIT else None
            except RuntimeError:  # batch dims that do not broadcast: no mask shown
                has_mask = False
        return cls(case, summary, None if got is None else Matrix.of(got, element),
                   None if expected is None else Matrix.of(expected, element), tuple(labels), element, shown,
                   seed, reproduce, nonfinite_both(got, expected), kept, has_mask, traceback)

    @property
    def described(self) -> str:
        """The case in words: ``summary``, or its sizes written ``B=1, H=2, ...``."""
        if isinstance(self.summary, dict):
            return ", ".join(f"{name}={value}" for name, value in self.summary.items())
        return self.summary

    def to_dict(self) -> dict:
        """The JSON report's form (its fields are public: the rendered matrices included)."""
        if not self.rendered:
            data = {"case": self.case, "summary": self.described,
                    "got": self.got and self.got.data, "expected": self.expected and self.expected.data,
                    "got_text": self.got and format_matrix(self.got),
                    "expected_text": self.expected and format_matrix(self.expected),
                    "labels": list(self.labels), "slice": list(self.element), "nonfinite_both": self.nonfinite_both,
                    "seed": self.seed, "reproduce": self.reproduce,
                    "inputs": {name: m and m.data for name, m in self.inputs.items()}, "inputs_text": inputs_text(self)}
            if self.traceback is not None:
                data["traceback"] = self.traceback
            if self.has_mask:
                data["mask"] = self.mask
            self.rendered.update(data)
        return dict(self.rendered)

    @classmethod
    def from_dict(cls, data: Mapping) -> Counterexample:
        """A counterexample read back from :meth:`to_dict`'s form (a matrix too large for its values keeps its text)."""
        if isinstance(data, Counterexample):
            return data
        element = tuple(data.get("slice") or ())

        def matrix(values, text):
            if values is None and text is None:
                return None
            if values is None:
                return Matrix((), None, element, None, None, text)
            return Matrix.of(torch.tensor(values, dtype=torch.float64), element)

        inputs = {name: None if values is None else Matrix.of(torch.tensor(values, dtype=torch.float64), (),
                                                              limit=INPUT_LIMIT)
                  for name, values in (data.get("inputs") or {}).items()}
        ce = cls(dict(data.get("case") or {}), data.get("summary", ""), matrix(data.get("got"), data.get("got_text")),
                 matrix(data.get("expected"), data.get("expected_text")), tuple(data.get("labels") or ()), element,
                 inputs, data.get("seed", 0), data.get("reproduce", ""), data.get("nonfinite_both", 0),
                 data.get("mask"), "mask" in data, data.get("traceback"))
        ce.rendered.update(data)  # read back: rendered as it was written
        return ce

    def __getitem__(self, key):
        return self.to_dict()[key]

    def __iter__(self):
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())
