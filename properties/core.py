"""The seed's properties: weights that are distributions, causality, symmetry, the scale.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking import probes
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.checking.assertions import assert_close, fail, with_mask
from attn_spec.errors import Failure, Uninformative, Unsupported
from attn_spec.checking.tolerance import budget, max_error, multihead_budget
from attn_spec.diagnosis.numbers import masked_share, name_scale, weight_factor
from attn_spec.properties.informative import require_responsive


def _ones_like_values(k):
    return torch.ones(*k.shape[:-1], 1, dtype=k.dtype, device=k.device)  # [..., Tk, 1]


@prop("rows-sum-to-one", family="softmax",
      statement="every row of weights is a distribution over the keys: non-negative, sums to 1",
      at_scale="it reads the weights with V = identity, an [n_q, n_kv] output per head; at such sizes "
               "matches-reference checks the rows' values",
      examples=[Case(n_q=3, n_kv=2, d_k=2, d_v=2), Case(n_q=1, n_kv=1, d_k=1, d_v=1)],
      lesson=Lesson(unicode="A = softmax(Q Kᵀ/√d_k),   Σⱼ Aᵢⱼ = 1,   Aᵢⱼ ≥ 0",
                    latex=r"A = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right),\quad \sum_j A_{ij} = 1,\quad A_{ij} \ge 0",
                    check="V = ones [Tk, 1] makes the output the row sums of the weights; V = identity reads the "
                          "weights themselves (attn_spec.checking.probes). Sums are compared with 1 within the calibrated budget.",
                    example="weights"))
def rows_sum_to_one(target, case):
    """sum_j A[i, j] = 1 and A[i, j] >= 0 for every query i, where A = softmax(scale * Q K^T).

    Why: each output row is then a weighted *average* of value rows, so outputs stay on the
    scale of V however many keys there are. Catches: softmax over the query axis (dim=-2),
    exp without normalising, normalising by the wrong sum, a missing softmax.
    """
    require_responsive(target, case)
    q, k, _, mask = case.tensors()
    ones = _ones_like_values(k)
    sums = probes.row_sums(target, q, k, mask)  # [..., Tq]
    allowed = budget(q, k, ones, mask, torch.ones(*sums.shape, 1, dtype=torch.float64))
    w = probes.weights(target, q, k, mask)  # [..., Tq, Tk]
    ref_w = reference.attention(q, k, k, mask)[1]  # [..., Tq, Tk]
    labels = probes.WEIGHT_LABELS
    if max_error(sums, torch.ones(sums.shape, dtype=torch.float64)) > allowed:
        col_sums = w.double().sum(dim=-2)  # [..., Tk]
        cause = ("the weights have NaN or inf although every input is finite (0/0 or an overflowing exp?)"
                 if not torch.isfinite(sums).all() else "weights sum over queries, not keys (softmax over dim -2?)"
                 if case.n_q > 1 and max_error(col_sums, torch.ones_like(col_sums)) <= allowed * case.n_q
                 else weight_factor(w, ref_w) or "the weights are not normalised by the sum over keys")
        fail(_fmt(sums), what="the row sums of the weights", expected="1", budget=allowed,
             call="attention(Q, K, V=ones)", cause=cause, got=w, expected_tensor=ref_w, labels=labels)
    if w.double().min().item() < -allowed:
        fail(f"{w.double().min().item():.3g}", what="the smallest weight", expected="a weight >= 0", budget=allowed,
             call="attention(Q, K, V=identity)", cause="weights are not a softmax (no exp?)", got=w,
             expected_tensor=ref_w, labels=labels)


@derivation("rows-sum-to-one")
def derive_rows_sum_to_one():
    """Each row of softmax(scale * Q K^T) sums to 1, for any Q and K."""
    import sympy as sp

    from attn_spec.symbolic import reference_weights_agree, require, symbolic_attention

    Q, K, V = sp.Matrix(2, 2, sp.symbols("q1:3(1:3)", real=True)), sp.Matrix(3, 2, sp.symbols("k1:4(1:3)", real=True)), \
        sp.Matrix(3, 1, sp.symbols("v1:4", real=True))
    tie = reference_weights_agree()
    _, A, S = symbolic_attention(Q, K, V)
    row = A.row(0)
    total = sp.simplify(sp.together(sum(row)))
    require(all(sp.simplify(sp.together(sum(A.row(i)))) == 1 for i in range(A.rows)), "a row does not sum to 1")
    return [("scores of query 1 (canonical scale 1/sqrt(d_k), d_k = 2)", S.row(0)),
            ("weights of query 1: a_j = exp(s_j) / sum_l exp(s_l)", row),
            ("their sum", sum(row)),
            ("over one common denominator the numerator equals the denominator: every row sums to 1", total),
            tie]


@prop("causal-mask", family="masking",
      statement="under a causal mask, weights above the diagonal are 0 and output i ignores keys and values after i",
      cases={"masks": ("causal",), "min_n_kv": 2}, at_scale={"masks": ("causal",)},
      examples=[Case(n_q=3, n_kv=3, d_k=2, d_v=2, mask="causal"), Case(n_q=2, n_kv=4, d_k=1, d_v=1, mask="causal")],
      lesson=Lesson(unicode="Aᵢⱼ = 0 for j > i,   outᵢ depends on K₀..ᵢ, V₀..ᵢ only",
                    latex=r"A_{ij} = 0 \ \text{for}\ j > i,\qquad \mathrm{out}_i = f(Q_i, K_{\le i}, V_{\le i})",
                    check="Reads the weights with V = identity under a causal mask and looks above the diagonal; then "
                          "changes K and V at future positions and checks earlier outputs do not move.",
                    example="causal"))
def causal_mask(target, case):
    """A[i, j] = 0 for j > i, the rest is softmax over j <= i; out[i] depends only on K, V[:i+1].

    Why: a decoder trained with a leak from the future learns to copy the next token and is
    useless at generation time. Catches: the mask ignored, inverted (True taken as 'ignore'),
    off by one (triu diagonal=0 masks the current token; row 0 then has no key), a mask
    applied after the softmax. Beyond probes.WEIGHTS_LIMIT the weights are not read (V = identity
    would be [n_q, n_kv] wide): the output under the mask is compared with the reference instead.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    if probes.weights_fit(case.n_q, case.n_kv):
        _causal_weights(target, case, q, k, mask)
    else:
        _causal_outputs(target, q, k, v, mask)
    split = case.n_kv // 2  # keys and values from here on are the future of the first `split` queries
    k2, v2 = k.clone(), v.clone()
    k2[..., split:, :] = -k2[..., split:, :] * 3 + 1
    v2[..., split:, :] = v2[..., split:, :] * 5 - 2
    rows = min(split, case.n_q)
    before = target.attend(q, k, v, mask)[..., :rows, :]
    after = target.attend(q, k2, v2, mask)[..., :rows, :]
    assert_close(after, before, budget=2 * row_reference(q, k, v, mask).budget,
                 what=f"the outputs of queries < {split} after changing keys and values at positions >= {split}",
                 call="attention(Q, K', V', causal mask)",
                 cause="the output reads the future even though the weights look causal",
                 labels=("the outputs with the future keys and values changed",
                         "the target's own outputs before the change (the keys and values as drawn)"))


