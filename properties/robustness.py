"""Robustness: what a correct formula can still get wrong as code.

Randomness left on at inference, inputs written in place, outputs in the wrong dtype, memory
layouts assumed, long rows. Each property checks one of them on a black box.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget, multihead_budget
from attn_spec.errors import TargetRaised
from attn_spec.targets.capabilities import supports
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import cross_or_self
from attn_spec.failures import because, worded


def _output(target, case):
    """The target's output: plain attention for a Case, the module's own forward for an MhaCase."""
    if isinstance(case, MhaCase):
        x_q, x_kv, weights, mask = case.tensors()
        return target.multihead(x_q, x_kv, weights, case.n_heads, mask)  # [Tq, D]
    return target.attend(*case.tensors())  # [..., Tq, Dv]


def _call_name(case) -> str:
    """The call :func:`_output` makes, as the user would write it."""
    if isinstance(case, MhaCase):
        return "forward(x_q, x_kv, mask)" if case.mask != "none" else "forward(x_q, x_kv)"
    return "attention(Q, K, V, mask)" if case.mask != "none" else "attention(Q, K, V)"


def _identical(a, b) -> bool:
    """Same shape, dtype and values, NaN matching NaN: the bitwise sense of "the same output"."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    same = a == b
    return bool((same | (a.isnan() & b.isnan()) if a.is_floating_point() else same).all())


@prop("determinism", family="robustness",
      statement="the same inputs give bitwise identical outputs; no dropout or randomness at inference",
      cases={"batch": False}, multihead="module", at_scale={"masks": ("none",)},
      examples=[Case(n_q=8, n_kv=8, d_k=4, d_v=4, values="normal", seed=1),
                MhaCase(n_q=6, n_kv=6, d_model=8, n_heads=2, seed=1)],
      lesson=Lesson(unicode="attn(X) ≡ attn(X)   bitwise, across calls",
                    latex=r"\mathrm{attn}(X) \equiv \mathrm{attn}(X)\ \text{(bitwise)}",
                    why="Inference must be reproducible for evaluation, caching and debugging.",
                    check="Calls the target twice on the same inputs, with a call in between on the first call's own "
                          "tensors with V changed in place (V + 1), and compares bitwise.",
                    example="output"))
def determinism(target, case):
    """attn(X) == attn(X) bitwise, for two calls with a call on other inputs in between; that call gets the first
    call's own tensors, V changed in place (V + 1: the same storage, the same address), and must not return the
    first call's result.

    Why: inference must be reproducible (evaluation, caching, debugging), and a checked
    property that holds only by chance is worthless. Modules are called in eval() mode.
    Catches: dropout left on at inference (F.dropout defaults to training=True), random
    tie-breaking noise, state carried between calls (a KV cache left on, a reused buffer), and
    results cached by the inputs' data pointer or shape (every other call gets fresh storage, which
    the allocator may place where an earlier call's inputs were: there such a cache passes by chance).
    """
    require_responsive(target, case)
    if isinstance(case, MhaCase):
        case = cross_or_self(target, case)
        x_q, x_kv, weights, mask = case.tensors()
        inputs, changed, run = (x_q, x_kv, weights, case.n_heads, mask), x_kv, target.multihead
    else:
        inputs = case.tensors()
        changed, run = inputs[2], target.attend
    first = run(*inputs)
    changed.add_(1)  # other inputs in between, in the same tensors: every output row changes (out + 1 for attention)
    between = run(*inputs)
    if _identical(first, between):
        fail("bitwise the result of the call before it", what="the output after V was changed in place",
             expected="a new result (V + 1 adds 1 to every output row)",
             call=f"{_call_name(case)}, then again after V.add_(1)", got=between, expected_tensor=first,
             labels=("the output after V.add_(1)", "the output before"),
             cause=because("stale-cache"))
    second = _output(target, case)
    if not _identical(first, second):
        differ = (first != second).sum().item()
        fail(f"{differ} of {first.numel()} entries differ", what="the outputs of two calls on the same inputs",
             expected="bitwise identical outputs", call=_call_name(case) + ", twice", got=second, expected_tensor=first,
             labels=("the output of the second call", "the output of the first call, same inputs"),
             cause=because("nondeterministic"))


