"""The symmetry family: permuting the queries, or the keys and values together, permutes the output.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import torch

from attn_spec import reference
from attn_spec.checking.assertions import assert_close, with_mask
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget, multihead_budget
from attn_spec.errors import Uninformative
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import cross_or_self
from attn_spec.failures import because


@prop("permutation-equivariance", family="symmetry",
      statement="permuting queries permutes outputs; permuting keys with values leaves them unchanged",
      cases={"min_n_kv": 2}, multihead="module",
      at_scale="a symmetry of the formula that does not depend on the length: checked at the drawn sizes",
      examples=[Case(n_q=3, n_kv=3, d_k=2, d_v=2, seed=1), Case(n_q=2, n_kv=4, d_k=2, d_v=3, mask="random", seed=2),
                MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2, seed=1)],
      lesson=Lesson(unicode="attn(P Q, K, V) = P attn(Q, K, V),   attn(Q, S K, S V) = attn(Q, K, V)",
                    latex=r"\mathrm{attn}(PQ, K, V) = P\,\mathrm{attn}(Q, K, V),\quad \mathrm{attn}(Q, SK, SV) = \mathrm{attn}(Q, K, V)",
                    check="Calls the target on permuted queries (and on keys and values permuted together) and compares "
                          "with the permuted (or unchanged) output of the original call.",
                    example="permutation"))
def permutation_equivariance(target, case):
    """attn(P Q, K, V) = P attn(Q, K, V) and attn(Q, S K, S V) = attn(Q, K, V) for permutations P, S.

    Why: attention is a set operation; order enters only through masks or positional
    encodings applied *outside* it. Catches: heads split or merged with view and no
    transpose (tokens mixed), a hard-coded causal mask, position-dependent terms, cumulative
    sums over the key axis. Modules are checked through their own multi-head forward.
    """
    require_responsive(target, case)
    gen = torch.Generator().manual_seed(case.seed)
    p, s = _shuffle(case.n_q, gen), _shuffle(case.n_kv, gen)
    moved = ("the output on permuted inputs", "the target's own output on the inputs as drawn, its rows permuted")
    if isinstance(case, MhaCase):
        case = cross_or_self(target, case)
        if case.n_q < 2 and (case.self_attention or case.n_kv < 2):
            raise Uninformative("one token: no permutation moves anything")
        x_q, x_kv, weights, mask = case.tensors()
        ref = reference.multihead(x_q, x_kv, *weights.values(), case.n_heads, mask)[0]
        allowed = 2 * multihead_budget(x_q, x_kv, weights, case.n_heads, mask, ref)
        if case.self_attention:  # one input: permuting it must permute the output rows
            out = target.multihead(x_q, x_q, weights, case.n_heads, mask)  # [T, D]
            x_p = x_q[p]
            got = target.multihead(x_p, x_p, weights, case.n_heads, None if mask is None else mask[p][:, p])
            assert_close(got, out[p], budget=allowed,
                         what=f"the output for the tokens permuted by {p.tolist()} against the permuted output rows",
                         call="forward(x[p], x[p])", labels=moved,
                         cause=because("depends-on-token-positions"))
            return

        def run(queries, keys, m):  # the keys' rows carry the values too
            return target.multihead(queries, keys, weights, case.n_heads, m)
        queries, keys = x_q, x_kv
        name, kv, kv_permuted = "forward", "x_kv", "x_kv[s]"
        where = "heads split or merged without transpose? a hard-coded mask?"
    else:
        q, k, v, mask = case.tensors()
        allowed = 2 * budget(q, k, v, mask, reference.attention(q, k, v, mask)[0])

        def run(queries, keys, m):
            return target.attend(queries, keys[0], keys[1], m)
        queries, keys = q, (k, v)
        name, kv, kv_permuted = "attention", "K, V", "K[s], V[s]"
        where = "a hard-coded mask? a position-dependent term?"
    out = run(queries, keys, mask)  # [..., Tq, Dv]
    if case.n_q > 1:  # one query has no other order
        got = run(queries[..., p, :], keys, mask if mask is None or mask.shape[-2] == 1 else mask[..., p, :])  # key
        # padding [..., 1, Tk]: the same for every query
        assert_close(got, out[..., p, :], budget=allowed,
                     what=f"the output for the queries permuted by {p.tolist()} against the permuted output rows",
                     call=f"{name}(Q[p], {kv}{with_mask(mask)})", labels=moved, cause=because("depends-on-query-positions", where=where))
    shuffled = keys[..., s, :] if isinstance(keys, torch.Tensor) else tuple(t[..., s, :] for t in keys)
    got = run(queries, shuffled, None if mask is None else mask[..., :, s])
    assert_close(got, out, budget=allowed,
                 what=f"the output for keys and values permuted together by {s.tolist()} against the output",
                 call=f"{name}(Q, {kv_permuted}{with_mask(mask, 'mask[:, s]')})",
                 labels=("the output on permuted keys and values", "the target's own output on them as drawn"),
                 cause=because("depends-on-key-positions"))


def _shuffle(n: int, gen) -> torch.Tensor:
    """A random permutation of n items that moves something (never the identity when n > 1)."""
    p = torch.randperm(n, generator=gen)
    return p.roll(1) if n > 1 and torch.equal(p, torch.arange(n)) else p
