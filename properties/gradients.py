"""Gradients: attention is trained, so its backward pass is part of the contract.

The reference gradients are the closed form of ``attn_spec.checking.grad_tolerance`` in float64; a
target's gradients come through ``target.vjp`` (tensors in, tensors out). An output that is not
differentiable at all fails the property for the conventions that are trained (function, module,
adapter), with how it left the graph; it is a skip for a target declared inference-only, and for
the library conventions sdpa and torch-mha (``Target.vjp``).
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import fail, with_mask
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.checking.grad_tolerance import NAMES, judged_backward
from attn_spec.checking.tolerance import all_finite, max_error
from attn_spec.properties.informative import require_responsive
from attn_spec.failures import because

FD_DIRECTIONS, FD_EPS, FD_ATOL, FD_RTOL = 3, 1e-6, 1e-5, 1e-3  # finite differences, as torch.autograd.gradcheck
def _vjp(mask, judged=None) -> str:
    """The backward call, as the user would write it: the mask named only where there is one; on a long case,
    which rows G is given on."""
    rows = "" if judged is None or judged.why is None else \
        f" (zero except on the {len(judged.why)} query rows judged exactly)"
    return f"the backward of attention(Q, K, V{with_mask(mask)}) with upstream gradient G{rows}"


@prop("gradients", family="gradients",
      statement="the output is differentiable in Q, K and V; gradients are finite and match the reference's "
                "(and, in float64, finite differences of its own forward); under a causal mask no gradient reaches future positions",
      cases={"batch": False}, after=("determinism", "inputs-unchanged", "causal-mask", "matches-reference"),
      at_scale={"masks": ("none", "causal")},
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, values="normal", seed=1),
                Case(n_q=3, n_kv=3, d_k=2, d_v=2, mask="causal", values="normal", seed=2),
                Case(batch=(2,), n_q=3, n_kv=5, d_k=3, d_v=2, dtype="float32", mask="random", seed=3)],
      lesson=Lesson(unicode="∂A/∂s = diag(a) − a aᵀ,   dV = Aᵀ G,   dS = A ⊙ (G Vᵀ − rowsum(A ⊙ G Vᵀ)),   dQ = dS K/√d_k",
                    latex=r"\frac{\partial a}{\partial s} = \mathrm{diag}(a) - a a^\top,\quad dV = A^\top G,\quad "
                          r"dS = A \odot (G V^\top - \mathrm{rowsum}(A \odot G V^\top)),\quad dQ = \frac{dS\,K}{\sqrt{d_k}}",
                    check="Asks the target for a vector-Jacobian product (target.vjp) with a random G and compares dQ, dK, "
                          "dV with the closed form; in float64 also with finite differences of its own forward along random "
                          "directions; no gradient may reach future keys under a causal mask.",
                    example="gradients"))
def gradients(target, case):
    """d<attn(Q, K, V), G>/dQ, dK, dV equal the closed form of the reference, within a calibrated budget.

    With A = softmax(S), S = Q K^T / sqrt(d_k): dV = A^T G, dS = A * (G V^T - rowsum(A * G V^T)),
    dQ = dS K / sqrt(d_k), dK = dS^T Q / sqrt(d_k). In float64 the target's backward is also
    compared with finite differences of its own forward (gradcheck's test). Under a
    causal mask, G on queries i < s only must leave dK and dV at keys j >= s exactly alone.
    Why: a wrong backward trains silently (the loss still falls), and a gradient that leaks
    from the future makes a decoder learn to peek. Catches: a custom autograd.Function with a
    wrong backward (softmax backward, missing scale), V (or Q, K) detached, NaN gradients from
    unmasked padding, a backward that recomputes the weights without the mask.
    On a long case G is zero except on the chosen rows (``grad_tolerance.judged_backward``): the
    reference is then exact at O(k n d), and dQ of every other row must be zero.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    judged = judged_backward(q, k, v, mask, _grad_out(case))
    grad_out = judged.upstream  # [..., Tq, Dv]
    expected, allowed = judged.reference_and_budgets()
    _, *grads = target.vjp(*case.tensors(), grad_out.clone())  # its own copies: it may write into them
    bad = [i for i, g in enumerate(grads) if not all_finite(g)]
    if bad:
        names = " and ".join(NAMES[i] for i in bad)
        fail("NaN or inf", what=names, expected="finite values, as the reference gradients are",
             call=_vjp(mask, judged),
             cause=because("backward-nan", names=names),
             got=grads[bad[0]], expected_tensor=expected[bad[0]],
             labels=(f"the target's {NAMES[bad[0]]}", f"{NAMES[bad[0]]} of the float64 reference"))
    if case.mask == "causal" and case.n_kv > 1:
        _no_gradient_from_the_future(target, case, grad_out, allowed)
    errors = [max_error(g, e) for g, e in zip(grads, expected)]
    wrong = [i for i in range(3) if errors[i] > allowed[i]]
    if wrong:
        i = wrong[0]
        fail(f"{' and '.join(NAMES[j] for j in wrong)} {'differ' if len(wrong) > 1 else 'differs'}; max error of "
             f"{NAMES[i]} {errors[i]:.3g}{_worst_row(judged, i, grads[i], expected[i])}",
             what="the gradients against the float64 reference", budget=allowed[i],
             call=_vjp(mask, judged),
             cause=because("gradients-differ", grads=grads, wrong=wrong, allowed=allowed, judged=judged, expected=expected),
             got=grads[i], expected_tensor=expected[i],
             labels=(f"the target's {NAMES[i]}", f"{NAMES[i]} of the float64 reference"))
    if case.dtype == "float64":
        _finite_differences(target, case, grad_out, grads)


def _worst_row(judged, i, got, expected) -> str:
    """On a long case, where dQ (i = 0) errs most: a chosen row and why, or a row whose G is zero."""
    if judged.why is None or i != 0:
        return ""
    diff = (got.detach().to("cpu", torch.float64) - expected.to("cpu")).abs().nan_to_num(math.inf)  # [..., Tq, Dk]
    row = int(diff.amax(dim=-1).reshape(-1, diff.shape[-2]).amax(dim=0).argmax())  # [Tq] -> the worst row
    why = judged.why.get(row)
    return f" at query row {row} ({f'chosen: {why}' if why else 'its G is zero, so its dQ must be'})"


def _grad_out(case):
    """A fixed upstream gradient G [..., Tq, Dv] from the case's seed, in the case's style and dtype
    (drawn on the case's device for a large case, as its inputs)."""
    device = case.device if case.large else "cpu"
    gen = torch.Generator(device=device).manual_seed(case.seed + 1)
    shape = (*case.batch, case.n_q, case.d_v)
    g = (torch.randint(-2, 3, shape, generator=gen, device=device).double() if case.values == "integers"
         else torch.randn(shape, generator=gen, dtype=torch.float64 if device == "cpu" else torch.float32,
                          device=device))
    return g.to(case.torch_dtype).to(case.device)


def _no_gradient_from_the_future(target, case, grad_out, allowed):
    """G nonzero on queries i < s only: keys j >= s are in their future, so dK, dV there are 0."""
    s = case.n_kv // 2
    early = grad_out.clone()
    early[..., s:, :] = 0  # [..., Tq, Dv]
    _, _, dk, dv = target.vjp(*case.tensors(), early)
    leak_k, leak_v = (t[..., s:, :].abs().max().item() for t in (dk, dv))
    if leak_k > allowed[1] or leak_v > allowed[2]:
        leaked = (dk if leak_k > allowed[1] else dv)[..., s:, :]  # the rows of the future keys
        fail(f"|dK| up to {leak_k:.3g} and |dV| up to {leak_v:.3g}", expected="0",
             what=f"the gradients of keys >= {s} (the future of queries < {s}) with a gradient on queries < {s} only",
             budget=allowed[1] if leak_k > allowed[1] else allowed[2],
             call=_vjp(case.mask) + " zero on queries >= " + str(s),  # a causal case: its mask
             cause=because("backward-ignores-causal-mask"),
             got=leaked, expected_tensor=torch.zeros_like(leaked),
             labels=(f"the target's {'dK' if leak_k > allowed[1] else 'dV'} at keys >= {s}", "zeros"))


def _finite_differences(target, case, grad_out, grads):
    """The target's backward against central differences of its own forward, along random directions.

    For a direction u in (Q, K, V): <G, (f(x + eps u) - f(x - eps u)) / (2 eps)> must equal
    <backward(G), u>. This is gradcheck's test (same eps and tolerances) at two forward calls per
    direction instead of two per input entry. float64 only: the truncation error is O(eps^2).
    """
    q, k, v, mask = case.tensors()
    gen = torch.Generator().manual_seed(case.seed + 2)
    for _ in range(FD_DIRECTIONS):
        u = [torch.randn(t.shape, generator=gen, dtype=torch.float64).to(t.device) for t in (q, k, v)]
        plus = target.attend(*(t + FD_EPS * d for t, d in zip((q, k, v), u)), mask)  # [..., Tq, Dv]
        minus = target.attend(*(t - FD_EPS * d for t, d in zip((q, k, v), u)), mask)  # [..., Tq, Dv]
        numeric = ((plus - minus) * grad_out).sum().item() / (2 * FD_EPS)
        analytic = sum((g * d).sum().item() for g, d in zip(grads, u))
        allowed = FD_ATOL + FD_RTOL * abs(analytic)
        if not abs(numeric - analytic) <= allowed:
            fail(f"<G, J u> = {numeric:.6g} from the forward, <J^T G, u> = {analytic:.6g} from the target's own "
                 f"backward", what="finite differences along a random direction u", expected="equal values",
                 budget=allowed, call=f"attention(Q ± eps u, K ± eps u, V ± eps u{with_mask(mask)}) and " + _vjp(mask),
                 cause=because("backward-not-derivative"))


@derivation("gradients")
def derive_gradients():
    """The Jacobian of a = softmax(s) is diag(a) - a a^T."""
    import sympy as sp

    from attn_spec.symbolic import agreement, canonical_scale, require, softmax_row

    s = sp.symbols("s1:4", real=True)
    a = softmax_row(s)  # [1, 3]
    J = a.jacobian(s)  # [3, 3]
    closed = sp.diag(*a) - a.T * a
    # The reference's weights as a function of the scores: K = I / scale makes scores = q exactly.
    d, point = 3, [sp.Rational(1, 2), sp.Rational(-1, 3), sp.Rational(3, 4)]
    K = float(1 / canonical_scale(d)) * torch.eye(d, dtype=torch.float64)  # [Tk=3, Dk=3]
    h, cols = 1e-6, []
    for j in range(d):
        e = torch.zeros(1, d, dtype=torch.float64)
        e[0, j] = h
        q = torch.tensor([[float(x) for x in point]], dtype=torch.float64)
        plus, minus = reference.attention(q + e, K, K)[1], reference.attention(q - e, K, K)[1]
        cols.append(((plus - minus) / (2 * h))[0])  # d a / d s_j
    fd = torch.stack(cols, dim=1)  # [3, 3]: J[i, j] = d a_i / d s_j
    err = agreement(closed.subs(dict(zip(s, point))), fd, "softmax Jacobian", tol=1e-8)
    require(sp.simplify(J - closed) == sp.zeros(3, 3), "d softmax / ds != diag(a) - a a^T")
    return [("a = softmax(s)", a),
            ("d a_i / d s_j, differentiated by sympy", sp.simplify(J)),
            ("J - (diag(a) - a a^T) simplifies to zero", sp.simplify(J - closed)),
            (f"finite differences of the kit's reference agree (max |difference| {float(err):.1g})",
             closed.subs(dict(zip(s, point))).evalf(6))]
