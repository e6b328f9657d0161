"""The calling conventions' vocabulary, without torch: their names and the traits each one declares.

Each Target class declares its :class:`Traits` (``traits = Traits("name", ...)``) and registers itself
by being defined (``attn_spec.targets.base.Target.__init_subclass__``); every list of conventions the kit
uses is derived here from what is registered (:func:`names`). ``attn_spec.settings`` reads the names from
here without importing torch: before the targets are imported, :data:`BUILTIN` stands for the kit's own
(``tests/test_settings.py`` checks that the registry derives exactly these). A convention registered
later (a class of the user's, a test's) is listed and accepted like the kit's own.
"""
from __future__ import annotations

from dataclasses import dataclass

KINDS = ("attention", "mod", "serving")
OPTIONS = ("scale", "is-causal", "window", "softcap", "dropout", "alibi")  # attend()'s options a convention may take
# The kit's own conventions, in the order they are listed (the order of --help and of `list --conventions`).
BUILTIN = ("function", "sdpa", "module", "torch-mha", "adapter", "hf", "flex", "mask-mod", "score-mod", "decode", "merge",
           "varlen")


@dataclass(frozen=True)
class Traits:
    """What a calling convention is, declared once by its Target class."""

    name: str  # the convention's name: --convention NAME, the report's "(NAME convention)"
    signature: str  # how a target of it is called, in one line (list --conventions, the detection error)
    kind: str = "attention"  # attention: called on Q, K, V; mod: a FlexAttention mod; serving: a serving kernel
    trained: bool = True  # its backward is part of the contract (False: a missing autograd is a skip)
    multihead: bool = False  # a module with projections W_Q, W_K, W_V, W_O
    masks: tuple[str, ...] = ("bool",)  # the mask forms it takes by default (MASK_FORMS)
    declarable_masks: bool = False  # its user may declare more mask forms (--masks bool,additive)
    dtypes: tuple[str, ...] | None = None  # the dtypes checked unless the user names some (None: all)
    options: tuple[str, ...] = ()  # attend()'s options it takes (OPTIONS)
    layout: str = "bhsd"  # how heads and sequence are laid out ("bhsd or bshd, probed", ...)
    keywords: tuple[str, ...] = ()  # the make_target keywords that apply to it (layout, expect_mask, ...)
    detect_rank: int = 50  # detection order: lower is tried first (the catch-alls sdpa, function come last)

    def __post_init__(self):
        if self.kind not in KINDS:  # sanity check
            raise ValueError(f"convention {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        unknown = set(self.options) - set(OPTIONS)
        if unknown:  # sanity check
            raise ValueError(f"convention {self.name!r}: unknown options {sorted(unknown)}")


REGISTRY: dict[str, Traits] = {}  # name -> traits, in registration order


def register(traits: Traits) -> Traits:
    """Add a convention (Target.__init_subclass__ calls this); a name registered twice is a kit bug."""
    if traits.name in REGISTRY and REGISTRY[traits.name] != traits:
        raise ValueError(f"convention {traits.name!r} is registered twice")  # sanity check
    REGISTRY[traits.name] = traits
    return traits


def names(**where) -> tuple[str, ...]:
    """The conventions' names, the kit's own first (BUILTIN order), then those registered later; with
    ``where`` (trait=value, e.g. kind="attention", multihead=True) only those whose traits match. Before
    the targets are imported (torch-free callers), BUILTIN stands for the kit's own conventions."""
    known = [name for name in BUILTIN] + [name for name in REGISTRY if name not in BUILTIN]
    if not where:
        return tuple(known)
    return tuple(name for name in known if name in REGISTRY
                 and all(getattr(REGISTRY[name], key) == value for key, value in where.items()))


def traits(name: str) -> Traits | None:
    """The traits of convention ``name``, once its Target class is imported; None otherwise."""
    return REGISTRY.get(name)
