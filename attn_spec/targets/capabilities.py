"""Capabilities: what a target can be asked to do. Probed first, on tiny inputs, and reported in the header.

A target that lacks one (it takes no such argument, or its own code raises ``NotImplementedError``
or ``attn_spec.Unsupported``) is not wrong: the kit then draws only inputs the target takes (see
:class:`Supports`), and the properties that need the rest are skips with the reason. A user who
needs it says so with ``attn-spec check --require mask autograd``, and a missing capability becomes
a failing result ``capability:<name>``.

==============  ==================================================================
capability      probe (float32, Q [2, 2] against K, V [2, 2] unless stated)
==============  ==================================================================
``mask``        a bool mask argument: a mask that is not causal, and a causal one;
                ``causal-only`` when the target declines every mask but the causal one;
                ``key-padding`` when it declines both but takes a key-padding mask [1, Tk] (every
                query row the same): the properties then draw key-padding masks for it
``unmasked``    a call without a mask (a causal-only module declines it; an hf function
                that raises on attention_mask=None but runs with a mask lacks it)
``batch``       leading batch dims: Q, K, V [2, 2, 2]
``cross``       n_q != n_kv: K, V [3, 2] (self-attention-only modules lack it)
``dv-ne-dk``    values wider than keys: V [2, 3]
``scale``       an explicit ``scale`` argument (the sdpa convention)
``is-causal``   an ``is_causal`` argument (the sdpa convention)
``dropout``     a ``dropout_p`` argument that drops weights: p = 0.5 on Q, K, V [8, 2] changes the output
                (``no`` when the argument is missing, or accepted and ignored)
``autograd``    gradients flow from the output to Q, K and V
``gqa``         grouped-query heads: Q [4, 2, 2] over K, V [2, 2, 2] (function conventions);
                raising = lacking it, except where GQA is part of the contract (flex,
                hf under --require gqa or a GQA config: Target.raising_declines)
``head-dims``   the head dims of envelope.HEAD_DIMS (1..256) it takes, d_v = d_k: ``yes``, or those taken
                ("16-128", "16/32/64/128") when it refuses some on purpose (attn_spec.targets.envelope);
                every other probe runs at the base the envelope found (float32 at d = 2 where it runs)
``length``      the largest sequence length it takes: ``yes`` at lengths.LENGTH_CEILING positions (self-attention
                [n, 2]); else the largest n, by bisection. A limit the target declares (its own
                refusal, a position buffer or attribute of n: nanoGPT's ``bias`` of ``block_size``;
                or ``--require length=N`` with N <= n) is ``max length N``: the properties draw up
                to N and the verdict says so. An undeclared crash is ``raises``: long-sequences
                fails past it (attn_spec.targets.lengths)
``float64``,    the baseline in that dtype; ``unchecked`` when ``--dtypes`` leaves it out
``float32``,
``float16``,
``bfloat16``
==============  ==================================================================

A target's own refusal (an ``assert``, ``ValueError``, ``TypeError`` or ``NotImplementedError`` raised
from its own code: envelope.declared_refusal) declines, as ``Unsupported`` does. Every probe but ``mask``
and ``unmasked`` runs with the mask the properties would give this target: none, or the causal one for a target that declines calls without a mask. Each probe
yields ``yes``; ``no`` (the target declined or lacks it; for ``autograd``, an output detached
from the graph); ``raises`` (it raised some other exception, in its forward or its backward: the
properties that use such inputs fail and say why); ``n/a``/``unchecked``; or ``error`` (a bug of
the kit's own in that probe).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attn_spec.dtypes import DTYPES
from attn_spec.errors import KitUsageError
from attn_spec.reference import causal_mask
from attn_spec.targets.base import conventions
from attn_spec.targets.envelope import HEAD_DIMS, find_base, outcome as _outcome, phrase, probe_head_dims, \
    tensor as _t
from attn_spec.targets.lengths import probe_length

VALUED = ("length", "head-dims", "dtypes")  # --require KEY=VALUE items that are capabilities, not behaviours
CAPABILITIES = ("mask", "unmasked", "batch", "cross", "dv-ne-dk", "scale", "is-causal", "dropout", "autograd", "gqa",
                "head-dims", "length", "float64", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class Supports:
    """The inputs a target takes, from its capabilities: what the kit draws for it.

    Only what the target *declined* is left out; inputs it crashes on are still drawn, so
    that the properties using them fail and say why (past an undeclared crash at a length,
    ``crash_length``, only long-sequences draws). What is left out narrows the check: it is the
    target's envelope, printed in the verdict (:func:`envelope`).
    """

    masks: tuple[str, ...] = ("none", "random", "causal")  # the mask kinds of a Case (strategies.MASK_KINDS)
    cross: bool = True  # n_q != n_kv
    batch: bool = True  # leading batch/head dims
    dv_ne_dk: bool = True  # d_v != d_k
    dropout: bool = False  # a dropout_p argument that drops weights (the dropout properties; else they are skips)
    dtypes: tuple[str, ...] = tuple(DTYPES)
    max_length: int | None = None  # the longest sequence it declares (None: no limit up to lengths.LENGTH_CEILING)
    crash_length: int | None = None  # an undeclared crash past this length: long-sequences draws past it, no other
    length_crash: str = ""  # where that crash starts, in words ("raises IndexError from 17 positions on; ...")
    head_dims: tuple[int, ...] | None = None  # the head dims it takes, of envelope.HEAD_DIMS (None: every one)
    base_dtype: str = "float32"  # the dtype the header's probes ran in: float32, else the first it takes
    gqa: bool = False  # a serving kernel: it takes grouped K/V heads (its properties draw them; Target.draws)
    page_granule: int = 1  # a decode kernel: the smallest page size it takes (pages drawn are multiples); 0: not paged
    why: dict = field(default_factory=dict)  # capability -> the target's reason, for each one left out


def _masks(target, dtype, device, d: int = 2) -> dict:
    """The ``unmasked`` and ``mask`` probes, on square inputs [2, d] so that only the mask differs."""
    q, k, v = (_t(2, d, dtype=dtype, device=device, seed=s) for s in range(3))
    causal = causal_mask(2, 2, device=device)  # [Tq, Tk], True = may attend
    other = torch.tensor([[False, True], [True, True]], device=device)  # row 0 attends key 1 only: not causal
    padding = torch.tensor([[False, True]], device=device)  # [1, Tk]: every query ignores key 0 (key padding)
    found = {"unmasked": _outcome(lambda: target.attend(q, k, v))}
    with_causal, with_other = _outcome(lambda: target.attend(q, k, v, causal)), _outcome(lambda: target.attend(q, k, v, other))
    if found["unmasked"][0] == "raises" and "unmasked" in target.raising_declines and "yes" in (with_causal[0], with_other[0]):
        found["unmasked"] = ("no", f"raises without a mask, runs with one: {found['unmasked'][1]}")
    if with_causal[0] == "yes" and with_other[0] == "no":
        found["mask"] = ("causal-only", f"only causal masks: {with_other[1]}")
    elif with_other[0] == "no" and with_causal[0] == "no" and _outcome(lambda: target.attend(q, k, v, padding))[0] == "yes":
        found["mask"] = ("key-padding", f"only key-padding masks ([..., 1, n_kv], every query row the same): "
                                        f"{with_other[1]}")
    else:
        found["mask"] = next((o for o in (with_other, with_causal) if o[0] in ("raises", "error")),
                             next((o for o in (with_other, with_causal) if o[0] == "no"), ("yes", "")))
    return found


def _probes(target, dtype, device, masked: bool, d: int = 2, other: int = 3):
    """name -> a call that exercises that capability alone (every other input is the baseline, of head dim ``d``;
    ``other``: the value width of the dv-ne-dk probe)."""
    def t(*shape, seed=0, dt=dtype):
        return _t(*shape, dtype=dt, device=device, seed=seed)

    def attend(q, k, v, **kwargs):  # the baseline mask: the causal one for targets that need a mask
        mask = causal_mask(q.shape[-2], k.shape[-2], device=device) if masked else None
        return target.attend(q, k, v, mask, **kwargs)

    q, k, v = t(2, d), t(2, d, seed=1), t(2, d, seed=2)  # the baseline: [T=2, D=d] each
    probes = {
        "batch": lambda: attend(t(2, 2, d), t(2, 2, d, seed=1), t(2, 2, d, seed=2)),
        "cross": lambda: attend(q, t(3, d, seed=1), t(3, d, seed=2)),
        "dv-ne-dk": lambda: attend(q, k, t(2, other, seed=2)),
        "scale": lambda: target.attend(q, k, v, scale=0.5),
        "is-causal": lambda: target.attend(q, k, v, is_causal=True),
        "autograd": lambda: target.vjp(q, k, v, causal_mask(2, 2, device=device) if masked else None,
                                       torch.ones_like(q)),
        "gqa": lambda: attend(t(4, 2, d), t(2, 2, d, seed=1), t(2, 2, d, seed=2)),
    }
    for name in DTYPES:
        dt = DTYPES[name]
        probes[name] = lambda dt=dt: attend(t(2, d, dt=dt), t(2, d, seed=1, dt=dt), t(2, d, seed=2, dt=dt))
    return probes


def _dropout(target, dtype, device, masked: bool, d: int = 2) -> tuple[str, str]:
    """("yes", "") when dropout_p = 0.5 changes the output of 64 weights (all kept: probability 2^-64); else
    ("no", why): the target takes no dropout argument, or takes it and drops nothing."""
    q, k, v = (_t(8, d, dtype=dtype, device=device, seed=s) for s in range(3))  # [T=8, D=d] each
    mask = causal_mask(8, 8, device=device) if masked else None
    value, why = _outcome(lambda: target.attend(q, k, v, mask, dropout=0.5))
    if value != "yes":
        return value, why
    with torch.random.fork_rng(devices=[]):  # the probe leaves the caller's random stream as it was
        torch.manual_seed(0)
        dropped = target.attend(q, k, v, mask, dropout=0.5)
    if torch.equal(dropped, target.attend(q, k, v, mask)):
        return "no", f"{target.name} accepts dropout_p but p = 0.5 changes nothing (an inference kernel's signature?)"
    return "yes", ""


def parse_length(items) -> int | None:
    """The N of a ``length=N`` among ``--require`` items (the shortest sequence the target must take), or None.
    ``head-dims=LO-HI`` and ``dtypes=A,B``: parse_head_dims, parse_dtypes (VALUED: the capabilities with a value)."""
    found = [item.partition("=")[2] for item in items or () if item.startswith("length=")]
    if not found:
        return None
    if not found[-1].isdigit() or int(found[-1]) < 1:
        raise KitUsageError(f"length={found[-1]!r}: expected a positive number of positions, e.g. --require length=2048")
    return int(found[-1])


def parse_head_dims(items) -> tuple[int, int] | None:
    """The (lo, hi) of a ``head-dims=LO-HI`` (or ``head-dims=N``) among ``--require`` items: every probed head dim
    between them must be taken; or None."""
    found = [item.partition("=")[2] for item in items or () if item.startswith("head-dims=")]
    if not found:
        return None
    lo, _, hi = found[-1].partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit()) or int(lo) < 1 or int(hi or lo) < int(lo):
        raise KitUsageError(f"head-dims={found[-1]!r}: expected head dims LO-HI, e.g. --require head-dims=1-256")
    return int(lo), int(hi or lo)


def parse_dtypes(items) -> tuple[str, ...]:
    """The dtype names of a ``dtypes=A,B`` among ``--require`` items (each must be taken), or ()."""
    found = [item.partition("=")[2] for item in items or () if item.startswith("dtypes=")]
    names = tuple(name for name in (found[-1].split(",") if found else ()) if name)
    bad = [name for name in names if name not in DTYPES]
    if bad or (found and not names):
        raise KitUsageError(f"dtypes={found[-1]!r}: expected dtype names among {', '.join(DTYPES)}, "
                            f"e.g. --require dtypes=float32")
    return names


def envelope_gaps(values: dict, supports: Supports, items) -> dict[str, str]:
    """``{"head-dims": what is missing, "dtypes": ...}``: the envelope's gaps that ``--require head-dims=LO-HI``
    and ``dtypes=A,B`` (items) turn into failures; each required and met maps to ""."""
    gaps, span = {}, parse_head_dims(items)
    if span is not None:
        missing = [d for d in HEAD_DIMS if span[0] <= d <= span[1] and supports.head_dims is not None
                   and d not in supports.head_dims]
        gaps["head-dims"] = f"head dims {', '.join(map(str, missing))} refused" if missing else ""
    names = parse_dtypes(items)
    if names:
        missing = [name for name in names if values.get(name) != "yes"]
        gaps["dtypes"] = ", ".join(f"{name} {values.get(name, 'not probed')}" for name in missing)
    return gaps


def probe_capabilities(target, dtypes=tuple(DTYPES), device: str = "cpu") -> tuple[dict, dict]:
    """(values, reasons): ``{"mask": "yes", "scale": "no", ...}`` and, for each capability that is not
    ``yes``, why (the target's own words where it gave them). Also keeps what the target takes on
    it (``target.supported``, see :func:`supports`)."""
    base_name, d, ran = find_base(target, dtypes, device)  # float32 at d = 2, else where its envelope allows
    base = DTYPES[base_name]
    found = _masks(target, base, device, d)
    masked = found["unmasked"][0] != "yes" and found["mask"][0] in ("yes", "causal-only")
    value, why, head_dims = probe_head_dims(target, base, device, masked) if ran else ("yes", "", None)
    found["head-dims"] = (value, why)
    other = next((w for w in head_dims or () if w != d), d + 1)
    for name, call in _probes(target, base, device, masked, d, other).items():
        if name in getattr(target, "left_out", {}):  # its platform cannot run it (Target.left_out): not checked
            found[name] = ("no", target.left_out[name])
        elif name in DTYPES and name not in dtypes:
            found[name] = ("unchecked", "not among the dtypes checked (--dtypes)")
        elif name == "gqa" and target.convention not in conventions(kind="attention", multihead=False):
            found[name] = ("n/a", f"the {target.convention} convention has no head dims to group")
        elif name == "batch" and target.convention in conventions(kind="attention", multihead=True):
            found[name] = ("n/a", f"the {target.convention} convention is checked one sequence at a time: "
                                  "batch-independence does not apply to it")
        else:  # GQA is opt-in: raising = lacking it, unless grouped K/V heads are part of the convention
            found[name] = _outcome(call, "no" if name in target.raising_declines else "raises")
    found["dropout"] = _dropout(target, base, device, masked, d)
    length = probe_length(target, base, device, masked, parse_length(target.required), d)
    found["length"] = (length.value, length.why)
    values = {name: found[name][0] for name in CAPABILITIES}
    reasons = {name: found[name][1] for name in CAPABILITIES if values[name] != "yes"}
    target.supported = _supports(values, reasons, length, head_dims, base_name)
    return values, reasons


def _supports(values: dict, reasons: dict, length=None, head_dims=None, base: str = "float32") -> Supports:
    """What to draw for a target with these capabilities: everything but what it declined."""
    declined = {name for name, value in values.items() if value == "no"}
    key_padding = values["mask"] == "key-padding"
    masks = tuple(kind for kind, takes in (("none", "unmasked" not in declined),
                                           ("random", values["mask"] not in ("no", "causal-only", "key-padding")),
                                           ("causal", "mask" not in declined and not key_padding),
                                           ("padding", key_padding)) if takes)
    why = {name: reasons[name] for name in ("unmasked", "mask", "batch", "cross", "dv-ne-dk", "length", "dropout",
                                            "head-dims")
           if name in reasons
           and (name in declined or values[name] in ("causal-only", "key-padding"))}
    why.update({name: reasons[name] for name in DTYPES if name in declined and name in reasons})
    if values["length"].isdigit():
        why["length"] = reasons.get("length", "")
    crashed = length is not None and length.value == "raises"
    return Supports(masks=masks, cross="cross" not in declined, batch="batch" not in declined,
                    dv_ne_dk="dv-ne-dk" not in declined, dropout=values["dropout"] == "yes",
                    max_length=int(values["length"]) if values["length"].isdigit() else None,
                    crash_length=length.takes if crashed else None, length_crash=length.crash if crashed else "",
                    dtypes=tuple(name for name in DTYPES if name not in declined), why=why, head_dims=head_dims,
                    base_dtype=base)


def envelope(supports: Supports) -> list[dict]:
    """What the target declares it does not take, and the check was narrowed to leave out: one
    ``{"capability", "phrase", "why"}`` per limit, the phrases joined into the verdict ("CONFORMS up to
    1024 positions, causal masks only"). Optional arguments a convention merely may take (scale,
    dropout, is_causal) narrow nothing: a target without them is checked on everything else."""
    masks, why = set(supports.masks), supports.why
    found = [("head-dims", phrase(supports.head_dims))] if supports.head_dims else []
    if supports.max_length is not None:
        found.append(("length", f"up to {supports.max_length} positions"))
    mask_phrase = ("no masks" if not masks & {"random", "causal", "padding"} else
                   "key-padding masks only" if "padding" in masks else
                   "causal masks only" if "random" not in masks else
                   "masked calls only" if "none" not in masks else "")
    if mask_phrase:
        found.append(("unmasked" if mask_phrase == "masked calls only" else "mask", mask_phrase))
    found += [(name, phrase) for name, ok, phrase in (("cross", supports.cross, "self-attention only"),
                                                      ("batch", supports.batch, "no batch dims"),
                                                      ("dv-ne-dk", supports.dv_ne_dk, "d_v = d_k only")) if not ok]
    if set(DTYPES) - set(supports.dtypes) and supports.dtypes:
        names = list(supports.dtypes)
        found.append(("dtypes", f"{', '.join(names[:-1])} and {names[-1]} only" if len(names) > 1
                      else f"{names[0]} only"))
    reasons = {**why, "mask": why.get("mask") or why.get("unmasked", ""),
               "dtypes": "; ".join(f"{name}: {why[name]}" for name in DTYPES if name in why)}
    return [{"capability": name, "phrase": phrase, "why": reasons.get(name, "")} for name, phrase in found]


def supports(target, dtypes=tuple(DTYPES), device: str = "cpu") -> Supports:
    """What ``target`` takes: probed once (on its first use, unless a check probed it already), then kept.
    A FlexAttention mod or a serving kernel is no attention to probe: its own properties draw what they need."""
    if not getattr(target, "is_attention", True):  # a serving kernel says what it takes (grouped heads, page sizes)
        return Supports(**getattr(target, "draws", dict)())
    if getattr(target, "supported", None) is None:
        probe_capabilities(target, dtypes, device)
    return target.supported


def required(items) -> frozenset:
    """What ``Target.required`` holds for ``--require`` items: the capability names and ``length=N`` (a limit
    the user needs no more than: attn_spec.targets.lengths)."""
    need = parse_length(items)
    parse_head_dims(items), parse_dtypes(items)  # a usage error before any probe
    return frozenset(parse_capabilities(items)) | ({f"length={need}"} if need is not None else set())


def parse_capabilities(items) -> list[str]:
    """The capability names among ``--require`` items (those without ``=``); unknown names are a usage error."""
    parse_length(items)
    names = [item for item in items or () if "=" not in item]
    unknown = [name for name in names if name not in CAPABILITIES]
    if unknown:
        raise KitUsageError(f"{unknown[0]!r} is not a capability; capabilities: {', '.join(CAPABILITIES)} "
                            f"(or a convention as key=value, see attn_spec.targets.behaviours)")
    return names
