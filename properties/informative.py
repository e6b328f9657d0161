"""When a check is informative: an output that ignores its inputs satisfies every relation trivially.

An "attention" that returns zeros permutes like attention, ignores masked keys, is deterministic
and keeps the inputs' dtype: every metamorphic property would pass on it. So every property but
the root (``matches-reference``, which compares with the reference itself) first asks
:func:`require_responsive`: does the target's output depend on Q, K and V (x, for a multi-head
module's own forward) as attention's does? If not, the property fails as *vacuous*, and the
report shows it blocked by the root, whose failure names what the output is. Each property also
draws or builds only cases on which its relation bites (a permutation that is not the identity, a
mask that masks a key, two batch elements) and calls the others :class:`~attn_spec.errors.Uninformative`,
which makes the runner draw another case.

The probe is the same for every property: small square inputs (so that an output that is V or Q
has the right shape; under a causal mask for a target that declines calls without one, such as
nanoGPT's causal module), once as they are, once again, and once with each of Q, K, V replaced by a
fresh draw, on the case's device, in its dtype (float32 for float16 and bfloat16 cases when the
target takes it: their budgets are too wide for the probe to tell). A correct attention's output
moves as the reference's does, by far more than the budget; an output that moves by no more than
the budget ignores that input. An output that varies from call to call (dropout left on, random
numbers) is judged by its mean over several calls, within six standard errors. The verdict is kept per
target, kind of call, dtype probed and device: the probe runs once (five calls for a deterministic target),
every case of a run gets the same answer, and the float32, float16 and bfloat16 cases share one probe.
"""
from __future__ import annotations

import weakref

import torch

from attn_spec import reference
from attn_spec.checking.assertions import fail
from attn_spec.checking.cases import MhaCase
from attn_spec.checking.tolerance import budget, max_error, multihead_budget
from attn_spec.errors import Failure, Unsupported
from attn_spec.failures import because

SIZE = 4  # the probe's lengths and widths
TRIVIALLY = ", so this property would hold only trivially"
NOISY_CALLS = 32  # calls averaged per input for a target whose output varies from call to call
SEED = 20261130
CANNOT = "cannot probe"  # a probe the target declined or failed in that dtype: the next dtype is tried
_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> {(multihead, dtype, device): failure}


def require_responsive(target, case) -> None:
    """Fail, as vacuous, if the target's output ignores Q, K or V (x for a multi-head module's forward)."""
    verdict = _verdict_for(target, case)
    if verdict is not None:
        fail(**verdict, vacuous=True)


def ignored_inputs(target, case) -> str:
    """The sentence saying which inputs the target's output ignores, or '' if it responds to them all."""
    try:
        require_responsive(target, case)
    except Failure as failure:
        return failure.cause.removesuffix(TRIVIALLY)
    return ""


def _draws(case, seed, *shapes):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64).to(case.device, case.torch_dtype)
            for shape in shapes]


def _verdict_for(target, case) -> dict | None:
    """The keywords of the vacuous failure if the output ignores an input; None if it responds to all.

    Probed in float32 for a float16 or bfloat16 case, else in the case's dtype, falling back to the case's
    own where the target declines float32; each probe's verdict is kept per target, kind of call, dtype and
    device, so the cases of every dtype that probe in float32 share one probe."""
    verdicts = _VERDICTS.setdefault(target, {})
    multihead = isinstance(case, MhaCase)
    for dtype in dict.fromkeys(("float32" if case.dtype in ("float16", "bfloat16") else case.dtype, case.dtype)):
        key = (multihead, dtype, case.device)
        if key not in verdicts:
            verdicts[key] = _probe(target, case.replace(dtype=dtype))
        if verdicts[key] is not CANNOT:
            return verdicts[key]
    return None  # the probe cannot tell: the property's own checks judge the target


def _probe(target, case):
    """The keywords of the vacuous failure, None if the output responds to every input, or CANNOT: the target
    does not handle the probe's inputs in this dtype."""
    try:
        return (_probe_module if isinstance(case, MhaCase) else _probe_function)(target, case)
    except (Unsupported, Failure):
        return CANNOT


def _varies(first, again) -> bool:
    """Two calls on the same inputs give different outputs (dropout, random numbers); NaN matches NaN."""
    a, b = first.detach().cpu(), again.detach().cpu()
    if a.shape != b.shape or a.dtype != b.dtype:
        return True
    return not (torch.equal(a, b) or a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))


def _sampled(run, noisy: bool, first=None):
    """(mean, standard error of the mean) of run()'s output, in float64 on the CPU, entry by entry:
    over NOISY_CALLS calls when its output varies from call to call, else one call (``first``, the output of a
    call already made, if given) and 0."""
    if not noisy and first is not None:
        out = first.detach().to("cpu", torch.float64)
        return out, torch.zeros_like(out)
    outs = torch.stack([run().detach().to("cpu", torch.float64) for _ in range(NOISY_CALLS if noisy else 1)])
    return outs.mean(dim=0), (outs.std(dim=0) / NOISY_CALLS ** 0.5 if noisy else torch.zeros_like(outs[0]))


