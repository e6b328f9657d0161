"""Draw what the target takes: a property's cases fitted to the target's probed capabilities.

A target that declines some inputs is checked on the inputs it takes, not skipped: a causal-only
module (nanoGPT's, which applies its own causal mask) declines calls without a mask and every
other mask, so it gets causal self-attention cases; a self-attention module gets n_q = n_kv. A
property that needs what the target declines is reported as not checked, with the target's
reason (:class:`NotCheckable`). Inputs a target *crashes* on are still drawn: those failures are
findings (see :class:`attn_spec.targets.capabilities.Supports`); past a length it crashes at without
declaring it, only long-sequences draws (its failure is that crash, one root).
"""
from __future__ import annotations

from attn_spec.checking.cases import Case
from attn_spec.targets.envelope import width_for

MASK_NAMES = {"none": "calls without a mask", "random": "masks that are not causal", "causal": "causal masks",
              "padding": "key-padding masks"}


class NotCheckable(Exception):
    """The property needs inputs the target declines; ``str()`` says which, and the target's reason."""


def _why(supports, *names) -> str:
    reasons = [supports.why[name] for name in names if supports.why.get(name)]
    return f" ({reasons[0]})" if reasons else ""


def fit(prop, convention: str, supports, dtypes) -> tuple[dict, list[str], list[str]]:
    """(strategy options, dtypes, notes): the options that draw only inputs the target takes, the dtypes
    among ``dtypes`` it takes, and what is left undrawn as a result; NotCheckable when nothing is left."""
    options, notes = {}, []
    wanted = tuple(prop.case_options.get("masks", ("none", "random", "causal")))
    if "random" in wanted and "padding" in supports.masks and not prop.uses_multihead(convention):
        wanted += ("padding",)  # a key-padding-only target: its masks stand in for the random ones
    masks = tuple(kind for kind in wanted if kind in supports.masks)
    declined = [MASK_NAMES[kind] for kind in wanted if kind not in masks and kind != "padding"]
    if not masks:
        raise NotCheckable(f"it needs {' or '.join(declined)}, which the target declines{_why(supports, 'mask', 'unmasked')}")
    if declined:
        notes.append(f"{', '.join(declined)}{_why(supports, 'unmasked' if 'none' not in masks else 'mask')}")
    options["masks"] = masks
    limit = supports.max_length if supports.max_length is not None else supports.crash_length
    if limit is not None:  # a declared limit, or an undeclared crash that long-sequences alone goes past
        options["max_length"] = limit
    if getattr(supports, "head_dims", None):  # a kernel's envelope: its own head dims (attn_spec.targets.envelope)
        options["head_dims"] = supports.head_dims
    taken = [d for d in dtypes if d in supports.dtypes]
    if not taken:
        raise NotCheckable(f"the target declines every dtype checked ({', '.join(dtypes)})")
    if prop.case_options.get("grouped") is not None and not supports.gqa:
        options["grouped"] = None  # a serving kernel that declines grouped K/V heads (the header's "grouped heads")
    if prop.case_options.get("pages"):  # no page drawn for a kernel that takes no block table
        options["pages"], options["page_granule"] = supports.page_granule > 0, max(1, supports.page_granule)
    if not prop.uses_multihead(convention):  # multi-head cases fit themselves (properties.inputs.cross_or_self)
        needs_cross, needs_batch = prop.case_options.get("cross"), prop.case_options.get("batch")
        for ok, needed, option, what, capability in (
                (supports.cross, needs_cross, "square", "n_q != n_kv", "cross"),
                (supports.batch, needs_batch, "batch", "leading batch/head dims", "batch"),
                (supports.dv_ne_dk, needs_cross, "same_width", "d_v != d_k", "dv-ne-dk")):
            if ok:
                continue
            if needed:
                raise NotCheckable(f"it needs {what}, which the target declines{_why(supports, capability)}")
            options[option] = False if option == "batch" else True
            notes.append(f"{what}{_why(supports, capability)}")
    return options, taken, notes


def fit_case(case, options: dict, dtypes, devices):
    """An explicit example made into one the target takes, in a dtype and on a device being checked: its
    own if checked, else the first (an hf target is checked without float64, where examples are written)."""
    case = case.replace(dtype=case.dtype if case.dtype in dtypes else dtypes[0],
                        device=case.device if case.device in devices else devices[0])
    limit = options.get("max_length")
    if limit is not None and max(case.n_q, case.n_kv) > limit:
        case = case.replace(n_q=min(case.n_q, limit), n_kv=min(case.n_kv, limit))
    if case.mask not in options["masks"]:
        case = case.replace(mask="padding" if case.mask == "random" and "padding" in options["masks"] else
                            "causal" if "causal" in options["masks"] else options["masks"][0])
    if isinstance(case, Case):
        if options.get("square"):
            case = case.replace(n_q=max(case.n_q, case.n_kv), n_kv=max(case.n_q, case.n_kv))
        if options.get("batch") is False:
            case = case.replace(batch=(), layout="contiguous")
        taken = options.get("head_dims")
        if taken and (case.d_k not in taken or case.d_v not in taken):
            case = case.replace(d_k=width_for(taken, case.d_k), d_v=width_for(taken, case.d_v))
        if options.get("same_width"):
            case = case.replace(d_v=case.d_k)
        if case.kv_heads and "grouped" in options and options["grouped"] is None:
            case = case.replace(kv_heads=0)
        granule = options.get("page_granule", 1)
        if case.page_size % granule:
            case = case.replace(page_size=granule)
    return case
