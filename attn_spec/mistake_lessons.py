"""``attn-spec explain MISTAKE-ID``: one mistake model of attn_spec.diagnosis as a lesson.

What the wrong code does, the fix, its code, how the kit recognises it, and a worked example computed now:
the model beside the correct formula on the first of a list of small inputs on which the two differ (the
lessons' Q, K, V first, then inputs that tell more mistakes apart: d_v != d_k, a batch, a wide d_k, large
float32 scores, an empty row, the call's own arguments, grouped heads, strided inputs, many keys, a backward
pass). A test asserts that every model's example shows a difference.
"""
from __future__ import annotations

import textwrap

import torch

from attn_spec import reference
from attn_spec.lessons import F64, K, Q, V, _inputs, _m, _t

MISTAKE_TITLES = {"does": "What the wrong code does", "fix": "The fix", "code": "The wrong code, as the kit models it",
                  "recognise": "How the kit recognises it", "example": "Worked example (computed now)"}


def mistake_sections(mistake_id: str) -> dict:
    """The sections of one mistake model's lesson as plain data; KeyError for an unknown id."""
    from attn_spec.diagnosis import MISTAKES

    m = MISTAKES[mistake_id]
    shown = ", ".join(m.caught_by) or "any property whose calls it reproduces"
    recognise = (f"When a target fails, the kit replays each failing property on its minimal case, keeps every "
                 f"call into the target, and runs this model on the same inputs. It names {m.id} when the model "
                 f"reproduces every call within the error budget (the same exception where the target raised, "
                 f"NaN where it gave NaN) and differs from the correct formula somewhere. Shown at: {shown}.")
    if m.level == "stochastic":
        recognise = ("Randomness cannot be replayed, only recognised: the kit reads the weights of one input "
                     f"several times (V = identity) and {m.id} names what the differences look like.")
    elif m.level == "dropout":
        recognise = ("A dropped call cannot be replayed, only read: with q = k = 0 and V = [I | I] the output is the "
                     f"dropped weights, twice; {m.id} names what that readout looks like. Shown at: {shown}.")
    elif m.level == "alibi":
        recognise = ("The kit reads the bias out: with q = 0 every score is 0, so with V = I the output is "
                     f"softmax(bias), and log weights give the bias row by row; {m.id} names what it looks like. "
                     f"Shown at: {shown}.")
    elif m.serving:
        recognise = (f"Each failing property is replayed on its minimal case with every call into the {m.level} kernel "
                     f"kept; {m.id} is named when it reproduces every kept call (outputs within a few units in the last "
                     f"place, NaN where the kernel gave NaN, both caches afterwards) and the correct kernel does not. "
                     f"Shown at: {shown}.")
    if isinstance(m.params, dict):
        recognise += " Its number is fitted to the failing call, then checked on every other call."
    elif m.params and not m.recognised:
        tried = ", ".join(", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in p.items())
                          for p in m.params)
        recognise += f" Settings tried: {tried}."
    return {"id": m.id, "family": m.family, "level": m.level, "does": m.describe(), "fix": m.fix_for(),
            "code": m.code, "recognise": recognise, "example": _mistake_example(m)}


def _example_calls(m):
    """(call, lines describing its inputs) for a worked example, in order: the lessons' Q, K, V first, then
    inputs that tell more mistakes from the correct formula (d_v != d_k, a batch of two, a wide d_k)."""
    from attn_spec.targets.record import Call

    mask = reference.causal_mask(2, 2) if m.family == "masking" else None
    shown_mask = [_m("causal mask (True = may attend)", mask.double())] if mask is not None else []
    if m.level == "module":
        x = _t([[1.0, 0.5], [-1.0, 2.0]])
        eye = torch.eye(2, dtype=F64)
        yield Call("multihead", {"x_q": x, "x_kv": x, "weights": {"W_Q": eye, "W_K": eye, "W_V": eye,
                                                                  "W_O": _t([[1.0, 2.0], [0.0, 1.0]])},
                                 "n_heads": 2, "mask": mask}), [_m("x", x), "2 heads of width 1, W_Q = W_K = W_V = I",
                                                                *shown_mask]
        w_k, w_v = _t([[1.0, 0.0], [0.0, 2.0]]), _t([[0.0, 1.0], [1.0, 0.0]])
        yield Call("multihead", {"x_q": x, "x_kv": x, "weights": {"W_Q": eye, "W_K": w_k, "W_V": w_v, "W_O": eye},
                                 "n_heads": 1, "mask": mask}), [_m("x", x), "1 head, W_Q = W_O = I", _m("W_K", w_k),
                                                                _m("W_V", w_v), *shown_mask]
    if m.level == "module":
        return
    if m.level == "backward":
        yield Call("vjp", {"q": Q, "k": K, "v": V, "mask": mask, "grad_out": torch.ones(2, 2, dtype=F64)}), \
            _inputs() + ["G = ones: the gradients of sum(out)", *shown_mask]
        yield from _vjp_with_mask()
        return
    yield Call("attend", {"q": Q, "k": K, "v": V, "mask": mask}), _inputs() + shown_mask
    v3 = _t([[1.0, 2.0, 0.0], [3.0, 4.0, 1.0]])  # [Tk=2, Dv=3]: d_v != d_k
    yield Call("attend", {"q": Q, "k": K, "v": v3, "mask": mask}), [_m("Q", Q), _m("K", K), _m("V (d_v = 3)", v3),
                                                                    *shown_mask]
    qb, kb, vb = (torch.stack([t, t.flip(0)]) for t in (Q, K, V))  # [B=2, 2, 2]
    causal = reference.causal_mask(2, 2)
    yield Call("attend", {"q": qb, "k": kb, "v": vb, "mask": causal}), [
        "a batch of two: element 0 is Q, K, V; element 1 the same with rows reversed",
        _m("causal mask (True = may attend)", causal.double())]
    wide = torch.zeros(2, 256, dtype=F64)  # [T=2, Dk=256]
    qw, kw = wide.clone(), wide.clone()
    qw[:, :2], kw[:, :2], qw[:, 200], kw[:, 200] = Q, K, 1.0, torch.tensor([1.0, -1.0], dtype=F64)
    yield Call("attend", {"q": qw, "k": kw, "v": V, "mask": mask}), [
        "Q, K [2, 256]: the lessons' Q and K in columns 0-1, and column 200 (beyond a tile of 128) = 1 for Q, "
        "[1, -1] for K", _m("V", V), *shown_mask]
    yield from _more_example_calls(m, mask, shown_mask)