def _causal_weights(target, case, q, k, mask):
    """Weights read with V = identity: zero above the diagonal, and no allowed key left out."""
    w = probes.weights(target, q, k, mask).double().cpu()  # [..., Tq, Tk]
    ref_w = reference.attention(q, k, k, mask)[1]  # [..., Tq, Tk]
    future = ~reference.causal_mask(case.n_q, case.n_kv)  # [Tq, Tk]
    leak = w.masked_fill(~future, 0.0).abs()
    labels = probes.WEIGHT_LABELS
    if leak.max().item() > 0:
        diag = torch.diagonal(w, dim1=-2, dim2=-1)
        cause = ("the mask is applied with inverted polarity (True taken as 'ignore'): masked keys get the weight"
                 if w.masked_fill(future, 0.0).abs().max() < 1e-3
                 else "the causal mask is shifted by one (the diagonal is masked)" if diag.abs().max() < 1e-3
                 else masked_share(w, ~future) or "the mask is ignored or applied after the softmax")
        fail(f"{leak.max().item():.3g}: queries see future keys", what="the largest weight above the diagonal",
             expected="0", call="attention(Q, K, V=identity, causal mask)", cause=cause, got=w, expected_tensor=ref_w,
             labels=labels)
    dropped = (ref_w > 1e-3) & (w == 0)  # an allowed key the target never looks at
    if dropped.any():
        i, j = [int(x) for x in dropped.nonzero()[0][-2:]]
        fail("0, but j <= i is allowed", what=f"the weight of query {i} on key {j}",
             expected=f"the reference weight {ref_w[..., i, j].flatten()[0].item():.3g}",
             call="attention(Q, K, V=identity, causal mask)",
             cause="the causal mask is off by one (triu with diagonal=0 masks the current token?)",
             got=w, expected_tensor=ref_w, labels=labels)