@prop("inputs-unchanged", family="robustness",
      statement="the target does not modify Q, K, V or the mask in place",
      cases={"batch": False}, multihead="module", at_scale={"masks": ("padding",)},
      examples=[Case(n_q=3, n_kv=3, d_k=4, d_v=2, mask="causal", values="normal", seed=1),
                MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2, mask="causal", seed=1)],
      lesson=Lesson(unicode="Q, K, V, mask after the call ≡ before the call",
                    latex=r"(Q, K, V, \mathrm{mask})_{\text{after}} \equiv (Q, K, V, \mathrm{mask})_{\text{before}}",
                    check="Keeps copies of every input and compares them bitwise with the inputs after the call.",
                    example="output"))
def inputs_unchanged(target, case):
    """Q, K, V and mask (x_q, x_kv and mask for a module) are bitwise the same after the call.

    Why: the caller still holds these tensors: a KV cache, the residual stream, a mask
    shared by every layer. Writing into them corrupts the next layer or the next step with
    no error. Catches: Q.mul_(scale) or Q /= sqrt(d_k) to save memory, mask.logical_not_()
    to flip the polarity, K.transpose_() for K^T.
    """
    require_responsive(target, case)
    if isinstance(case, MhaCase):
        case = cross_or_self(target, case)
        x_q, x_kv, weights, mask = case.tensors()
        target.multihead(x_q, x_kv, weights, case.n_heads, mask)
        fresh = case.tensors()  # rebuilt from the seed: the inputs as they were before the call
        names, after, before = ("x_q", "x_kv", "mask"), (x_q, x_kv, mask), fresh[:2] + fresh[3:]
    else:
        q, k, v, mask = case.tensors()
        target.attend(q, k, v, mask)
        names, after, before = ("Q", "K", "V", "mask"), (q, k, v, mask), case.tensors()
    for name, new, old in zip(names, after, before):
        if new is None:
            continue
        if new.shape != old.shape:
            fail(f"{list(new.shape)}", what=f"the shape of {name} after the call", expected=f"{list(old.shape)} as before",
                 call=_call_name(case), cause=because("reshaped-in-place", name=name))
        if not _identical(new, old):
            fail("modified in place", what=f"{name} after the call", expected=f"{name} bitwise unchanged",
                 call=_call_name(case), cause=because("changed-in-place", name=name, new=new, old=old), got=new, expected_tensor=old,
                 labels=(f"{name} after the call", f"{name} before the call"))


@prop("dtype-device", family="robustness",
      statement="the output has the inputs' dtype and device",
      cases={"batch": False}, multihead="module", at_scale={"masks": ("none",)},
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, dtype="float16"), Case(n_q=2, n_kv=3, d_k=2, d_v=2, dtype="float64"),
                Case(n_q=2, n_kv=2, d_k=2, d_v=2, dtype="bfloat16", device="cuda"),
                MhaCase(n_q=2, n_kv=2, d_model=4, n_heads=2, dtype="float16"),
                MhaCase(n_q=2, n_kv=2, d_model=4, n_heads=2, dtype="float64")],
      lesson=Lesson(unicode="attn(Q, K, V).dtype = Q.dtype,   attn(Q, K, V).device = Q.device",
                    latex=r"\mathrm{attn}(Q,K,V).\mathrm{dtype} = Q.\mathrm{dtype},\quad \mathrm{attn}(Q,K,V).\mathrm{device} = Q.\mathrm{device}",
                    check="Draws cases in every dtype and device and compares the output's dtype and device with the inputs'.",
                    example="dtype"))
