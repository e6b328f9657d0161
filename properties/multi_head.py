"""The multi-head family: heads concatenated equal the per-head form, and grouped K/V heads equal repeated ones.

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

from attn_spec import reference
from attn_spec.checking.assertions import assert_close
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.catalog import Lesson, derivation, prop
from attn_spec.checking.rows import reference as row_reference
from attn_spec.checking.tolerance import multihead_budget
from attn_spec.errors import TargetRaised, Unsupported
from attn_spec.failures import because, worded
from attn_spec.targets.behaviours import behaviour
from attn_spec.targets.conventions import FUNCTION_CONVENTIONS, MULTIHEAD_CONVENTIONS
from attn_spec.properties.informative import require_responsive
from attn_spec.properties.inputs import cross_or_self


@prop("head-concat-equivalence", family="multi-head",
      statement="multi-head output = concat of per-head single-head attention, times W_O; h=1 is single-head",
      conventions=MULTIHEAD_CONVENTIONS, multihead=True,
      at_scale="the projections and the split into heads do not depend on the length: checked at the drawn sizes",
      examples=[MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2), MhaCase(n_q=2, n_kv=3, d_model=2, n_heads=1)],
      lesson=Lesson(unicode="MHA(x_q, x_kv) = Concat(head₁, …, head_h) W_Oᵀ,   headᵢ = attn(x_q W_Qᵢᵀ, x_kv W_Kᵢᵀ, x_kv W_Vᵢᵀ)",
                    latex=r"\mathrm{MHA}(x_q, x_{kv}) = \mathrm{Concat}(\mathrm{head}_1,\dots,\mathrm{head}_h)\,W_O^\top,\quad "
                          r"\mathrm{head}_i = \mathrm{attn}(x_q W_{Q,i}^\top, x_{kv} W_{K,i}^\top, x_{kv} W_{V,i}^\top)",
                    check="Loads chosen weights into the module (W_Q, W_K, W_V, W_O) and compares its forward with the "
                          "per-head float64 reference, concatenated and projected; h = 1 must be single-head attention.",
                    example="multihead"))
def head_concat_equivalence(target, case):
    """MHA(x_q, x_kv) = Concat(head_1, ..., head_h) W_O^T, head_i = Attention(x_q W_Q_i^T, x_kv W_K_i^T, x_kv W_V_i^T).

    Head i uses columns i*d_head:(i+1)*d_head of each projection, d_head = d_model / h, and
    scales by 1/sqrt(d_head). Why: heads must be independent attentions over their own
    slice; mixing them silently wastes capacity and still trains. Catches: heads split or
    merged with view and no transpose, the scale of the whole width, W_O missing or applied
    per head, heads summed instead of concatenated.
    """
    require_responsive(target, case)
    case = cross_or_self(target, case)
    x_q, x_kv, weights, mask = case.tensors()
    got = target.multihead(x_q, x_kv, weights, case.n_heads, mask)  # [Tq, D]
    expected, _ = reference.multihead(x_q, x_kv, *(weights[n] for n in ("W_Q", "W_K", "W_V", "W_O")),
                                      case.n_heads, mask)  # [Tq, D]
    allowed = multihead_budget(x_q, x_kv, weights, case.n_heads, mask, expected)
    assert_close(got, expected, budget=allowed, what="the output against the concatenation of per-head attentions",
                 call="forward(x_q, x_kv)" if mask is None else "forward(x_q, x_kv, mask)",
                 cause=because("heads-differ", got=got, x_q=x_q, x_kv=x_kv, weights=weights, case=case, mask=mask,
                               allowed=allowed))


def _multihead_forms(X, W: dict, h: int):
    """(heads, Concat(heads) W_O^T, sum_i head_i W_O[:, block i]^T) with per-head projections."""
    import sympy as sp

    from attn_spec.symbolic import require, symbolic_attention

    d_head = X.shape[1] // h
    heads, projected = [], []
    for i in range(h):
        rows = slice(i * d_head, (i + 1) * d_head)  # head i's rows of each nn.Linear weight
        per_head = [X * W[n][rows, :].T for n in ("W_Q", "W_K", "W_V")]  # [T, d_head] each
        full = [(X * W[n].T)[:, rows] for n in ("W_Q", "W_K", "W_V")]  # split after projecting
        require(all(sp.expand(a - b) == sp.zeros(*a.shape) for a, b in zip(per_head, full)),
                "per-head projection != column block of the full projection")
        head = symbolic_attention(*per_head)[0]  # [T, d_head], scale 1/sqrt(d_head)
        heads.append(head)
        projected.append(head * W["W_O"][:, rows].T)  # head i through its block of W_O
    concat = sp.Matrix.hstack(*heads) * W["W_O"].T  # [T, d_model]
    return heads, concat, sum(projected, sp.zeros(*concat.shape))


@derivation("head-concat-equivalence")
def derive_head_concat_equivalence():
    """h heads with per-head projections, concatenated and mixed by W_O, equal the seed's split form."""
    import sympy as sp

    from attn_spec.symbolic import agreement, as_tensor, numbers, require

    names = ("W_Q", "W_K", "W_V", "W_O")
    # Numerically first, at d_head = 2 (where the per-head scale 1/sqrt(d_head) is not 1): the kit's reference.
    Xn = numbers(3, 4)
    Wn = {n: numbers(4, 4, i + 1) / 2 for i, n in enumerate(names)}
    ref = reference.multihead(as_tensor(Xn), as_tensor(Xn), *(as_tensor(Wn[n]) for n in names), 2)[0]
    concat_n = _multihead_forms(Xn, Wn, 2)[1]
    err = agreement(concat_n, ref, "multi-head output")
    # Symbolically at d_model = 2, h = 2.
    d_model, h, T = 2, 2, 2
    X = sp.Matrix(T, d_model, sp.symbols(f"x1:{T + 1}(1:{d_model + 1})", real=True))
    W = {n: sp.Matrix(d_model, d_model, sp.symbols(f"{n.lower()}1:{d_model + 1}(1:{d_model + 1})", real=True))
         for n in names}
    heads, concat, summed = _multihead_forms(X, W, h)
    require(sp.expand(concat - summed) == sp.zeros(T, d_model), "Concat(heads) W_O^T != sum_i head_i W_O,i^T")
    return [("head i projects with rows i*d_head:(i+1)*d_head of W_Q, W_K, W_V (= that column block of x W^T)",
             X * W["W_Q"][0:1, :].T),
            ("head 1 = attention(x W_Q1^T, x W_K1^T, x W_V1^T), scale 1/sqrt(d_head)", heads[0]),
            ("Concat(head_1, head_2) W_O^T - sum_i head_i W_O[:, block i]^T", sp.expand(concat - summed)),
            (f"the kit's reference.multihead agrees with the per-head form at d_model = 4, h = 2 "
             f"(max |difference| {float(err):.1g})", concat_n.evalf(6))]


