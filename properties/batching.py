"""The batching family: what each batch element may see, and masks that broadcast over the batch.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import itertools
import math

from attn_spec import reference
from attn_spec.checking.assertions import assert_close, with_mask
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget
from attn_spec.errors import TargetRaised, Uninformative
from attn_spec.targets.conventions import FUNCTION_CONVENTIONS
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import push_limit
from attn_spec.failures import because, worded


def _flat_batch(t, batch):
    return t.expand(*batch, *t.shape[-2:]).reshape(-1, *t.shape[-2:])  # [B, T, D]


@prop("batch-independence", family="batching",
      statement="each element of the leading batch/head dims is computed on its own: the batched output "
                "equals the per-example outputs, and broadcast (stride-0) K/V or masks work",
      conventions=FUNCTION_CONVENTIONS, cases={"batch": True}, after=("rows-sum-to-one",),
      at_scale="it recomputes every batch element alone; checked at the drawn sizes",
      examples=[Case(batch=(2,), n_q=2, n_kv=3, d_k=2, d_v=2, seed=5),
                Case(batch=(2, 2), n_q=2, n_kv=2, d_k=2, d_v=1, mask="random", seed=6)],
      lesson=Lesson(unicode="out[b] = attn(Q[b], K[b], V[b], mask[b])   for every batch index b",
                    latex=r"\mathrm{out}[b] = \mathrm{attn}(Q[b], K[b], V[b], \mathrm{mask}[b])\quad \forall b",
                    check="Runs each batch element alone and compares with its slice of the batched output; makes element 0 "
                          "huge and checks the others do not move; broadcasts K/V/mask with expand.",
                    example="batch"))
def batch_independence(target, case):
    """out[b] = attn(Q[b], K[b], V[b], mask[b]) for every index b of the leading dims.

    Three checks: each element computed alone equals its slice of the batched output; giving
    element 0 huge scores leaves every other element's output unchanged; K, V and the mask
    broadcast along the last batch dim with ``expand`` (stride 0, as in multi-query
    attention) give what their contiguous copies give. (Multi-head modules take 2-D inputs,
    so this applies to the function conventions only.)

    Why: batch and head dims are independent sequences; a leak between them trains on
    other examples' data and breaks as soon as batch composition changes. Catches: batch
    and sequence dims interleaved by a reshape (batch-first read as sequence-first), a max
    or sum over the whole tensor (x.max() without dim), ``.view`` on broadcast K/V.
    """
    require_responsive(target, case)
    if math.prod(case.batch) < 2:
        raise Uninformative("a single batch element: nothing to be independent of")
    q, k, v, mask = case.tensors()
    out = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    allowed = 2 * budget(q, k, v, mask, reference.attention(q, k, v, mask)[0])
    for index in itertools.product(*map(range, case.batch)):
        alone = target.attend(q[index], k[index], v[index], mask if mask is None or mask.dim() == 2 else mask[index])
        assert_close(out[index], alone, budget=allowed, labels=(
                     f"element {list(index)} of attention(Q, K, V{with_mask(mask)})",
                     f"attention(Q{list(index)}, K{list(index)}, V{list(index)}{with_mask(mask)}), the target's "
                     f"own output on that element alone"),
                     inputs={"Q": q[index], "K": k[index], "V": v[index],
                             "mask": mask if mask is None or mask.dim() == 2 else mask[index]},
                     what=f"batch element {list(index)} of the batched output against the element computed alone",
                     call=f"attention(Q[{', '.join(map(str, index))}], ...{with_mask(mask)})",
                     cause=because("batch-mixed"))
    _check_no_leak(target, case, q, k, v, mask, out, allowed)
    _check_broadcast(target, q, k, v, mask)


def _check_no_leak(target, case, q, k, v, mask, out, allowed):
    """Huge scores in batch element 0 must not change any other element."""
    n = math.prod(case.batch)
    if n < 2:
        return
    first = (0,) * len(case.batch)
    q0, k0 = q[first].double(), k[first].double()  # [Tq, Dk], [Tk, Dk]
    peak = max((q0.abs().sum(dim=-1).max() * k0.abs().max()).item(), q0.abs().max().item())  # bounds |q . k| and |q|
    gain = push_limit(q.dtype) / max(peak, 1.0)
    loud = q.clone()
    loud[first] = (q0 * gain).to(q.dtype)
    got = _flat_batch(target.attend(loud, k, v, mask), case.batch)[1:]  # [B - 1, Tq, Dv]
    before = _flat_batch(out, case.batch)[1:]
    assert_close(got, before, budget=allowed, call=f"attention(Q', K, V{with_mask(mask)}), Q' = Q with element 0 scaled",
                 labels=("the other elements' outputs after the scaling", "the target's own outputs before it"),
                 what=f"the outputs of the other batch elements after scaling the queries of element 0 by {gain:.3g}",
                 cause=because("batch-reduction", got=got))


def _check_broadcast(target, q, k, v, mask):
    """K, V and mask expanded (stride 0) along the last batch dim == their contiguous copies."""
    batch = q.shape[:-2]

    def shared(t):  # one slice shared along the last batch dim, as multi-query attention shares K/V
        t = t.expand(*batch, *t.shape[-2:])
        return t[..., :1, :, :].expand(t.shape)

    k_b, v_b = shared(k), shared(v)
    m_b = None if mask is None else shared(mask)
    expected = target.attend(q, k_b.contiguous(), v_b.contiguous(), None if m_b is None else m_b.contiguous())
    try:
        got = target.attend(q, k_b, v_b, m_b)
    except TargetRaised as exc:
        exc.cause = worded(because("broadcast-rejected"))
        raise
    allowed = 2 * budget(q, k_b, v_b, m_b, reference.attention(q, k_b, v_b, m_b)[0])
    assert_close(got, expected, budget=allowed, call="attention(Q, K.expand(...), V.expand(...), mask.expand(...))",
                 labels=("the output on the expanded K, V and mask", "the target's own output on contiguous copies"),
                 what="the output with K, V and mask expanded with stride 0 against their contiguous copies",
                 cause=because("broadcast-read-contiguous"))
