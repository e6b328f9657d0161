"""The platform control: is a failure the target's, or the platform's (torch, its kernels, this CPU or GPU)?

Whenever a property fails a target, every call the target got on that case is run again through the
kit's own plain implementations, the ones that set the error budget (``checking.tolerance``: the
formula with the scale on Q first, and as written in most code), on exactly the inputs the target
got: the same dtype, device, strides and storage offsets, copied from the call itself before the
target ran. If one of them shows a defect on a call (NaN or inf where the float64 reference is
finite, or an error beyond the budget a correct implementation earns on contiguous copies of the
same values), the platform cannot compute attention on those inputs: the failure is not the
target's. :func:`judge` raises :class:`PlatformDefect` (an ``Uninformative``) instead, so the case
is drawn again, no root is formed from it and no mistake model is fitted to it; its ``note`` is
what the report says once, in its header (``"platform"`` in JSON), with a snippet that shows the
defect without any kit code and the workaround it measured.

Why: torch 2.13's oneDNN bfloat16 matmul on CPUs with AVX512-BF16/AMX reads outside a strided view
for some shapes (``padded_view(Q) @ padded_view(K).T`` gives NaN), and a correct target got the
blame. The control is not specific to that matmul: any defect of the formula on the platform is
caught where failures are judged, for every property and convention.

A long call (its float64 scores do not fit in one chunk) is judged as the properties judge it: on the query
rows of ``checking.rows.choose``, copied out of the call's inputs (``_on_chosen_rows``), so the control of a
failure at 64k keys costs O(k n d), not O(n^2 d) in float64 memory and time.

The control is silent where it cannot judge: outside the dtype's range (a score that overflows
float16 is ordinary arithmetic, not a defect), in rows without an allowed key, and where a formula
of its own cannot take the call (the failure then stands).
"""
from __future__ import annotations

import contextlib
import math
import warnings

import torch

from attn_spec import reference
from attn_spec.reference import fold, fold_causal, visible
from attn_spec.checking import chunked, grad_tolerance, rows, tolerance
from attn_spec.checking.platform_snippet import snippet
from attn_spec.errors import Failure, PlatformDefect
from attn_spec.targets.deadline import on_case

F64 = torch.float64
FORMS = ("Q scaled first", "scores scaled")  # tolerance.naive_attention, tolerance.seed_attention
PARTS = ("the output", "dQ", "dK", "dV")


def exact_copy(value):
    """A copy of a tensor on its own device with its shape, strides and storage offset (the memory around the
    view copied too: a kernel reading outside it reads what the target's kernel read); other values as they are."""
    if isinstance(value, dict):
        return {key: exact_copy(v) for key, v in value.items()}
    if not isinstance(value, torch.Tensor):
        return value
    t = value.detach()
    storage = torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage()).clone()
    return storage.as_strided(t.shape, t.stride(), t.storage_offset())


class Inputs:
    """Keeps the inputs of every call into the target, exactly as it got them (``Target.recorder``)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []

    def observe(self, kind: str, inputs: dict, thunk, *, label: str = "", state_key: tuple = ()):
        self.calls.append((kind, {name: exact_copy(value) for name, value in inputs.items()}))
        return thunk()


def judge(prop, target, case) -> None:
    """``prop.fn(target, case)``; a failure that the kit's own formula shows too on the inputs of its calls is
    the platform's: PlatformDefect instead of the Failure. Its note is made once per kind of defect and target
    (``target.platform_notes``); the report counts the cases and properties it took. Each call into the target
    has the deadline of a call on ``case`` (attn_spec.targets.deadline)."""
    with on_case(case, lambda: f"{target.name}: {prop.id} on {case.summary()}"):  # each call's deadline
        _judge(prop, target, case)


def _judge(prop, target, case) -> None:
    if getattr(target, "recorder", True) is not None:  # a diagnosis is recording its replays: no second recorder
        prop.fn(target, case)
        return
    target.recorder = inputs = Inputs()
    try:
        prop.fn(target, case)
    except Failure as failure:
        target.recorder = None
        found = control(inputs.calls)
        if found is None:
            raise
        kind, x, form, part, defect = found
        first = next(iter(tensors(x).values()))
        key = (kind, part, defect.split(" ")[0], first.dtype, str(first.device),
               any(not t.is_contiguous() for t in tensors(x).values()))
        if getattr(target, "platform_notes", None) is None:  # a Target subclass that skipped Target.__init__
            target.platform_notes = {}
        note = target.platform_notes.get(key)
        if note is None:
            note = target.platform_notes[key] = _note(kind, x, form, part, defect)
        raise PlatformDefect(note) from failure
    finally:
        target.recorder = None


def control(calls):
    """(kind, inputs, form, part, defect) of the first call on which the kit's own formula shows a defect, or None."""
    for kind, x in calls:
        if kind not in ("attend", "multihead", "vjp"):
            continue
        try:
            found = _control_call(*_on_chosen_rows(kind, x))
        except (RuntimeError, ValueError, IndexError, TypeError):  # a formula of the kit's cannot take this call
            continue
        if found is not None:
            return (kind, x, *found)
    return None


