"""Dropout on the attention weights (``dropout_p``, the sdpa convention): read out, then averaged.

Dropout is random, so these properties do not compare one output with a reference. They read the
dropped weights out exactly, with q = k = 0 (every allowed key gets weight 1/n) and V = [I | I] (the
output row is the weight row, twice), and they average outputs over seeds. A target whose dropout_p
changes nothing lacks the ``dropout`` capability (an inference kernel's signature): a skip that says so,
a failure under ``--require dropout``.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget
from attn_spec.errors import Unsupported
from attn_spec.failures import because
from attn_spec.targets.capabilities import supports

F64 = torch.float64
RATES = (0.1, 0.25, 0.5)
N = 48  # queries and keys of the readout: 2 x 2 x 48 x 48 = 9216 weights, 4608 under the causal mask
Z = 7.0  # standard deviations a correct kernel's kept count may stray (a chance below 1e-11)


def inputs(dtype, device):
    """q = k = 0 [2, 2, N, 4] and V = [I | I] [2, 2, N, 2N]."""
    q = torch.zeros(2, 2, N, 4, dtype=dtype, device=device)
    v = torch.cat([torch.eye(N), torch.eye(N)], dim=-1).to(dtype=dtype, device=device).expand(2, 2, N, 2 * N)
    return q, q.clone(), v


def seeded(target, seed: int, *args, **kwargs):
    """One call with torch's generators seeded, the caller's random stream left as it was."""
    with torch.random.fork_rng(devices=[] if args[0].device.type == "cpu" else None):
        torch.manual_seed(seed)
        return target.attend(*args, **kwargs)


def dropped(target, p: float, seed: int, *, causal=False, dtype=torch.float32, device="cpu"):
    """(the dropped weights [B, H, N, 2N] in float64, how causality was asked: "", "causal mask" or
    "is_causal=True") of one readout call at dropout ``p`` after ``torch.manual_seed(seed)``. Causal through a
    mask where the target takes a causal one, else is_causal; None for a kernel that takes neither."""
    how, asked = "", {}
    if causal and "causal" in supports(target, device=device).masks:
        how, asked = "causal mask", {"mask": reference.causal_mask(N, N, device=device)}
    elif causal:
        how, asked = "is_causal=True", {"is_causal": True}
    try:
        out = seeded(target, seed, *inputs(dtype, device), dropout=p, **asked)  # [B, H, N, 2N]
    except Unsupported:
        if "is_causal" not in asked:
            raise
        return None  # neither a mask nor is_causal
    return out.detach().to("cpu", F64), how


def _rate(case) -> float:
    return RATES[case.seed % len(RATES)]


def _require_dropout(target, case) -> None:
    found = supports(target, device=case.device)
    if not found.dropout:
        raise Unsupported(found.why.get("dropout", f"{target.name} takes no dropout argument"), total=True)


def readout(target, case, causal: bool, seed=None):
    """(dropped weights [B, H, N, 2N] in float64, how causality was asked) with q = k = 0, so every allowed key has
    weight 1/n_i, and V = [I | I], so output columns j and N + j both read weight j: the case's dtype, device, rate
    and seed (or ``seed``), read as the diagnosis reads it (:func:`dropped`); None for a causal readout of
    a kernel that takes neither a mask nor is_causal."""
    return dropped(target, _rate(case), case.seed if seed is None else seed, causal=causal, dtype=case.torch_dtype,
                   device=case.device)


@prop("dropout-mask", family="dropout",
      statement="with dropout_p = p each allowed weight is dropped with probability p and the rest scaled by "
                "1/(1 - p); masked keys get no weight",
      cases={"masks": ("none",)}, examples=[Case(dtype="float32", seed=0), Case(dtype="float32", seed=1)],
      at_scale="the readout has its own fixed size: checked at the drawn sizes",
      lesson=Lesson(unicode="dropout(P)ᵢⱼ = mᵢⱼ Pᵢⱼ / (1 - p),  mᵢⱼ ~ Bernoulli(1 - p)",
                    latex=r"\mathrm{dropout}(P)_{ij} = \frac{m_{ij} P_{ij}}{1-p},\ m_{ij} \sim \mathrm{Bernoulli}(1-p)",
                    check="Reads the dropped weights out with q = k = 0 and V = [I | I], without a mask and under "
                          "a causal one, and checks each value, the kept fraction (within 7 standard deviations) "
                          "and that the two copies of each weight agree.",
                    example="dropout"))
def dropout_mask(target, case):
    """dropout(P)_ij = m_ij P_ij / (1 - p) with m_ij ~ Bernoulli(1 - p) independent, and m_ij = 0 where j is masked.

    With q = k = 0 every allowed key of row i has weight 1/n_i, so each output weight is 0 or 1/(n_i (1 - p)),
    and V = [I | I] shows it twice: columns j and n + j come from the same weight. Why: dropout that keeps the
    wrong fraction or scales the kept weights wrongly changes the expected activation, so training and
    inference disagree (a keep fraction of 0.977 instead of 0.90 was a real kernel bug). Catches: kept weights
    not rescaled, rescaled by 1/p, weights renormalised after dropout, the keep test inverted (keeps p), weight
    on causally masked keys (dropout after the mask was applied as a multiply), dropout applied to the output
    instead of the weights, the same mask for every seed.
    """
    _require_dropout(target, case)
    for causal in (False, True):
        read = readout(target, case, causal)
        if read is None:  # neither a mask nor is_causal: the unmasked readout is all there is
            continue
        got, how = read  # [B, H, N, 2N]
        p, given = _rate(case), inputs(case.torch_dtype, case.device)
        allowed = reference.causal_mask(N, N) if causal else torch.ones(N, N, dtype=torch.bool)  # [N, N]
        call = f"{target.name}(q=0, k=0, V=[I | I], {how + ', ' if how else ''}dropout_p={p}) after " \
               f"torch.manual_seed({case.seed})"
        shown = {"labels": (f"weights [0, 0, :4, :6] read out of the call (row i, key j)", ""),
                 "summary": f"the readout: q = k = 0 {list(given[0].shape)}, V = [I | I] {list(given[2].shape)}, "
                            f"{case.dtype}, {case.device}"}
        first, second = got[..., :N], got[..., N:]  # [B, H, N, N] each
        if not torch.isfinite(got).all():
            fail("non-finite weights", what="the dropped weights", expected="finite", call=call, got=got[0, 0, :4, :8],
                 **shown)
        if not causal and torch.equal(got, readout(target, case, causal, seed=case.seed + 1)[0]):
            fail("the same weights", what=f"the readout after torch.manual_seed({case.seed}) and ({case.seed + 1})",
                 expected="different dropout masks", call=call, got=first[0, 0, :4, :6], **shown,
                 cause=because("dropout-readout", target=target))
        if not torch.equal(first, second):
            fail("two copies of one weight differ", what="output columns j and N + j (both read weight j)",
                 expected="equal: dropout drops weights, each feeding every output column",
                 call=call, got=first[0, 0, :3, :6], expected_tensor=second[0, 0, :3, :6],
                 labels=("columns 0..5 (weights 0..5)", f"columns {N}..{N + 5} (the same weights)"),
                 summary=shown["summary"],
                 cause=because("dropout-readout", target=target))
        if (first[..., ~allowed] != 0).any():
            fail("weight on masked keys", what="the dropped weights above the causal diagonal", expected="0",
                 call=call, got=first[0, 0, :4, :6], **shown,
                 cause=because("dropout-readout", target=target))
        expected = 1.0 / (allowed.sum(-1, keepdim=True).to(F64) * (1 - p))  # [N, 1]
        kept = first != 0  # [B, H, N, N]
        eps = torch.finfo(case.torch_dtype).eps
        wrong = kept & ((first - expected).abs() > 4 * eps * expected)
        if wrong.any():
            fail(f"{first[wrong][0].item():.6g} where weights may only be 0 or 1/(n_i (1 - p))", what="a kept weight",
                 expected=f"{expected[wrong.nonzero()[0, 2]].item():.6g} (row {wrong.nonzero()[0, 2].item()}: "
                          f"1/({int(allowed[wrong.nonzero()[0, 2]].sum())} x {1 - p:g}))",
                 call=call, got=first[0, 0, :4, :6], **shown, cause=because("dropout-readout", target=target))
        trials = int(allowed.sum()) * first.shape[0] * first.shape[1]
        fraction, spread = kept.sum().item() / trials, Z * math.sqrt(p * (1 - p) / trials)
        if abs(fraction - (1 - p)) > spread:
            fail(f"kept fraction {fraction:.4f}", what=f"the fraction of the {trials} allowed weights kept",
                 expected=f"1 - p = {1 - p:g} within {spread:.4f} ({Z:g} standard deviations)", call=call, **shown,
                 cause=because("dropout-readout", target=target))


@prop("dropout-mean", family="dropout",
      statement="with dropout_p = p the output is unbiased (its mean over draws is attention without dropout) "
                "and a seed fixes it bitwise",
      cases={"masks": ("none",)}, after=("dropout-mask", "matches-reference"),
      examples=[Case(n_q=3, n_kv=4, d_k=2, d_v=2, dtype="float32", values="normal", seed=2)],
      at_scale="averaging over seeds does not depend on the length: checked at the drawn sizes",
      lesson=Lesson(unicode="E[attn(Q, K, V, dropout_p = p)] = attn(Q, K, V);  same seed ⇒ same output",
                    latex=r"\mathbb{E}[\mathrm{attn}(Q,K,V,p)] = \mathrm{attn}(Q,K,V)",
                    check="Calls the target twice with the same seed (bitwise equal), then averages 512 draws "
                          "(copies along a batch dim, dropped independently) and compares with the float64 reference "
                          "within 7 standard deviations of the mean plus the dtype's budget.",
                    example="dropout"))
def dropout_mean(target, case):
    """E_m[dropout attention] = softmax(Q K^T / sqrt(d_k)) V, and the same seed gives the same output, bitwise.

    Each weight is kept with probability 1 - p and scaled by 1/(1 - p), so its mean is the weight itself and the
    mean output is the output without dropout; its variance is sum_j P_ij^2 V_j^2 p / (1 - p), so the mean of R
    independent draws (R copies of the inputs along a batch dim) lies within Z sqrt(variance / R). Why: training
    runs are reproduced from a seed, and a biased dropout
    trains a model whose activations shrink or grow at inference. Catches: a mask the seed does not fix (another
    generator), a bias (renormalising after the drop), dropout on the scores.
    """
    _require_dropout(target, case)
    q, k, v, mask = case.tensors()
    p, runs = _rate(case), 512
    call = f"{target.name}(q, k, v{', mask' if mask is not None else ''}, dropout_p={p})"
    first, again = (seeded(target, case.seed, q, k, v, mask, dropout=p) for _ in range(2))
    if not torch.equal(first, again):
        fail("two different outputs", what="two calls after torch.manual_seed with the same seed",
             expected="bitwise equal", call=call, got=first, expected_tensor=again,
             labels=("the first call", "the second call, after the same torch.manual_seed"),
             cause=because("dropout-readout", target=target))
    copies = [t.expand(runs, *t.shape) for t in (q, k, v)]  # [R, ..., T, D]: R independent draws in one call
    mean = seeded(target, case.seed + 1, *copies, mask, dropout=p).to("cpu", F64).mean(dim=0)  # [..., Tq, Dv]
    exact, weights = reference.attention(q, k, v, mask)  # [..., Tq, Dv], [..., Tq, Tk]
    exact, weights, values = exact.to("cpu", F64), weights.to("cpu", F64).nan_to_num(), v.to("cpu", F64)
    variance = (weights ** 2) @ (values ** 2) * p / (1 - p)  # [..., Tq, Dv]
    allowed = Z * (variance / runs).sqrt() + budget(q, k, v, mask, exact)  # [..., Tq, Dv]: chance + the dtype's rounding
    error = (mean - exact).abs().nan_to_num(nan=math.inf)
    if (error > allowed).any():
        at = (error - allowed).argmax()
        fail(f"mean error {error.flatten()[at]:.4g}", what=f"the mean output of {runs} draws against the float64 "
             "output without dropout", expected=f"within {allowed.flatten()[at]:.4g}", call=call, got=mean,
             expected_tensor=exact, labels=(f"the mean of {runs} outputs", "the float64 output without dropout"),
             cause=because("dropout-biased", target=target))