def _causal_outputs(target, q, k, v, mask):
    """At lengths too long to read the weights: the output under the causal mask matches the reference.

    A mismatch counts against the mask only when the same target matches the reference without a
    mask (otherwise its values are wrong, which matches-reference reports); which wrong mask
    reproduces the output on a few rows names the bug."""
    got = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    ref = row_reference(q, k, v, mask)  # on chosen rows at long lengths (checking.rows)
    if ref.holds(got):
        return
    if not row_reference(q, k, v).holds(target.attend(q, k, v, None)):
        return  # wrong without a mask too: not the mask's failure
    ref.check(got, what="the output under the causal mask against the float64 reference (without a mask it "
              "matches)", call="attention(Q, K, V, causal mask)",
              cause=lambda: _diagnose_causal(got, q, k, v, mask, ref.budget))


def _diagnose_causal(got, q, k, v, mask, allowed) -> str:
    """Which wrong mask reproduces the output, on a few rows (probes.sample_rows)."""
    rows = probes.sample_rows(q.shape[-2])  # [R] first and last among them
    i, j = rows[:, None], torch.arange(k.shape[-2])[None, :]  # [R, 1], [1, Tk]
    m = mask[..., rows.to(mask.device), :].cpu()  # [R, Tk]
    candidates = [("the mask is ignored", None),
                  ("the mask is applied with inverted polarity (True taken as 'ignore')", ~m),
                  ("the causal mask is off by one (the diagonal is masked: triu with diagonal=0?)", m & (j < i))]
    got_rows = got[..., rows.to(got.device), :]
    for cause, candidate in candidates:
        if max_error(got_rows, reference.attention(q[..., rows.to(q.device), :], k, v, candidate)[0]) <= allowed:
            return cause
    return "the mask does not reach every query and key (applied to the wrong axis or a fixed-size block?)"


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
                         cause="outputs depend on token positions (heads split without transpose?)")
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
                     call=f"{name}(Q[p], {kv}{with_mask(mask)})", labels=moved, cause=f"outputs depend on query positions ({where})")
    shuffled = keys[..., s, :] if isinstance(keys, torch.Tensor) else tuple(t[..., s, :] for t in keys)
    got = run(queries, shuffled, None if mask is None else mask[..., :, s])
    assert_close(got, out, budget=allowed,
                 what=f"the output for keys and values permuted together by {s.tolist()} against the output",
                 call=f"{name}(Q, {kv_permuted}{with_mask(mask, 'mask[:, s]')})",
                 labels=("the output on permuted keys and values", "the target's own output on them as drawn"),
                 cause="outputs depend on key positions (a built-in mask or positional term?)")


def _shuffle(n: int, gen) -> torch.Tensor:
    """A random permutation of n items that moves something (never the identity when n > 1)."""
    p = torch.randperm(n, generator=gen)
    return p.roll(1) if n > 1 and torch.equal(p, torch.arange(n)) else p


_SCALE_EXAMPLES = [MhaCase(n_q=1, n_kv=2, d_model=16, n_heads=2), Case(n_q=1, n_kv=2, d_k=16, d_v=1)]


@prop("scale-sqrt-dk", family="scale",
      statement="scores are scaled by exactly 1/sqrt(d_k)",
      cases={"dtypes": ("float64", "float32")}, multihead="module", examples=_SCALE_EXAMPLES,
      at_scale={"masks": ("none",)},
      lesson=Lesson(unicode="scores = Q Kᵀ · 1/√d_k",
                    latex=r"S = \frac{QK^\top}{\sqrt{d_k}}",
                    check="One query e₀ and two keys 0 and √d_k·e₀: raw score gap √d_k, so the weight on the second key "
                          "is σ(s·√d_k); V = [[0], [1]] reads it and s = logit(w)/√d_k is the scale applied.",
                    example="scale"))