def dtype_device(target, case):
    """attn(Q, K, V).dtype == Q.dtype and attn(Q, K, V).device == Q.device (x_q's for a module).

    Why: the next layer expects what it gave; a float32 output in a float16 model doubles
    the memory of the residual stream or fails in the next matmul, and a CPU output from CUDA
    inputs forces a silent device copy. Catches: a float32 softmax never cast back, a result
    computed in float64 and returned as is, a buffer made with torch.zeros(shape) (default
    dtype float32, on the CPU).
    """
    require_responsive(target, case)
    if isinstance(case, MhaCase):
        case = cross_or_self(target, case)
    out = _output(target, case)
    want_dtype, want_device = case.torch_dtype, torch.device(case.device)
    if out.device.type != want_device.type:
        fail(f"{out.device}", what="the output's device", expected=f"{case.device}, the inputs' device",
             call=_call_name(case), cause=because("tensor-without-device"))
    if out.dtype != want_dtype:
        name = str(out.dtype).replace("torch.", "")
        fail(name, what="the output's dtype", expected=f"{case.dtype}, the inputs' dtype", call=_call_name(case),
             cause=because("wrong-dtype", got=out.dtype, wanted=case.dtype))


def _column_major(t):
    """The same values, stored transposed: strides [1, rows] in the last two dims."""
    return t.transpose(-2, -1).contiguous().transpose(-2, -1)


def _view_into_padding(t):
    """The same values as every other row and an inner column range of a buffer full of NaN (False)."""
    fill = False if t.dtype == torch.bool else math.nan
    buffer = torch.full((*t.shape[:-2], 2 * t.shape[-2], t.shape[-1] + 2), fill, dtype=t.dtype, device=t.device)
    view = buffer[..., ::2, 1:-1]  # [..., T, D], storage offset 1, row stride 2 * (D + 2)
    view.copy_(t)
    return view


def _relaid(inputs, layout):
    """The inputs in another memory layout; a tensor passed twice (x_kv is x_q) stays one tensor."""
    done = {}
    for t in inputs:
        if t is not None and id(t) not in done:
            done[id(t)] = layout(t)
    return tuple(None if t is None else done[id(t)] for t in inputs)


def _two_heads_sharing_kv(q, k, v, mask):
    """Q stacked as two identical heads [..., 2, Tq, Dk]; K, V and mask broadcast to both with stride 0."""
    def shared(t):  # [..., T, D] -> [..., 2, T, D], stride 0 on the new dim (as MQA kernels see K/V)
        return None if t is None else t.unsqueeze(-3).expand(*t.shape[:-2], 2, *t.shape[-2:])
    return (torch.stack([q, q], dim=-3), shared(k), shared(v), shared(mask))


@prop("non-contiguous", family="robustness",
      statement="transposed, sliced and expanded inputs give the same result as contiguous copies",
      multihead="module", after=("determinism", "inputs-unchanged", "matches-reference"),
      at_scale="its layouts copy the inputs into other buffers; checked at the drawn sizes",
      examples=[Case(batch=(2,), n_q=3, n_kv=4, d_k=3, d_v=2, mask="random", values="normal", seed=1),
                MhaCase(n_q=3, n_kv=4, d_model=4, n_heads=2, mask="random", seed=1)],
      lesson=Lesson(unicode="attn(strided X) = attn(X.contiguous())",
                    latex=r"\mathrm{attn}(\text{strided } X) = \mathrm{attn}(X.\mathrm{contiguous}())",
                    check="Builds the same values as a transpose, a slice of a NaN-filled buffer and a stride-0 expand, and "
                          "compares with the contiguous call.",
                    example="strided"))
