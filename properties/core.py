"""The seed's properties: what every attention must satisfy, checked on a black box.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import probes
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.catalog import prop
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.diagnose import diagnose_mismatch
from attn_spec.targets.conventions import MULTIHEAD_CONVENTIONS
from attn_spec.errors import Failure, Unsupported
from attn_spec.checking.tolerance import budget, max_error, multihead_budget


def _ones_like_values(k):
    return torch.ones(*k.shape[:-1], 1, dtype=k.dtype, device=k.device)  # [..., Tk, 1]


@prop("rows-sum-to-one", family="softmax",
      statement="every row of weights is a distribution over the keys: non-negative, sums to 1",
      examples=[Case(n_q=3, n_kv=2, d_k=2, d_v=2), Case(n_q=1, n_kv=1, d_k=1, d_v=1)])
def rows_sum_to_one(target, case):
    """sum_j A[i, j] = 1 and A[i, j] >= 0 for every query i, where A = softmax(scale * Q K^T).

    Why: each output row is then a weighted *average* of value rows, so outputs stay on the
    scale of V however many keys there are. Catches: softmax over the query axis (dim=-2),
    exp without normalising, normalising by the wrong sum, a missing softmax.
    """
    q, k, _, mask = case.tensors()
    ones = _ones_like_values(k)
    sums = probes.row_sums(target, q, k, mask)  # [..., Tq]
    allowed = budget(q, k, ones, mask, torch.ones(*sums.shape, 1, dtype=torch.float64))
    w = probes.weights(target, q, k, mask)  # [..., Tq, Tk]
    if max_error(sums, torch.ones(sums.shape, dtype=torch.float64)) > allowed:
        col_sums = w.double().sum(dim=-2)  # [..., Tk]
        cause = ("weights sum over queries, not keys (softmax over dim -2?)"
                 if case.n_q > 1 and max_error(col_sums, torch.ones_like(col_sums)) <= allowed * case.n_q
                 else "the weights are not normalised by the sum over keys")
        fail(_fmt(sums), what="the row sums of the weights", expected="1", budget=allowed,
             call="attention(Q, K, V=ones)", cause=cause, got=w, expected_tensor=reference.attention(q, k, k, mask)[1])
    if w.double().min().item() < -allowed:
        fail(f"{w.double().min().item():.3g}", what="the smallest weight", expected="a weight >= 0", budget=allowed,
             call="attention(Q, K, V=identity)", cause="weights are not a softmax (no exp?)", got=w,
             expected_tensor=reference.attention(q, k, k, mask)[1])


@prop("causal-mask", family="masking",
      statement="under a causal mask, weights above the diagonal are 0 and output i ignores keys and values after i",
      cases={"masks": ("causal",), "min_n_kv": 2},
      examples=[Case(n_q=3, n_kv=3, d_k=2, d_v=2, mask="causal"), Case(n_q=2, n_kv=4, d_k=1, d_v=1, mask="causal")])
def causal_mask(target, case):
    """A[i, j] = 0 for j > i, the rest is softmax over j <= i; out[i] depends only on K, V[:i+1].

    Why: a decoder trained with a leak from the future learns to copy the next token and is
    useless at generation time. Catches: the mask ignored, inverted (True taken as 'ignore'),
    off by one (triu diagonal=0 masks the current token; row 0 then has no key), a mask
    applied after the softmax.
    """
    q, k, v, mask = case.tensors()
    w = probes.weights(target, q, k, mask).double().cpu()  # [..., Tq, Tk]
    ref_w = reference.attention(q, k, v, mask)[1]  # [..., Tq, Tk]
    future = ~reference.causal_mask(case.n_q, case.n_kv)  # [Tq, Tk]
    leak = w.masked_fill(~future, 0.0).abs()
    if leak.max().item() > 0:
        diag = torch.diagonal(w, dim1=-2, dim2=-1)
        cause = ("the mask is applied with inverted polarity (True taken as 'ignore')"
                 if w.masked_fill(future, 0.0).abs().max() < 1e-3
                 else "the causal mask is shifted by one (the diagonal is masked)" if diag.abs().max() < 1e-3
                 else "the mask is ignored or applied after the softmax")
        fail(f"{leak.max().item():.3g}: queries see future keys", what="the largest weight above the diagonal",
             expected="0", call="attention(Q, K, V=identity, causal mask)", cause=cause, got=w, expected_tensor=ref_w)
    dropped = (ref_w > 1e-3) & (w == 0)  # an allowed key the target never looks at
    if dropped.any():
        i, j = [int(x) for x in dropped.nonzero()[0][-2:]]
        fail("0, but j <= i is allowed", what=f"the weight of query {i} on key {j}",
             expected=f"the reference weight {ref_w[..., i, j].flatten()[0].item():.3g}",
             call="attention(Q, K, V=identity, causal mask)",
             cause="the causal mask is off by one (triu with diagonal=0 masks the current token?)",
             got=w, expected_tensor=ref_w)
    split = case.n_kv // 2  # keys and values from here on are the future of the first `split` queries
    k2, v2 = k.clone(), v.clone()
    k2[..., split:, :] = -k2[..., split:, :] * 3 + 1
    v2[..., split:, :] = v2[..., split:, :] * 5 - 2
    rows = min(split, case.n_q)
    before = target.attend(q, k, v, mask)[..., :rows, :]
    after = target.attend(q, k2, v2, mask)[..., :rows, :]
    assert_close(after, before, budget=2 * budget(q, k, v, mask, reference.attention(q, k, v, mask)[0]),
                 what=f"the outputs of queries < {split} after changing keys and values at positions >= {split}",
                 call="attention(Q, K', V', causal mask)",
                 cause="the output reads the future even though the weights look causal")


@prop("permutation-equivariance", family="symmetry",
      statement="permuting queries permutes outputs; permuting keys with values leaves them unchanged",
      cases={"min_n_kv": 2}, multihead="module",
      examples=[Case(n_q=3, n_kv=3, d_k=2, d_v=2, seed=1), Case(n_q=2, n_kv=4, d_k=2, d_v=3, mask="random", seed=2),
                MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2, seed=1)])
def permutation_equivariance(target, case):
    """attn(P Q, K, V) = P attn(Q, K, V) and attn(Q, S K, S V) = attn(Q, K, V) for permutations P, S.

    Why: attention is a set operation; order enters only through masks or positional
    encodings applied *outside* it. Catches: heads split or merged with view and no
    transpose (tokens mixed), a hard-coded causal mask, position-dependent terms, cumulative
    sums over the key axis. Modules are checked through their own multi-head forward.
    """
    gen = torch.Generator().manual_seed(case.seed)
    p, s = torch.randperm(case.n_q, generator=gen), torch.randperm(case.n_kv, generator=gen)
    if isinstance(case, MhaCase):
        case = cross_or_self(target, case)
        x_q, x_kv, weights, mask = case.tensors()
        ref = reference.multihead(x_q, x_kv, *weights.values(), case.n_heads, mask)[0]
        allowed = 2 * multihead_budget(x_q, x_kv, weights, case.n_heads, mask, ref)
        if case.self_attention:  # one input: permuting it must permute the output rows
            out = target.multihead(x_q, x_q, weights, case.n_heads, mask)  # [T, D]
            x_p = x_q[p]
            got = target.multihead(x_p, x_p, weights, case.n_heads, None if mask is None else mask[p][:, p])
            assert_close(got, out[p], budget=allowed,
                         what=f"the output for the tokens permuted by {p.tolist()} against the permuted output rows",
                         call="forward(x[p], x[p])",
                         cause="outputs depend on token positions (heads split without transpose?)")
            return

        def run(queries, keys, m):  # the keys' rows carry the values too
            return target.multihead(queries, keys, weights, case.n_heads, m)
        queries, keys = x_q, x_kv
        name, kv, kv_permuted = "forward", "x_kv", "x_kv[s]"
    else:
        q, k, v, mask = case.tensors()
        allowed = 2 * budget(q, k, v, mask, reference.attention(q, k, v, mask)[0])

        def run(queries, keys, m):
            return target.attend(queries, keys[0], keys[1], m)
        queries, keys = q, (k, v)
        name, kv, kv_permuted = "attention", "K, V", "K[s], V[s]"
    out = run(queries, keys, mask)  # [..., Tq, Dv]
    got = run(queries[..., p, :], keys, None if mask is None else mask[..., p, :])
    assert_close(got, out[..., p, :], budget=allowed,
                 what=f"the output for the queries permuted by {p.tolist()} against the permuted output rows",
                 call=f"{name}(Q[p], {kv})",
                 cause="outputs depend on query positions (heads split without transpose? hard-coded mask?)")
    shuffled = keys[..., s, :] if isinstance(keys, torch.Tensor) else tuple(t[..., s, :] for t in keys)
    got = run(queries, shuffled, None if mask is None else mask[..., :, s])
    assert_close(got, out, budget=allowed,
                 what=f"the output for keys and values permuted together by {s.tolist()} against the output",
                 call=f"{name}(Q, {kv_permuted})",
                 cause="outputs depend on key positions (a built-in mask or positional term?)")


_SCALE_EXAMPLES = [MhaCase(n_q=1, n_kv=2, d_model=16, n_heads=2), Case(n_q=1, n_kv=2, d_k=16, d_v=1)]


@prop("scale-sqrt-dk", family="scale",
      statement="scores are scaled by exactly 1/sqrt(d_k)",
      cases={"dtypes": ("float64", "float32")}, multihead="module", examples=_SCALE_EXAMPLES)
def scale_sqrt_dk(target, case):
    """softmax(Q K^T / sqrt(d_k)): the scale recovered from two keys with a known score gap.

    Why: with unit-variance entries, q . k has variance d_k; dividing by sqrt(d_k) keeps the
    softmax out of saturation at every width, so gradients do not vanish. Catches: a missing
    scale, 1/d_k, sqrt(d_model) for a per-head d_k, a scale applied twice, a hard-coded d_k.
    """
    dtype, tol = (torch.float64, 1e-6) if case.dtype == "float64" else (torch.float32, 1e-3)
    if isinstance(case, MhaCase):
        d_head = case.d_model // case.n_heads
        found = probes.scale_module(target, d_head, case.n_heads, dtype, case.device)
        d_k, d_model = d_head, case.d_model
    else:
        d_k, d_model = case.d_k, None
        found = [probes.scale_function(target, d_k, dtype, case.device)]
    expected = 1 / math.sqrt(d_k)
    for s in found:
        if not math.isclose(s, expected, rel_tol=tol):
            name = probes.name_scale(s, d_k, d_model)
            gap = math.sqrt(d_k)  # raw score gap between the probe's two keys
            got, want = torch.sigmoid(torch.tensor(s * gap, dtype=torch.float64)), torch.sigmoid(torch.tensor(1.0))
            fail(f"{s:.4g} = {name}", what="the recovered scale", expected=f"{expected:.4g} = 1/sqrt(d_k) at d_k={d_k}",
                 budget=f"relative {tol:g}", call="the probe: query e_0, keys 0 and sqrt(d_k) e_0; weights shown",
                 cause=f"scores are scaled by {name} instead of 1/sqrt(d_k)",
                 got=torch.stack([1 - got, got])[None], expected_tensor=torch.stack([1 - want, want])[None])


@prop("cross-attention-shapes", family="shapes",
      statement="n_q != n_kv and d_v != d_k give output [..., n_q, d_v]", cases={"cross": True},
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=1), Case(n_q=3, n_kv=1, d_k=1, d_v=2)])
def cross_attention_shapes(target, case):
    """out = softmax(Q K^T / sqrt(d_k)) V has shape [..., n_q, d_v] for any n_kv and d_k.

    Why: cross-attention (decoder queries over encoder keys) has as many outputs as queries
    and as wide as the values. Catches: K used for V, the output built from the key count,
    d_v assumed equal to d_k, a causal mask hard-coded for square shapes.
    """
    q, k, v, mask = case.tensors()
    out = target.attend(q, k, v, mask)  # shape checked by the adapter: [..., Tq, Dv]
    if not torch.isfinite(out).all():
        fail("NaN or inf", what="the output of a rectangular case", expected="finite values",
             call=f"attention(Q [{case.n_q}, {case.d_k}], K [{case.n_kv}, {case.d_k}], V [{case.n_kv}, {case.d_v}])",
             cause="a square shape (n_q == n_kv or d_v == d_k) is assumed somewhere",
             got=out, expected_tensor=reference.attention(q, k, v, mask)[0])


@prop("head-concat-equivalence", family="multi-head",
      statement="multi-head output = concat of per-head single-head attention, times W_O; h=1 is single-head",
      conventions=MULTIHEAD_CONVENTIONS, multihead=True,
      examples=[MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2), MhaCase(n_q=2, n_kv=3, d_model=2, n_heads=1)])
def head_concat_equivalence(target, case):
    """MHA(x_q, x_kv) = Concat(head_1, ..., head_h) W_O^T, head_i = Attention(x_q W_Q_i^T, x_kv W_K_i^T, x_kv W_V_i^T).

    Head i uses columns i*d_head:(i+1)*d_head of each projection, d_head = d_model / h, and
    scales by 1/sqrt(d_head). Why: heads must be independent attentions over their own
    slice; mixing them silently wastes capacity and still trains. Catches: heads split or
    merged with view and no transpose, the scale of the whole width, W_O missing or applied
    per head, heads summed instead of concatenated.
    """
    case = cross_or_self(target, case)
    x_q, x_kv, weights, mask = case.tensors()
    got = target.multihead(x_q, x_kv, weights, case.n_heads, mask)  # [Tq, D]
    expected, _ = reference.multihead(x_q, x_kv, *(weights[n] for n in ("W_Q", "W_K", "W_V", "W_O")),
                                      case.n_heads, mask)  # [Tq, D]
    allowed = multihead_budget(x_q, x_kv, weights, case.n_heads, mask, expected)
    assert_close(got, expected, budget=allowed, what="the output against the concatenation of per-head attentions",
                 call="forward(x_q, x_kv)" if mask is None else "forward(x_q, x_kv, mask)",
                 cause=lambda: _diagnose_heads(got, x_q, x_kv, weights, case, mask, allowed))


def cross_or_self(target, case: MhaCase) -> MhaCase:
    """The case itself, or its self-attention form for a module that takes a single input."""
    if case.self_attention:
        return case
    x_q, x_kv, weights, _ = case.tensors()
    try:
        target.multihead(x_q[:1], x_kv[:1], weights, case.n_heads)
    except Unsupported:
        return case.as_self_attention()
    except Failure:
        pass  # a real failure shows up in the property's own call
    return case


def _diagnose_heads(got, x_q, x_kv, weights, case, mask, allowed):
    """Which classic multi-head mistake reproduces the target's output?"""
    W = {n: w.to("cpu", torch.float64) for n, w in weights.items()}
    x_q, x_kv = x_q.to("cpu", torch.float64), x_kv.to("cpu", torch.float64)
    h, d = case.n_heads, case.d_model
    dh = d // h

    def run(split, merge, scale, out_proj=True):
        q, k, v = split(x_q @ W["W_Q"].T), split(x_kv @ W["W_K"].T), split(x_kv @ W["W_V"].T)
        heads, _ = reference.attention(q, k, v, mask, scale=scale)
        concat = merge(heads)
        return concat @ W["W_O"].T if out_proj else concat

    def good_split(t):
        return t.view(t.shape[0], h, dh).transpose(0, 1)

    def good_merge(t):
        return t.transpose(0, 1).reshape(-1, d)

    def view_split(t):
        return t.reshape(h, t.shape[0], dh)

    def view_merge(t):
        return t.reshape(-1, d)

    s = 1 / math.sqrt(dh)
    candidates = [
        ("heads are split with view and no transpose (tokens mixed across heads)", run(view_split, good_merge, s)),
        ("heads are merged with view and no transpose", run(good_split, view_merge, s)),
        ("heads are split and merged with view and no transpose", run(view_split, view_merge, s)),
        ("the scale uses d_model instead of the per-head d_k", run(good_split, good_merge, 1 / math.sqrt(d))),
        ("W_O is not applied to the concatenated heads", run(good_split, good_merge, s, out_proj=False)),
    ]
    for cause, candidate in candidates:
        if max_error(got, candidate) <= max(allowed, 1e-3):
            return cause
    return "the heads are not independent attentions over their own slices"


