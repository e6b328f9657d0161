"""A platform defect, reproduced in torch alone: the call's inputs at their own strides and storage offsets
(NaN around them), the plain formula the kit ran on them, and the checks that show the defect.

The snippet is run here before the report shows it: with seeded random values of the inputs' spread
when those show the defect, else with the call's own values (small inputs), else it says it did not
show in a fresh run (a defect that depends on what ran before).
"""
from __future__ import annotations

import contextlib
import io
import math
import re
import warnings

import torch

EXACT_LIMIT = 1 << 14  # elements of one input written out as its values

HEAD = '''import math, torch


def laid_out(values, size, stride, offset):  # the values at these strides and storage offset, NaN around them
    storage = offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1
    fill = math.nan if values.is_floating_point() else 0
    t = torch.full((storage,), fill, dtype=values.dtype, device=values.device).as_strided(size, stride, offset)
    once = tuple(slice(0, 1) if s == 0 else slice(None) for s in stride)  # a stride-0 dim holds one value
    t[once].copy_(values[once])
    return t
'''

ATTENTION = '''
def attention(q, k, v, mask):  # softmax(scale Q K^T) V in the inputs' dtype, {form}
    if q.dim() >= 3 and k.dim() >= 3 and 1 < k.shape[-3] < q.shape[-3]:  # grouped K/V: head h reads K/V head h // g
        g, heads = q.shape[-3] // k.shape[-3], k.shape[-3]
        if mask is not None and mask.dim() >= 3:
            mask = mask.unflatten(-3, (heads, g)) if mask.shape[-3] == q.shape[-3] else mask.unsqueeze(-3)
        return attention(q.unflatten(-3, (heads, g)), k.unsqueeze(-3), v.unsqueeze(-3), mask).flatten(-4, -3)
    scores = {scores}{cap}
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
{tail}
'''

TAILS = {"exp": "    weights = torch.exp(scores - scores.amax(dim=-1, keepdim=True))\n"
                "    return (weights / weights.sum(dim=-1, keepdim=True)) @ v",
         "softmax": "    return torch.softmax(scores, dim=-1) @ v"}

RUN = {"attend": '''
def run(q, k, v, mask):
    return [attention(q, k, v, mask)]
''', "multihead": '''
def run(x_q, x_kv, W_Q, W_K, W_V, W_O, mask):  # the seed's multi-head module, {n_heads} heads
    def split(t):  # [T, D] -> [H, T, D / H]
        return t.view(t.shape[0], {n_heads}, -1).transpose(0, 1)
    heads = attention(split(x_q @ W_Q.T), split(x_kv @ W_K.T), split(x_kv @ W_V.T), mask)
    return [heads.transpose(0, 1).reshape(x_q.shape[0], -1) @ W_O.T]
''', "vjp": '''
def run(q, k, v, mask, grad_out):  # the output and the gradients of <out, grad_out> (dQ, dK, dV)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out = attention(*leaves, mask)
        return [out.detach(), *torch.autograd.grad((out * grad_out).sum(), leaves)]
'''}

TAIL = '''

def defect(got, want):  # NaN or inf where float64 is finite, or an error beyond what a correct {dtype} one shows
    for g, w, budget in zip(got, want, BUDGETS):
        g, ok = g.detach().double(), w.isfinite()
        diff = (g - w)[ok & g.isfinite()].abs()
        if (~g.isfinite() & ok).any() or (diff.numel() and diff.max().item() > budget):
            return True
    return False


def double(t):
    return t.double() if t is not None and t.is_floating_point() else t


inputs = ({names},)
want = [w.detach() for w in run(*map(double, inputs))]  # the same formula in float64
broken = defect(run(*inputs), want)
print("defect:", broken)
print("with contiguous copies:", defect(run(*(t if t is None else t.contiguous() for t in inputs)), want))
with torch.backends.mkldnn.flags(enabled=False):
    print("with oneDNN off:", defect(run(*inputs), want))
'''


def _literal(t: torch.Tensor, exact: bool, gen: torch.Generator) -> str:
    """Python for the values of ``t``: its own (``exact``), or seeded random ones of its spread."""
    dtype = f"torch.{str(t.dtype).removeprefix('torch.')}"
    shape = ", ".join(map(str, t.shape))
    to = "" if t.device.type == "cpu" else f".to({str(t.device)!r})"
    if exact or not t.is_floating_point():
        values = re.sub(r"\b(inf|nan)\b", r"math.\1", repr(t.detach().cpu().tolist()))
        return f"torch.tensor({values}, dtype={dtype}){to}"
    spread = t.detach().double().std().item() if t.numel() > 1 else 1.0
    spread = float(f"{spread:.3g}") if math.isfinite(spread) and spread > 0 else 1.0
    return f"(torch.randn({shape}, generator=gen) * {spread!r}).to({dtype}){to}"


def _code(kind: str, inputs: dict, form: str, scale: float, cap, n_heads, budgets, title: str, exact: bool) -> str:
    gen = torch.Generator().manual_seed(0)
    scores = f"(q * {scale!r}) @ k.transpose(-2, -1)" if form == "Q scaled first" else \
        f"q @ k.transpose(-2, -1) * {scale!r}"
    tail = TAILS["exp" if form == "Q scaled first" and cap is None else "softmax"]
    code = [f"# {title}\n# no attn-spec code: the inputs at the strides and storage offsets the target got", HEAD,
            ATTENTION.format(form=form, scores=scores, tail=tail,
                             cap=f"\n    scores = {cap!r} * torch.tanh(scores / {cap!r})" if cap is not None else ""),
            RUN[kind].format(n_heads=n_heads), "\ngen = torch.Generator().manual_seed(0)"]
    for name, t in inputs.items():
        code.append(f"{name} = None" if t is None else
                    f"{name} = laid_out({_literal(t, exact or t.numel() <= 64, gen)}, {tuple(t.shape)}, "
                    f"{tuple(t.stride())}, {t.storage_offset()})")
    dtype = str(next(t for t in inputs.values() if t is not None).dtype).removeprefix("torch.")
    code.append(f"BUDGETS = {[float(f'{b:.3g}') for b in budgets]!r}")
    code.append(TAIL.format(names=", ".join(inputs), dtype=dtype))
    return "\n".join(code)


def shows(code: str) -> bool:
    """Run the snippet here, its prints discarded: does it show the defect?"""
    namespace = {"__name__": "attn_spec_platform_snippet"}
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about TF32 on oneDNN whenever its flags are set
            exec(compile(code, "<platform snippet>", "exec"), namespace)  # noqa: S102 - the kit's own generated code
    except Exception:  # noqa: BLE001 - a snippet that cannot run shows nothing
        return False
    return namespace.get("broken") is True


def snippet(kind: str, inputs: dict, form: str, *, scale: float, cap, n_heads, budgets, title: str) -> str:
    """The standalone reproduction, checked here: random values first, the call's own values if those do not show it."""
    args = (kind, inputs, form, scale, cap, n_heads, budgets, title)
    code = _code(*args, exact=False)
    if shows(code):
        return code
    if all(t is None or t.numel() <= EXACT_LIMIT for t in inputs.values()):
        exact = _code(*args, exact=True)
        if shows(exact):
            return exact
    return code + "\n# (run here again, in a fresh run, this did not show the defect: it depends on what ran before)"