def non_contiguous(target, case):
    """attn(strided X) == attn(X.contiguous()) within the budget, for three layouts of the same values.

    Layouts: column-major storage (a transpose), a strided view into a NaN-filled buffer (a
    slice with a storage offset), and (for attention functions) mixed ones, K contiguous and V
    transposed and the other way (a kernel passing K's strides for V passes when all share one),
    and K, V and mask broadcast with stride 0 over two heads of the same queries.
    Why: real inputs are views: heads split by transpose, KV caches sliced, masks expanded.
    Catches: .view() on a non-contiguous tensor, kernels that index i * D + j from the data
    pointer (they read the transposed values, or the NaN around a slice), K read with V's strides.
    """
    require_responsive(target, case)
    if isinstance(case, MhaCase):
        case = cross_or_self(target, case)
        weights = case.tensors()[2]

        def inputs():  # fresh tensors on every call: the target may write into the ones it gets
            x_q, x_kv, _, mask = case.tensors()
            return x_q, x_kv, mask

        def run(x_q, x_kv, m):
            return target.multihead(x_q, x_kv, weights, case.n_heads, m)

        def allowed(x_q, x_kv, m):
            ref = reference.multihead(x_q, x_kv, *weights.values(), case.n_heads, m)[0]
            return 2 * multihead_budget(x_q, x_kv, weights, case.n_heads, m, ref)
    else:
        inputs = case.tensors  # fresh tensors on every call

        def run(q, k, v, m):
            return target.attend(q, k, v, m)

        def allowed(q, k, v, m):
            return 2 * budget(q, k, v, m, reference.attention(q, k, v, m)[0])
    limit, expected = allowed(*inputs()), run(*inputs())  # [..., Tq, Dv]
    for layout, relayout in (("transposed (column-major)", _column_major),
                             ("sliced (strided views into a NaN-filled buffer)", _view_into_padding)):
        _same_output(run, layout, _relaid(inputs(), relayout), expected, limit)
    if isinstance(case, Case):  # K and V in different layouts: a kernel that reads one with the other's strides
        for layout, relayout in (("mixed (K contiguous, V transposed)", _mixed(_column_major, "v")),
                                 ("mixed (Q and K transposed, V contiguous)", _mixed(_column_major, "q", "k"))):
            _same_output(run, layout, relayout(*inputs()), expected, limit, mixed=True)
    if isinstance(case, Case) and supports(target).batch:  # the third layout adds a head dim
        same = expected.unsqueeze(-3).expand(*expected.shape[:-2], 2, *expected.shape[-2:])  # [..., 2, Tq, Dv]
        _same_output(run, "expanded (stride-0 broadcast)", _two_heads_sharing_kv(*inputs()), same, limit)


def _mixed(relayout, *names):
    """(q, k, v, mask) -> the same with only the inputs ``names`` relaid: Q, K and V in different layouts."""
    return lambda q, k, v, m: tuple(relayout(t) if name in names else t for name, t in zip("qkvm", (q, k, v, m)))


def _same_output(run, layout, strided, expected, limit, mixed=False):
    """run(*strided) must equal ``expected``, the output on contiguous copies, within ``limit`` (``mixed``: Q, K and V
    in different layouts)."""
    try:
        got = run(*strided)
    except TargetRaised as exc:
        exc.message = f"on {layout} inputs, {exc.message}"
        exc.cause = worded(because("view-on-non-contiguous"))
        raise
    assert_close(got, expected, budget=limit, what=f"the output on {layout} inputs against contiguous copies of them",
                 call=f"the target on {layout} inputs", cause=because("strides-ignored", got=got, mixed=mixed),
                 labels=(f"the output on {layout} inputs", "the target's own output on contiguous copies of them"))


LONG_KEYS = 4  # keys per drawn key: the default profile's lengths (up to 130) give 520 keys, thorough's 2048