def _on_chosen_rows(kind: str, x: dict):
    """(kind, inputs) as the control judges a call. A long call (its float64 scores do not fit in one chunk) is
    judged as the properties judge it, on the query rows of ``rows.choose`` (copies of them, the causal pattern
    folded into their mask rows, O(k n d) instead of O(n^2 d) in float64); a backward whose G reaches other rows
    is judged on its forward. A short call as it is, on exactly the inputs the target got."""
    q, k, v, mask = x.get("q"), x.get("k"), x.get("v"), x.get("mask")
    if kind == "multihead" or chunked.fits(q, k, v, mask):
        return kind, x
    n_q, n_kv = q.shape[-2], k.shape[-2]
    index = torch.tensor(list(rows.choose(n_q, n_kv)), dtype=torch.long, device=q.device)
    sub = None if mask is None else mask if mask.shape[-2] == 1 else mask.index_select(-2, index.to(mask.device))
    if x.get("is_causal") or x.get("window") is not None:  # top-left, as fold_causal writes it
        sub = fold(sub, visible(index, n_kv, window=x.get("window")))  # [..., k, Tk]
    judged = dict(x, q=q.index_select(-2, index), mask=sub, is_causal=False, window=None)
    if kind == "vjp":
        g = x["grad_out"]
        elsewhere = torch.ones(n_q, dtype=torch.bool, device=g.device)
        elsewhere[index.to(g.device)] = False
        if g[..., elsewhere, :].any():
            return "attend", judged
        judged["grad_out"] = g.index_select(-2, index.to(g.device))
    return kind, judged


def _control_call(kind: str, x: dict):
    """(form, part, defect) of the first defective output of the kit's formulas on this call, or None."""
    expected = _expected(kind, x)
    if expected is None:
        return None
    for form in (FORMS[:1] if kind == "multihead" else FORMS):
        defect = _defects(_run(kind, x, form), expected)
        if defect is not None:
            return (form, *defect)
    return None


def _defects(outputs, expected):
    """(part, what) of the first output that is non-finite where the reference is finite, or beyond its budget."""
    refs, budgets, free = expected
    for part, got, ref, allowed in zip(PARTS, outputs, refs, budgets):
        got, ref = got.detach().to("cpu", F64), ref.detach().to("cpu", F64)
        judged = torch.isfinite(ref)
        if free is not None and part == PARTS[0]:
            judged &= ~free.expand(ref.shape)
        bad = ~torch.isfinite(got) & judged
        if bad.any():
            return part, f"NaN or inf at {int(bad.sum())} of {ref.numel()} entries"
        err = (got - ref).abs()[judged].max().item() if judged.any() else 0.0
        if err > allowed:
            return part, f"a max error of {err:.3g}, beyond the budget {allowed:.3g}"
    return None


# ------------------------------------------------------------------ the kit's formulas on the call


def _options(x: dict):
    """(q, k, v, mask, scale, cap): the call's tensors, with a causal or windowed pattern folded into the mask."""
    q, k, v, mask = x["q"], x["k"], x["v"], x.get("mask")
    if x.get("window") is not None:
        mask = fold_causal(mask, q.shape[-2], k.shape[-2], x["window"])
    if x.get("is_causal"):
        mask = fold_causal(mask, q.shape[-2], k.shape[-2])
    return q, k, v, mask, x.get("scale"), x.get("softcap")


def grouped(q, k) -> bool:
    return q.dim() >= 3 and k.dim() >= 3 and 1 < k.shape[-3] < q.shape[-3] and q.shape[-3] % k.shape[-3] == 0