def scale_sqrt_dk(target, case):
    """softmax(Q K^T / sqrt(d_k)): the scale recovered from two keys with a known score gap.

    Why: with unit-variance entries, q . k has variance d_k; dividing by sqrt(d_k) keeps the
    softmax out of saturation at every width, so gradients do not vanish. Catches: a missing
    scale, 1/d_k, sqrt(d_model) for a per-head d_k, a scale applied twice, a hard-coded d_k.
    """
    require_responsive(target, case)
    dtype, tol = (torch.float64, 1e-6) if case.dtype == "float64" else (torch.float32, 1e-3)
    if isinstance(case, MhaCase):
        d_k, n_heads = case.d_model // case.n_heads, case.n_heads
        found = probes.scale_module(target, d_k, n_heads, dtype, case.device)

        def at(width):  # the scale of the first head, at another head width
            return probes.scale_module(target, width, n_heads, dtype, case.device)[0]
    else:
        d_k, n_heads = case.d_k, 1
        found = [probes.scale_function(target, d_k, dtype, case.device)]

        def at(width):
            return probes.scale_function(target, width, dtype, case.device)
    expected = 1 / math.sqrt(d_k)
    for s in found:
        if not math.isclose(s, expected, rel_tol=tol):
            other = 4 * d_k if d_k <= 64 else d_k // 4  # a second width reveals the law c * d_k^p
            law = {d_k: s, other: at(other)}
            name = name_scale(law, n_heads)
            gap = math.sqrt(d_k)  # raw score gap between the probe's two keys
            got, want = torch.sigmoid(torch.tensor(s * gap, dtype=torch.float64)), torch.sigmoid(torch.tensor(1.0))
            fail(f"{s:.4g} at d_k={d_k} and {law[other]:.4g} at d_k={other}: {name}",
                 what="the recovered scale (read from the weights shown)",
                 expected=f"{expected:.4g} = 1/sqrt(d_k) at d_k={d_k}", budget=f"relative {tol:g}",
                 call="forward(x, x), x = [(1 - sqrt(d_k)) e_0, e_0] in each head, identity projections; token 1 read"
                 if isinstance(case, MhaCase) else "attention(Q = [e_0, e_0], K = [0, sqrt(d_k) e_0], V = [[0], [1]]); "
                                                   "query 1 read",
                 cause=f"scores are scaled by {name} instead of 1/sqrt(d_k)"
                 if not name.startswith(("unreadable", "negative")) else f"the scale is {name}",
                 got=torch.stack([1 - got, got])[None], expected_tensor=torch.stack([1 - want, want])[None],
                 labels=(f"the probe's weights on its two keys at d_k={d_k}", "the weights at scale 1/sqrt(d_k)"),
                 inputs={"x": probes.scale_module_input(d_k, n_heads, dtype)} if isinstance(case, MhaCase) else
                 dict(zip(("q", "K", "V"), probes.scale_function_inputs(d_k, dtype))))


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


def _fmt(t):
    flat = t.detach().double().cpu().flatten()
    shown = ", ".join(f"{x:.4g}" for x in flat[:6].tolist())
    return f"[{shown}{', ...' if flat.numel() > 6 else ''}]"


@derivation("scale-sqrt-dk")
def derive_scale_sqrt_dk():
    """Var(q.k) = d_k for independent zero-mean unit-variance entries, so the scale is 1/sqrt(d_k)."""
    import sympy as sp

    from attn_spec.symbolic import agreement, canonical_scale, expectation, require

    d_k, i, c = sp.Symbol("d_k", positive=True, integer=True), sp.Symbol("i", integer=True), sp.Symbol("c", positive=True)
    second_moments = []
    for d in range(1, 7):  # the collapse of the double sum, checked dimension by dimension
        q, k = sp.symbols(f"q1:{d + 1}"), sp.symbols(f"k1:{d + 1}")
        dot = sum(a * b for a, b in zip(q, k))
        require(expectation(dot, q + k) == 0, f"E[q.k] != 0 at d_k={d}")
        second_moments.append(expectation(dot**2, q + k))
        require(second_moments[-1] == d, f"E[(q.k)^2] != d_k at d_k={d}")
    variance = sp.Sum(1, (i, 1, d_k)).doit()  # sum_i E[q_i^2] E[k_i^2]
    solved = sp.solve(sp.Eq(c**2 * variance, 1), c)
    require(solved == [canonical_scale(d_k)], f"Var(c q.k) = 1 solves to {solved}, not the canonical scale")
    rows = []
    for d in (4, 16):  # the reference applies that scale: probe with keys 0 and sqrt(d) e_0
        q = torch.zeros(1, d, dtype=torch.float64)
        q[0, 0] = 1
        k = torch.zeros(2, d, dtype=torch.float64)
        k[1, 0] = math.sqrt(d)
        w = reference.attention(q, k, torch.eye(2, dtype=torch.float64))[1]  # [1, 2]
        expected = 1 / (1 + sp.exp(-solved[0].subs(d_k, d) * sp.sqrt(d)))  # sigmoid(c * gap)
        agreement(sp.Matrix([[1 - expected, expected]]), w, f"scale at d_k={d}")
        rows.append(w[0, 1].item())
    return [("E[q.k] = sum_i E[q_i] E[k_i] = 0 (independence, zero mean)", sp.Integer(0)),
            ("E[(q.k)^2] = sum_i sum_j E[q_i q_j] E[k_i k_j]; only i = j survives, E[q_i^2] E[k_i^2] = 1",
             sp.Eq(sp.Symbol("Var(q.k)"), variance)),
            ("checked term by term by expanding (q.k)^2: E[(q.k)^2] for d_k = 1..6", sp.Tuple(*second_moments)),
            ("the scaled score c q.k has variance c^2 d_k; unit variance needs", sp.Eq(c, solved[0])),
            (f"the kit's reference applies it: weight on the key with raw gap sqrt(d_k) is sigmoid(1) "
             f"({rows[0]:.6f} at d_k=4 and 16)", sp.Eq(sp.Symbol("w"), 1 / (1 + sp.exp(-1))))]