GROUPINGS = ((2, 2), (2, 3), (1, 4), (3, 2))  # (KV heads, query heads per KV head), picked by the case's seed


@prop("gqa-equivalence", family="multi-head",
      statement="where the target supports grouped-query attention: it equals multi-head attention with K/V "
                "heads repeated in the target's grouping, probed and reported (blocked: query head h reads KV "
                "head h // g; tile: h % H_kv)",
      conventions=FUNCTION_CONVENTIONS, after=("matches-reference", "batch-independence"),
      at_scale={"masks": ("none",), "grouped": True},
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=2, values="normal"),
                Case(batch=(2,), n_q=3, n_kv=3, d_k=4, d_v=3, mask="random", values="normal", seed=1)],
      lesson=Lesson(unicode="attn(Q[g·H_kv heads], K[H_kv], V[H_kv]) = attn(Q, K′, V′),   K′ = repeat_interleave(K, g)",
                    latex=r"\mathrm{attn}(Q_{[gH_{kv}]}, K_{[H_{kv}]}, V_{[H_{kv}]}) = \mathrm{attn}(Q, K', V'),\quad K' = \mathrm{repeat\_interleave}(K, g)",
                    check="Calls the target with fewer K/V heads than query heads and compares with the call on K/V "
                          "repeated with repeat_interleave; a target that refuses unequal head counts is skipped.",
                    example="gqa"))
