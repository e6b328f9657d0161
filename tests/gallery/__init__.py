"""A gallery of attentions for testing the kit itself.

- ``CORRECT``: implementations in other styles (einsum, online softmax, float64 inside,
  SDPA, ...). Every property must pass on each of them, in every dtype and profile.
- ``BUGGY``: the classic mistakes. Each entry names the properties that exist to catch it;
  every one of those must fail. The kill count (buggy entries caught / total) and the false
  alarms (failures on correct variants) are printed at the end of the test run.
  Each also declares its ``mistake``: the id of the mistake model (``attn-spec list --mistakes``)
  that the kit's diagnosis must name as the one root of its failures.
- ``TRIVIAL``: outputs that ignore their inputs (zeros, V, the mean of V, ...). No property may
  pass on them: each fails at one root (``matches-reference``, or ``determinism`` for random
  numbers), every other property as vacuous, explained by it. Those with a
  mistake model are also in ``BUGGY``; all count in the kill count.
- ``LIBRARY``: real-library-style targets as users wrap them (torch's SDPA backends,
  ``nn.MultiheadAttention``, a Hugging Face module, nanoGPT's causal module, GQA in either
  grouping, code that reads masks as bool): they must conform in one multi-target check.

Each module of this package registers its entries with ``@correct``, ``@buggy`` and ``@library``.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Entry:
    name: str
    obj: object  # the attention function or module class
    convention: str  # "function" or "module"
    catches: tuple[str, ...] = ()  # property ids that must fail; empty for a correct variant
    bug: str = ""  # what is wrong, in one line
    mistake: str = ""  # the mistake model the diagnosis must name (attn_spec.diagnosis)
    masks: tuple[str, ...] | None = None  # the mask forms it is checked with (None: its convention's)
    options: dict = field(default_factory=dict)  # make_target keywords: layout, expect_mask, expect_score
    diagnosis: str = ""  # a mod's entry (no calls to replay, no mistake model): words its causes must contain

    def __str__(self) -> str:  # readable pytest ids
        return self.name


CORRECT: list[Entry] = []
BUGGY: list[Entry] = []
TRIVIAL: list[Entry] = []
LIBRARY: list[Entry] = []


def correct(convention: str = "function", name: str | None = None, **options):
    def register(obj):
        CORRECT.append(Entry(name or obj.__name__, obj, convention, options=options))
        return obj
    return register


def buggy(*catches: str, bug: str, mistake: str = "", convention: str = "function", masks=None, diagnosis: str = "",
          **options):
    def register(obj):
        BUGGY.append(Entry(obj.__name__, obj, convention, tuple(catches), bug, mistake, masks, options, diagnosis))
        return obj
    return register


def trivial(*, bug: str, mistake: str = ""):
    def register(obj):
        entry = Entry(obj.__name__, obj, "function", ("matches-reference",), bug, mistake)
        TRIVIAL.append(entry)
        if mistake:  # a bug the diagnosis can name
            BUGGY.append(entry)
        return obj
    return register


def library(convention: str = "function", name: str | None = None):
    def register(obj):
        LIBRARY.append(Entry(name or obj.__name__, obj, convention))
        return obj
    return register


from gallery import contracts, core, dropout, ecosystem, libraries, masking, robustness, serving, trivial_targets  # noqa: E402,F401  - registers the entries