def formula(form: str, cap=None):
    """The kit's plain formula ``form`` in the inputs' dtype; grouped K/V heads read through views (query
    head h reads K/V head h // g), so every input keeps the layout the target got."""
    def attend(q, k, v, mask=None, *, scale=None):
        if grouped(q, k):
            g, heads = q.shape[-3] // k.shape[-3], k.shape[-3]
            if mask is not None and mask.dim() >= 3:
                mask = mask.unflatten(-3, (heads, g)) if mask.shape[-3] == q.shape[-3] else mask.unsqueeze(-3)
            out = attend(q.unflatten(-3, (heads, g)), k.unsqueeze(-3), v.unsqueeze(-3), mask, scale=scale)
            return out.flatten(-4, -3)  # [..., H, Tq, Dv]
        if cap is not None:
            return tolerance.softcap_attention(q, k, v, mask, cap, first_scale=form == FORMS[0], scale=scale)
        impl = tolerance.naive_attention if form == FORMS[0] else tolerance.seed_attention
        return impl(q, k, v, mask, scale=scale)
    return attend


def _run(kind: str, x: dict, form: str) -> list:
    """The kit's outputs on the call's own inputs: [out], or [out, dQ, dK, dV] for a backward."""
    if kind == "multihead":
        return [tolerance.naive_multihead(x["x_q"], x["x_kv"], x["weights"], x["n_heads"], x["mask"])]
    q, k, v, mask, scale, cap = _options(x)
    attend = formula(form, cap)
    if kind == "attend":
        whole = grouped(q, k) or chunked.fits(q, k, v, mask)
        return [attend(q, k, v, mask, scale=scale) if whole else tolerance.by_rows(attend, q, k, v, mask, scale=scale)]
    with torch.no_grad():
        out = attend(q, k, v, mask)
    return [out, *grad_tolerance.naive_grads(attend, q, k, v, mask, x["grad_out"])]


def _expected(kind: str, x: dict):
    """(references, budgets, free rows) as the properties judge the call: the float64 reference, and budgets
    earned on contiguous copies; None where the formula may leave the dtype's range (no verdict there)."""
    if kind == "multihead":
        x_q, x_kv, mask = (None if t is None else t.contiguous() for t in (x["x_q"], x["x_kv"], x["mask"]))
        W = {key: w.contiguous() for key, w in x["weights"].items()}
        names = ("W_Q", "W_K", "W_V", "W_O")
        q64, k64 = (t.to("cpu", F64) @ W[n].to("cpu", F64).T for t, n in ((x_q, "W_Q"), (x_kv, "W_K")))
        if not _in_range(q64, k64, mask, 1.0, x_q.dtype):
            return None
        ref = reference.multihead(x_q, x_kv, *(W[n] for n in names), x["n_heads"], mask)[0]
        free = _free(mask)
        free = None if free is None else free.reshape(-1, *free.shape[-2:]).any(dim=0)  # [Tq, 1]: a head without keys
        return [ref], [tolerance.multihead_budget(x_q, x_kv, W, x["n_heads"], mask, ref)], free
    q, k, v, mask, scale, cap = (t.contiguous() if isinstance(t, torch.Tensor) else t for t in _options(x))
    if grouped(q, k):
        g = q.shape[-3] // k.shape[-3]
        k, v = reference.repeat_kv(k, g), reference.repeat_kv(v, g)
    if not _in_range(q, k, mask, 1.0 if scale is None else abs(scale), q.dtype):
        return None
    ref = reference.attention(q, k, v, mask, scale=scale, softcap=cap)[0]
    allowed = tolerance.budget(q, k, v, mask, ref, scale=scale) if cap is None else \
        tolerance.softcap_budget(q, k, v, mask, ref, cap)
    free = _free(mask)
    if kind == "attend":
        return [ref], [allowed], free
    if free is not None and free.any():  # no gradient leaves a row without keys; the plain formula's is NaN
        return [ref], [allowed], free
    g_out = x["grad_out"].contiguous()
    if not _in_range(g_out, v, None, 1.0, q.dtype):
        return None
    grads = grad_tolerance.reference_grads(q, k, v, mask, g_out, scale=scale)
    return [ref, *grads], [allowed, *grad_tolerance.grad_budgets(q, k, v, mask, g_out, grads)], free


def _free(mask):
    """Bool [..., Tq, 1]: rows with no allowed key (the formula's NaN there is a convention), or None."""
    if mask is None:
        return None
    allowed = mask if mask.dtype == torch.bool else mask > -math.inf
    return ~allowed.any(dim=-1, keepdim=True).cpu()