def gqa_equivalence(target, case):
    """attn(Q [..., g*Hkv, Tq, Dk], K [..., Hkv, Tk, Dk], V) = attn(Q, K', V'), K' = K with each KV head
    repeated for the g query heads that read it.

    Which query heads share a KV head is a convention, probed (``gqa-grouping`` in the header):
    blocked, query head h reads KV head h // g (``repeat_interleave``: Llama, Mistral, SDPA's
    enable_gqa), or tile, h % Hkv (einops ``repeat(k, 'b h n d -> b (g h) n d')``); the
    property holds the target to the grouping found, and ``--require gqa-grouping=blocked``
    holds it to one; an ``hf`` function is held to Hugging Face's repeat_kv (blocked). A target
    that raises on unequal head counts does not support GQA: the property is then a skip (a
    failure where GQA is required: flex, hf with ``--require gqa`` or a GQA config). Why: GQA shrinks the KV cache g-fold, and a head mapping that
    changes with the input still trains, only worse. Catches: every query head reading KV
    head 0, a mapping that is neither grouping. A case with ``kv_heads`` (a fixed shape
    B,H,HKV,...) is checked with its own grouping.
    """
    if case.kv_heads:
        n_heads, n_kv_heads = case.batch[-1], case.kv_heads
    else:
        n_kv_heads, group = GROUPINGS[case.seed % len(GROUPINGS)]
        n_heads = n_kv_heads * group
    group = n_heads // n_kv_heads
    try:
        got = target.attend(*_grouped_inputs(case, n_heads, n_kv_heads))  # [..., Hq, Tq, Dv]
    except TargetRaised as exc:
        if target.gqa_contract:  # grouped heads are part of the convention (hf, flex): raising on them is a failure
            exc.cause = worded(because("gqa-contract-ignored", contract=target.gqa_contract))
            raise
        raise Unsupported(f"no grouped-query attention: with {n_heads} query heads and {n_kv_heads} KV heads, "
                          f"{exc.message}", total=True) from None
    require_responsive(target, case)
    grouping = target.gqa_grouping or behaviour(target, "gqa-grouping", case.dtype, case.device)  # hf: repeat_kv's
    q, k, v, mask = _grouped_inputs(case, n_heads, n_kv_heads)  # the kit's own copies
    repeated = [repeat_heads(t, group, grouping) for t in (k, v)]  # [..., Hq, Tk, D]
    ref = row_reference(q, *repeated, mask)  # on chosen rows at long lengths (checking.rows)
    whose = "the convention's" if target.gqa_grouping else "the target's"
    ref.check(got, what=f"the output against the float64 reference on K/V heads repeated "
              f"in {whose} grouping (gqa-grouping={grouping})", call=f"attention(Q [{n_heads} heads], "
              f"K [{n_kv_heads} heads], V [{n_kv_heads} heads])",
              cause=because("gqa-mapping", got=got, q=q, k=k, v=v, mask=mask, group=group, allowed=ref.budget,
                            grouping=grouping, contract=bool(target.gqa_grouping)),
              inputs={"Q": q, "K": k, "V": v, "mask": mask})


def repeat_heads(t, group, grouping):
    """K or V [..., Hkv, T, D] -> [..., g * Hkv, T, D] in the grouping: tile [h0, h1, h0, h1], else blocked [h0, h0, h1, h1]."""
    if grouping == "tile":
        return t.repeat(*[1] * (t.dim() - 3), group, 1, 1)
    return reference.repeat_kv(t, group)


def _grouped_inputs(case, n_heads, n_kv_heads):
    """Q [..., Hq, Tq, Dk], K and V [..., Hkv, Tk, D], mask [..., Hq, Tq, Tk] or [Tq, Tk]."""
    if case.kv_heads:
        return case.tensors()  # already grouped
    q, _, _, mask = case.replace(batch=case.batch + (n_heads,)).tensors()
    _, k, v, _ = case.replace(batch=case.batch + (n_kv_heads,), seed=case.seed + 1).tensors()
    return q, k, v, mask