def _more_example_calls(m, mask, shown_mask):
    """Inputs that tell the rest apart: large float32 scores, a row with no allowed key, n_q != n_kv with
    negative values, a float mask, the call's own arguments (is_causal, a scale, a window, a softcap), scores
    above a clamp, grouped K/V heads, strided and expanded inputs, many keys, and a backward pass."""
    from attn_spec.targets.record import Call

    big = {"q": (40 * Q).float(), "k": (40 * K.flip(0)).float(), "v": V.float()}  # scores to ±2263: exp overflows
    yield Call("attend", {**big, "mask": mask}), [_m("Q (float32)", big["q"]), _m("K (float32)", big["k"]),
                                                 _m("V (float32)", big["v"]), *shown_mask]
    bias, empty = _t([[0.0, -1.0], [-2.0, 0.0]]), torch.tensor([[True, False], [False, False]])
    yield Call("attend", {"q": Q, "k": K, "v": V, "mask": empty}), _inputs() + [
        _m("mask (True = may attend; query 1 may attend no key)", empty.double())]
    k3, v3 = _t([[1.0, 1.0], [0.0, -1.0], [2.0, 0.0]]), _t([[1.0, -2.0], [-3.0, 4.0], [0.5, -1.0]])
    yield Call("attend", {"q": Q, "k": k3, "v": v3, "mask": None}), [_m("Q", Q), _m("K (3 keys)", k3),
                                                                    _m("V (negative entries)", v3), "no mask"]
    yield Call("attend", {"q": Q, "k": K, "v": V, "mask": bias}), _inputs() + [_m("float mask (added)", bias)]
    yield Call("attend", {"q": Q, "k": K, "v": V, "mask": None, "is_causal": True, "scale": -0.5}), _inputs()[:3] + [
        "is_causal=True, scale=-0.5 (an explicit scale, negative)"]
    yield Call("attend", {"q": Q, "k": K, "v": V, "mask": None, "window": 1}), _inputs() + [
        "window=1 (each query sees its own key only)"]
    causal = reference.causal_mask(2, 2)
    yield Call("attend", {"q": Q, "k": K, "v": V, "mask": causal, "softcap": 2.0}), _inputs() + [
        "softcap=2.0 (scores = 2 tanh(scores / 2))", _m("causal mask (True = may attend)", causal.double())]
    qc, kc = _t([[10.0, 0.0]]), _t([[9.0, 0.0], [8.5, 0.0]])  # scores 63.6 and 60.1: both above 50
    yield Call("attend", {"q": qc, "k": kc, "v": V, "mask": mask}), [_m("Q", qc), _m("K", kc), _m("V", V),
                                                                    "scores 63.6 and 60.1", *shown_mask]
    gen = torch.Generator().manual_seed(0)
    q4, kv2 = torch.randn(4, 2, 2, generator=gen, dtype=F64), torch.randn(2, 2, 2, generator=gen, dtype=F64)
    yield Call("attend", {"q": q4, "k": kv2, "v": kv2.flip(-1), "mask": mask}), [
        _m("Q (4 heads)", q4), _m("K (2 KV heads: query heads 0, 1 read KV head 0)", kv2), "V = K with columns swapped",
        *shown_mask]
    strided = [t.T.contiguous().T for t in (Q, K, V)]  # the same values, stored column by column
    yield Call("attend", {"q": strided[0], "k": strided[1], "v": strided[2], "mask": mask}), _inputs() + [
        "Q, K and V stored column by column (non-contiguous views)", *shown_mask]
    qb = torch.randn(2, 2, 3, 2, generator=gen, dtype=F64)  # [B=2, H=2, T=3, D=2]
    kb = torch.randn(1, 2, 3, 2, generator=gen, dtype=F64).expand(2, 2, 3, 2)  # one element's K for both (stride 0)
    vb = torch.randn(1, 2, 3, 2, generator=gen, dtype=F64).expand(2, 2, 3, 2)
    yield Call("attend", {"q": qb, "k": kb, "v": vb, "mask": None}), [
        _m("Q (batch 2, heads 2)", qb), "K and V: one batch element's, expanded over the batch (stride 0)",
        _m("K[0]", kb[0]), _m("V[0]", vb[0])]
    n = 520  # more keys than a buffer of 512 slots
    kl, vl = torch.zeros(n, 2, dtype=F64), torch.arange(n, dtype=F64)[:, None] / n
    kl[-1] = torch.tensor([4.0, 0.0])
    yield Call("attend", {"q": Q[:1], "k": kl, "v": vl, "mask": None}), [
        _m("Q", Q[:1]), f"K: {n} keys, all 0 but the last, [4, 0]; V: key j's value is j/{n}"]
    yield from _vjp_with_mask()


