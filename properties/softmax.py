"""The softmax family: each row of weights is a distribution over the keys, and adding one constant to a
row of scores changes nothing.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import torch

from attn_spec import reference
from attn_spec.checking import probes
from attn_spec.checking.assertions import assert_close, fail, with_mask
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.errors import Uninformative
from attn_spec.failures import because
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import push_limit


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
        fail(_fmt(sums), what="the row sums of the weights", expected="1", budget=allowed,
             call="attention(Q, K, V=ones)", cause=because("row-sums", sums=sums, w=w, ref_w=ref_w, allowed=allowed),
             got=w, expected_tensor=ref_w, labels=labels)
    if w.double().min().item() < -allowed:
        fail(f"{w.double().min().item():.3g}", what="the smallest weight", expected="a weight >= 0", budget=allowed,
             call="attention(Q, K, V=identity)", cause=because("weights-not-softmax"), got=w,
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


def _fmt(t):
    flat = t.detach().double().cpu().flatten()
    shown = ", ".join(f"{x:.4g}" for x in flat[:6].tolist())
    return f"[{shown}{', ...' if flat.numel() > 6 else ''}]"




@prop("key-shift-invariance", family="softmax",
      statement="adding the same vector to every key leaves the output unchanged (softmax shift invariance)",
      after=("rows-sum-to-one", "scale-sqrt-dk"), cases={"min_n_kv": 2},
      at_scale="an identity of the formula that does not depend on the length: checked at the drawn sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, seed=1),
                Case(n_q=3, n_kv=2, d_k=3, d_v=1, dtype="float32", mask="random", seed=2)],
      lesson=Lesson(unicode="attn(Q, K + 𝟙cᵀ, V) = attn(Q, K, V),   softmax(s + t·𝟙) = softmax(s)",
                    latex=r"\mathrm{attn}(Q, K + \mathbf{1}c^\top, V) = \mathrm{attn}(Q, K, V),\qquad \mathrm{softmax}(s + t\mathbf{1}) = \mathrm{softmax}(s)",
                    check="Adds the same vector c to every key and compares the outputs within the budget.",
                    example="shift"))
def key_shift_invariance(target, case):
    """attn(Q, K + 1 c^T, V) = attn(Q, K, V) for any vector c.

    q_i . (k_j + c) = q_i . k_j + q_i . c: every score of row i moves by the same amount,
    and softmax(s + t) = softmax(s). Why: a softmax is defined up to that shift, which is
    what makes max-subtraction legal; an attention that is not shift invariant is not a
    softmax of the scores. Catches: relu or sum normalisation instead of exp, L2-normalised
    keys, a stabilising max taken over the wrong axis.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    gen = torch.Generator().manual_seed(case.seed + 2)
    sign = torch.randint(0, 2, (case.d_k,), generator=gen) * 2 - 1
    direction = (torch.randint(1, 3, (case.d_k,), generator=gen) * sign).double()  # [Dk], entries +-1 or +-2
    k64, q_sum = k.double(), q.double().abs().sum(dim=-1).max().item()
    room = push_limit(q.dtype) / (2 * max(q_sum, 1.0))  # the shift moves a raw score by at most push_limit
    size = min(2 * max(1.0, k64.abs().max().item()), room)
    shifted = (k64 + size * direction.to(k64.device)).to(k.dtype)  # [..., Tk, Dk]
    moves = (q.double() @ direction.to(q.device)).abs()  # [..., Tq] how far the shift moves each row's scores
    keys = torch.ones(case.n_q, case.n_kv, dtype=torch.bool) if mask is None else mask.cpu()
    if not ((moves.cpu() > 0) & (keys.sum(dim=-1) >= 2)).any():
        raise Uninformative("the shift moves the scores of no query that has two keys to weigh")
    ref, ref_shifted = reference.attention(q, k, v, mask)[0], reference.attention(q, shifted, v, mask)[0]
    allowed = budget(q, k, v, mask, ref) + budget(q, shifted, v, mask, ref_shifted) + max_error(ref_shifted, ref)
    before, after = target.attend(q, k, v, mask), target.attend(q, shifted, v, mask)  # [..., Tq, Dv]
    assert_close(after, before, budget=allowed, call=f"attention(Q, K + c, V{with_mask(mask)})",
                 labels=("the output on K + c", "the target's own output on K, before the shift"),
                 what=f"the output after adding c = {size:.3g} * {direction.tolist()} to every key",
                 cause=because("key-shift", before=before, after=after, q=q, k=k, shifted=shifted, v=v, mask=mask,
                               allowed=allowed))


@derivation("key-shift-invariance")
def derive_key_shift_invariance():
    """Adding c to every key adds the same t = scale * q.c to each score of a row; softmax ignores it."""
    import sympy as sp

    from attn_spec.symbolic import reference_weights_agree, require, softmax_row, symbolic_attention

    q, K, V = sp.Matrix([sp.symbols("q1:3", real=True)]), sp.Matrix(2, 2, sp.symbols("k1:3(1:3)", real=True)), \
        sp.Matrix(2, 1, sp.symbols("v1:3", real=True))
    c = sp.Matrix([sp.symbols("c1:3", real=True)])
    tie = reference_weights_agree()
    shifted = K + sp.ones(K.rows, 1) * c  # k_j + c for every key j
    _, A, S = symbolic_attention(q, K, V)
    _, A2, S2 = symbolic_attention(q, shifted, V)
    moves = sp.expand(S2 - S)  # [1, Tk]
    require(all(sp.expand(x - moves[0]) == 0 for x in moves), "keys shifted by c move the scores unequally")
    s, t = sp.symbols("s1:4", real=True), sp.Symbol("t", real=True)
    diff = sp.simplify(softmax_row([x + t for x in s]) - softmax_row(s))
    require(diff == sp.zeros(1, 3), "softmax(s + t) != softmax(s)")
    require(sp.simplify(A2 - A) == sp.zeros(*A.shape), "the weights change when keys are shifted")
    return [("keys shifted by the same vector c: scores move by", moves),
            ("the same t for every key of the row: exp(s_j + t) = e^t exp(s_j), and e^t cancels",
             diff),
            ("so the weights of the shifted keys equal the original ones", sp.simplify(A2 - A)),
            tie]