@prop("long-sequences", family="robustness",
      statement="lengths well beyond toy sizes (hundreds in the default profile, thousands in thorough) and "
                "head dims up to 256 work and match the reference",
      cases={"batch": False}, after=("determinism", "matches-reference", "numerical-stability"),
      at_scale="the fixed shapes are the long sequences: matches-reference checks them",
      examples=[Case(n_q=4, n_kv=130, d_k=16, d_v=8, dtype="float16", values="normal", magnitude=2.5),
                Case(n_q=8, n_kv=160, d_k=256, d_v=256, dtype="float32", values="normal", seed=1),
                Case(n_q=64, n_kv=160, d_k=64, d_v=32, dtype="float32", mask="causal", values="normal", seed=2)],
      lesson=Lesson(unicode="|attn(Q, K, V) − ref₆₄| ≤ budget   for n_kv in the hundreds or thousands, d_k ≤ 256",
                    latex=r"\left|\mathrm{attn}(Q,K,V) - \mathrm{ref}_{64}\right| \le \mathrm{budget}\ \text{for large}\ n_{kv},\ d_k \le 256",
                    check="Draws four times as many keys as usual (and wide heads) and compares with the reference.",
                    example="output"))
def long_sequences(target, case):
    """attn(Q, K, V) matches the reference with n_kv = 4 * (drawn n_kv) keys and the drawn d_k (up to 256),
    at most the target's declared max length (a module with a fixed position buffer: ``max length 1024``).
    A target that crashed at some length without declaring a limit (attn_spec.targets.lengths) is
    called at least one position past where it crashed: that crash is this property's failure.

    A causal case becomes the last n_q positions of the long sequence (bottom-right causal
    mask), as in KV-cache decoding. Why: toy sizes hide every bug that needs many keys or
    wide heads, and production runs thousands of keys. Catches: a fixed KV buffer or block
    loop that drops keys beyond it, exp without max subtraction (the float16 sum of
    thousands of exponentials overflows), a head-dim limit that ignores dims beyond a tile.
    """
    require_responsive(target, case)
    takes = supports(target)
    square = not takes.cross or takes.crash_length is not None  # n_q = n_kv: the whole long sequence, as the
    # length probe ran it
    try:
        got = target.attend(*_long_inputs(case, square, takes))  # [Tq, Dv]
    except TargetRaised as exc:
        if takes.crash_length is not None:  # where it starts, measured by the length probe
            exc.cause = worded(because("length-crash", crash=takes.length_crash))
        raise
    q, k, v, mask = _long_inputs(case, square, takes)  # the kit's own copies: the target may write into them
    inputs = {"Q": q, "K": k, "V": v, "mask": mask}  # the call's, not the drawn case's (n_kv times LONG_KEYS)
    expected, _ = reference.attention(q, k, v, mask)  # [Tq, Dv]
    allowed = budget(q, k, v, mask, expected)
    assert_close(got, expected, budget=allowed, what="the output against the float64 reference",
                 call=f"attention(Q [{case.n_q}, {case.d_k}], K [{k.shape[-2]}, {case.d_k}], V [{k.shape[-2]}, "
                      f"{case.d_v}]{', causal mask' if case.mask == 'causal' else ''}), {case.dtype}",
                 cause=because("long-rows", got=got.detach().cpu().double(), q=q, k=k, v=v, mask=mask, expected=expected,
                               allowed=allowed),
                 inputs=inputs)


def _long_inputs(case, square=False, takes=None):
    """Q [Tq, Dk], K [4 Tk, Dk], V [4 Tk, Dv] and the mask of the case, stretched to many keys
    (``square``: as many queries as keys; ``takes``: at most the target's declared max length, at least one
    past an undeclared crash)."""
    n_kv = min(max(LONG_KEYS * case.n_kv, case.n_q), getattr(takes, "max_length", None) or math.inf)
    if getattr(takes, "crash_length", None) is not None:
        n_kv = max(n_kv, takes.crash_length + 1)
    case = case.replace(n_q=n_kv) if square else case
    q, k, v, mask = case.replace(n_kv=n_kv, mask="none" if case.mask == "causal" else case.mask).tensors()
    if case.mask == "causal":
        mask = reference.causal_mask(case.n_q, n_kv, alignment="bottom-right", device=q.device)  # [Tq, Tk]
    return q, k, v, mask