def _vjp_with_mask():
    from attn_spec.targets.record import Call

    causal = reference.causal_mask(2, 2)
    yield Call("vjp", {"q": Q, "k": K, "v": V, "mask": causal, "grad_out": torch.ones(2, 2, dtype=F64)}), \
        _inputs() + ["G = ones: the gradients of sum(out)", _m("causal mask (True = may attend)", causal.double())]


def _tolerance(call) -> float:
    """How far two predictions may be and still be the same output: float64 rounding, or float32's."""
    dtype = call.inputs.get("q", call.inputs.get("x_q")).dtype
    return 1e-9 if dtype == F64 else 1e-4


def differs(call, good, bad) -> bool:
    """Does the model's prediction differ from the correct one on this call (its output, an input it writes into)?
    A row the correct formula leaves to convention (no allowed key) matches zeros or NaN."""
    from attn_spec.diagnosis.replay import mismatch

    return good is not None and bad is not None and mismatch(good, bad, [_tolerance(call)] * 4) > 1


def example_call(m):
    """(call, input lines, correct prediction, model's prediction) of the first example on which the model
    differs from the correct formula (its output, or an input it writes into); the first one if none does."""
    from attn_spec.diagnosis.predict import CORRECT, predict

    first = None
    for call, lines in _example_calls(m):
        state = {}
        if m.stateful:  # a first call on other inputs: what the model keeps from it shows on this one
            predict(m, _doubled(call), m.typical, state)
            lines = [*lines, "after a first call on 2 x (the same module instance)"]
        good, bad = predict(CORRECT, call), predict(m, call, m.typical, state)
        first = first or (call, lines, good, bad)
        if differs(call, good, bad):
            return call, lines, good, bad
    return first


def _doubled(call):
    from attn_spec.targets.record import Call

    x = dict(call.inputs)
    for name in ("x_q", "x_kv", "q", "k", "v"):
        if isinstance(x.get(name), torch.Tensor):
            x[name] = 2 * x[name]
    return Call(call.kind, x)


def _mistake_example(m) -> str:
    """The model next to the correct formula on the first example that tells them apart."""
    if m.recognised or m.serving:
        return ""
    call, lines, good, bad = example_call(m)
    lines = list(lines)
    names = ("out", "dQ", "dK", "dV") if call.kind == "vjp" else ("out", "weights")
    for who, pred in (("correct", good), (m.id, bad)):
        if pred is None or pred.error:
            lines.append(f"{who}: raises {pred.error[0] if pred else '?'}: {pred.error[1] if pred else ''}")
            continue
        parts = pred.out if isinstance(pred.out, tuple) else (pred.out,)
        for name, part in zip(names, parts):
            if isinstance(part, torch.Tensor):
                lines.append(_m(f"{who}: {name}", part.detach().double()))
        for name, after in pred.changed.items():
            lines.append(_m(f"{who}: {name} after the call (written in place)", after.detach().double()))
    return "\n".join(lines)


def render_mistake(mistake_id: str, fmt: str = "text") -> str:
    """One mistake model as a lesson: what it does, the fix, its code, how it is recognised, an example."""
    e, md = mistake_sections(mistake_id), fmt == "markdown"
    head = f"{e['id']}: a mistake model\nfamily: {e['family']} · level: {e['level']}"
    out = [f"# {e['id']}\n\na mistake model · family: {e['family']} · level: {e['level']}" if md else head]
    for key, title in MISTAKE_TITLES.items():
        body = e[key]
        if not body:
            continue
        if md:
            body = f"```python\n{body}\n```" if key == "code" else f"```\n{body}\n```" if key == "example" else body
            out.append(f"## {title}\n\n{body}")
        else:
            wrapped = body if key in ("code", "example") else textwrap.fill(body, 96)
            out.append(f"{title}\n{textwrap.indent(wrapped, '  ')}")
    return "\n\n".join(out) + "\n"