def _in_range(a, b, mask, scale: float, dtype) -> bool:
    """No product a_i . b_j (times ``scale``, plus an additive mask) can reach a quarter of the dtype's
    largest value, nor can a row's sum of n_kv weights: the plain formula cannot overflow on these inputs."""
    if not dtype.is_floating_point:
        return True
    big = torch.finfo(dtype).max / 4
    a, b = a.detach().to("cpu", F64), b.detach().to("cpu", F64)
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    norms = [t.norm(dim=-1).max().item() if t.numel() else 0.0 for t in (a, b)]
    bound = norms[0] * norms[1] * max(1.0, scale)
    if mask is not None and mask.dtype != torch.bool:
        finite = mask[torch.isfinite(mask)]
        bound += finite.abs().max().item() if finite.numel() else 0.0
    return bound < big and b.shape[-2] < big


# ------------------------------------------------------------------ the note


def _device(t: torch.Tensor) -> str:
    if t.device.type == "cuda":
        return f"{t.device} ({torch.cuda.get_device_name(t.device)})"
    if t.device.type == "cpu":
        return f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    return str(t.device)


def tensors(x: dict) -> dict:
    """The call's tensors by name, the weights of a dict among them."""
    found = {}
    for name, value in x.items():
        if isinstance(value, dict):
            found.update(value)
        elif isinstance(value, torch.Tensor):
            found[name] = value
    return found


def _contiguous(x: dict) -> dict:
    return {name: (_contiguous(v) if isinstance(v, dict) else v.contiguous() if isinstance(v, torch.Tensor) else v)
            for name, v in x.items()}


def _still(kind, x, form, expected, context) -> bool:
    """Does the defect show again with ``x`` (under ``context``)?"""
    with context:
        return _defects(_run(kind, x, form), expected) is not None


def workaround(kind, x, form) -> str:
    """What makes the defect go away, measured: contiguous copies of the inputs, oneDNN switched off."""
    expected, strided = _expected(kind, x), any(not t.is_contiguous() for t in tensors(x).values())
    said = []
    if strided:
        gone = not _still(kind, _contiguous(x), form, expected, contextlib.nullcontext())
        said.append(f"{'goes away' if gone else 'stays'} with contiguous copies of the inputs (.contiguous())")
    if next(iter(tensors(x).values())).device.type == "cpu":
        with warnings.catch_warnings():  # torch warns about TF32 on oneDNN whenever its flags are set
            warnings.simplefilter("ignore")
            gone = not _still(kind, x, form, expected, torch.backends.mkldnn.flags(enabled=False))
        said.append(f"{'goes away' if gone else 'stays'} under torch.backends.mkldnn.flags(enabled=False)")
    return "; ".join(said)


def _snippet_inputs(kind: str, x: dict):
    """(tensors by name, scale, cap, heads): what the snippet rebuilds, the causal pattern folded into the mask."""
    if kind == "multihead":
        named = {"x_q": x["x_q"], "x_kv": x["x_kv"], **x["weights"], "mask": x["mask"]}
        return named, 1.0 / math.sqrt(x["x_q"].shape[-1] // x["n_heads"]), None, x["n_heads"]
    q, k, v, mask, scale, cap = _options(x)
    named = {"q": q, "k": k, "v": v, "mask": mask, **({"grad_out": x["grad_out"]} if kind == "vjp" else {})}
    return named, 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale, cap, None


def _note(kind: str, x: dict, form: str, part: str, defect: str) -> dict:
    """What the report says about a platform defect: what, torch, device, dtype, shapes, reproduce (no kit code)."""
    named = tensors(x)
    first = next(iter(named.values()))
    dtype = str(first.dtype).removeprefix("torch.")
    layout = "strided" if any(not t.is_contiguous() for t in named.values()) else "contiguous"
    what = {"attend": "attention", "multihead": "multi-head attention", "vjp": "attention backward"}[kind]
    shown = "NaN or inf" if defect.startswith("NaN") else "an error beyond its budget"
    what = f"the kit's own plain {dtype} {what} gives {shown} in {part} on {layout} inputs, where float64 does not"
    inputs, scale, cap, heads = _snippet_inputs(kind, x)
    title = f"torch {torch.__version__}, {_device(first)}, {dtype}: {what} ({defect}; {form})"
    return {"what": what, "torch": torch.__version__, "device": _device(first), "dtype": dtype,
            "shapes": [f"{name} {list(t.shape)} strides {list(t.stride())} offset {t.storage_offset()}"
                       for name, t in named.items()],
            "workaround": workaround(kind, x, form),
            "reproduce": snippet(kind, inputs, form, scale=scale, cap=cap, n_heads=heads,
                                 budgets=_expected(kind, x)[1], title=title)}
