"""A failing case as a Counterexample: what it showed, its inputs as the target got them, and the copy-paste
snippet that reproduces it (the report's renderers write it; nothing here formats a matrix)."""
from __future__ import annotations

import dataclasses

import torch

from attn_spec.checking.cases import MhaCase
from attn_spec.checking.catalog import Property
from attn_spec.errors import Failure, TargetRaised
from attn_spec.report import Counterexample
from attn_spec.targets.conventions import Target, conventions


def _snippet(prop: Property, case, target: Target, seed: int, call: str = "", own: bool = True) -> str:
    """The copy-paste reproduction: the CLI line, the case, its tensors as the target got them (the mask and a
    module's projection weights named; ``own``: the failing call took the case's own tensors, not a probe's),
    the call that failed, and ``attn_spec.reproduce``."""
    fields = ", ".join(f"{f.name}={getattr(case, f.name)!r}" for f in dataclasses.fields(case)
                       if getattr(case, f.name) != f.default)
    kind = type(case).__name__
    options = dict(target.options())  # make_target keywords that rebuild it: layout, expect_mask, expect_score
    flags = "".join(f" --{key.replace('_', '-')} {' '.join(value) if isinstance(value, list) else value}"
                    for key, value in options.items())
    if target.required:  # a required capability changes what a property judges (hf: GQA)
        flags += f" --require {' '.join(sorted(target.required))}"
        options["require"] = sorted(target.required)
    if tuple(target.masks) != tuple(target.default_masks):  # masks the user declared
        flags += f" --masks {','.join(target.masks)}"
        options["masks"] = tuple(target.masks)
    keywords = "".join(f", {key}={value!r}" for key, value in options.items())
    return (f"# attn-spec check {target.name} --only {prop.id} --seed {seed}{flags}\n"
            f"import attn_spec\nfrom attn_spec.cases import {kind}\n"
            f"case = {kind}({fields})\n{_tensors_line(case, target) if own else ''}"
            + (f"# the call that failed: {call}\n" if call else "") +
            f"attn_spec.reproduce({prop.id!r}, {target.name!r}, case, convention={target.convention!r}{keywords})")


def _tensors_line(case, target: Target) -> str:
    """The line that draws the case's tensors, saying what the mask and a module's projections are."""
    mask = {"none": "", "causal": "mask: the causal mask", "random": "mask: a random one",
            "padding": "mask: key padding"}.get(getattr(case, "mask", "none"), f"mask: {case.mask}")
    mask = f"{mask}, True = may attend" if mask else "no mask"
    if isinstance(case, MhaCase):
        return (f"x_q, x_kv, weights, mask = case.tensors()  # {mask}; weights: W_Q, W_K, W_V, W_O "
                f"[{case.d_model}, {case.d_model}], loaded into the module's projections; {case.n_heads} heads\n")
    if target.convention not in conventions(kind="attention"):  # a mod or a serving kernel: not called on Q, K, V
        return ""
    if target.convention in conventions(kind="attention", multihead=True):
        mask += (f"; {target.name} is called through the kit's own projections that select Q, K and V "
                 f"(one head; attn_spec.targets.modules)")
    return f"Q, K, V, mask = case.tensors()  # {mask}\n"


def counterexample(prop, failure: Failure, case, target: Target, seed: int) -> Counterexample:
    """What the failure showed, as data (the report's renderers write it)."""
    labels = failure.labels or ("the target's result", "the float64 reference")
    inputs = failure.inputs or ({} if failure.summary else _inputs(case))  # a mod's counterexample has no Q, K, V
    summary = failure.summary or case.summary()
    if failure.inputs:
        summary = "the call's inputs: " + ", ".join(f"{name} {list(t.shape)}" for name, t in inputs.items()
                                                    if t is not None)
    mask = failure.mask  # the allowed pattern a property chose to show (a window, a mask_mod)
    if mask is None and "weights" in labels[0] and isinstance(failure.got, torch.Tensor):
        mask = inputs.get("mask")
    return Counterexample.of(case=dataclasses.asdict(case), summary=summary, got=failure.got,
                             expected=failure.expected, labels=labels, inputs=inputs, seed=seed,
                             reproduce=_snippet(prop, case, target, seed, failure.call, own=not failure.inputs),
                             mask=mask,
                             traceback=failure.user_traceback if isinstance(failure, TargetRaised) else None)


def _inputs(case) -> dict:
    """The case's tensors by name, as the target got them (a module's projections are drawn from the seed too)."""
    if isinstance(case, MhaCase):  # with the projection weights the module was loaded with
        x_q, x_kv, weights, mask = case.tensors()
        return {"x_q": x_q, "x_kv": x_kv, "mask": mask, **weights}
    return dict(zip(("Q", "K", "V", "mask"), case.tensors()))