def _mask(target, case):
    """None, or the causal mask [SIZE, SIZE] for a target whose probed capabilities (a check probes them
    first) say it declines calls without a mask. Never probes them itself: this may run during a replay."""
    takes = target.supported
    return None if takes is None or "none" in takes.masks else reference.causal_mask(SIZE, SIZE, device=case.device)


def _probe_function(target, case) -> dict | None:
    q, k, v, *fresh = _draws(case, SEED, *[(SIZE, SIZE)] * 6)  # [T, D] each
    v, fresh[2] = 8 * v, 8 * fresh[2]  # values far apart: replacing V moves the output far beyond any noise
    mask = _mask(target, case)  # None, or [T, T] causal
    first = target.attend(q, k, v, mask)
    noisy = _varies(first, target.attend(q, k, v, mask))
    base, ref = _sampled(lambda: target.attend(q, k, v, mask), noisy, first), reference.attention(q, k, v, mask)[0]
    changes = []
    for i, name in enumerate("QKV"):
        args = [q, k, v]
        args[i] = fresh[i]
        moved, ref_moved = _sampled(lambda: target.attend(*args, mask), noisy), reference.attention(*args, mask)[0]
        allowed = max(budget(q, k, v, mask, ref), budget(*args, mask, ref_moved))
        changes.append((name, moved, base, ref_moved, ref, allowed))
    return _verdict(changes, noisy, "attention(Q, K, V)" if mask is None else "attention(Q, K, V, causal mask)")


def _probe_module(target, case) -> dict | None:
    weights = case.tensors()[2]
    x, fresh = _draws(case, SEED, (SIZE, case.d_model), (SIZE, case.d_model))  # [T, D]
    h, w, mask = case.n_heads, list(weights.values()), _mask(target, case)  # mask: None, or [T, T] causal

    def run(inputs):
        return lambda: target.multihead(inputs, inputs, weights, h, mask)
    first = run(x)()
    noisy = _varies(first, run(x)())
    base, moved = _sampled(run(x), noisy, first), _sampled(run(fresh), noisy)
    ref, ref_moved = reference.multihead(x, x, *w, h, mask)[0], reference.multihead(fresh, fresh, *w, h, mask)[0]
    allowed = max(multihead_budget(x, x, weights, h, mask, ref), multihead_budget(fresh, fresh, weights, h, mask,
                                                                                   ref_moved))
    return _verdict([("x", moved, base, ref_moved, ref, allowed)], noisy,
                    "forward(x, x)" if mask is None else "forward(x, x, causal mask)")


def _verdict(changes, noisy: bool, call: str) -> dict | None:
    """changes: (input, (mean, s.e.) of the output with it replaced, the same as it is, the reference's two, budget).

    Entry by entry, where the reference moves by more than 4 (budget + 6 s.e.), a correct attention
    moves by more than budget + 6 s.e.; an input is ignored if the output moves by no more than that
    on every such entry (and there is one); an entry that stays NaN, or the same inf, has not moved (an output
    of NaN whatever the inputs ignores them as a constant does). A deterministic target has s.e. 0: its output is compared
    as it is; a noisy one through its mean, which follows the inputs for dropout, not for random numbers."""
    ignored = []
    for name, (moved, se_moved), (base, se_base), ref_moved, ref, allowed in changes:
        slack = allowed + 6 * (se_moved.square() + se_base.square()).sqrt()  # [T, D]
        telling = (ref_moved - ref).abs() > 4 * slack  # entries where a correct attention must move
        still = ((moved - base).abs() <= slack) | (moved == base) | (moved.isnan() & base.isnan())  # NaN stays NaN
        if telling.any() and bool(still[telling].all()):
            ignored.append((name, moved, base, ref_moved, ref, slack[telling].max().item()))
    if not ignored:
        return None
    names = " and ".join(c[0] for c in ignored)
    name, moved, base, ref_moved, ref, slack = ignored[0]
    return dict(measured=f"moved by {max_error(moved, base):.3g} when {name} was replaced by a fresh draw",
                what="the output" + (f" (mean of {NOISY_CALLS} calls)" if noisy else ""),
                expected=f"a move like the reference's, {max_error(ref_moved, ref):.3g}", budget=slack,
                call=f"{call}, then with {name} replaced", cause=because("ignores-inputs", names=names, noisy=noisy), got=moved, expected_tensor=ref_moved,
                labels=(f"the output with {name} replaced by a fresh draw",
                        f"the float64 reference with {name} replaced"))