@prop("matches-reference", family="values",
      statement="the output equals the float64 reference within the calibrated tolerance",
      after=("rows-sum-to-one", "scale-sqrt-dk", "causal-mask"),
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2), Case(n_q=3, n_kv=3, d_k=4, d_v=2, mask="random", seed=3),
                Case(batch=(2,), n_q=2, n_kv=2, d_k=3, d_v=3, values="normal", magnitude=3.0, seed=4)])
def matches_reference(target, case):
    """|attn(Q, K, V) - ref64(Q, K, V)| <= k * |naive - ref64| + floor, elementwise maximum.

    ref64 is the canonical formula in float64; naive is the same formula in the inputs'
    dtype (see attn_spec.checking.tolerance). Why: the structural properties can all hold while the
    values are still wrong. Catches: a wrong scale, wrong softmax axis, a mask ignored or
    inverted, float64 inputs computed in float32, precision lost in fp16 overflow.
    """
    q, k, v, mask = case.tensors()
    got = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    expected, _ = reference.attention(q, k, v, mask)  # [..., Tq, Dv]
    allowed = budget(q, k, v, mask, expected)
    assert_close(got, expected, budget=allowed, what="the output against the float64 reference",
                 call="attention(Q, K, V)" if mask is None else "attention(Q, K, V, mask)",
                 cause=lambda: diagnose_mismatch(got.detach().cpu().double(), q, k, v, mask, allowed))


def _fmt(t):
    flat = t.detach().double().cpu().flatten()
    shown = ", ".join(f"{x:.4g}" for x in flat[:6].tolist())
    return f"[{shown}{', ...' if flat.numel() > 6 else ''}]"
