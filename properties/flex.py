"""FlexAttention's mods against the statement the user names (attn_spec.targets.mask_mods).

A ``mask_mod(b, h, q_idx, kv_idx)`` is read over every index, as FlexAttention reads it; a
``score_mod(score, b, h, q_idx, kv_idx)`` over every index and a grid of scores. Each function's
docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import torch

from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import FACTOR, earned, eps, max_error
from attn_spec.checking.assertions import fail
from attn_spec.errors import Unsupported
from attn_spec.targets.mask_mods import MASK_FORMS, SCORE_FORMS, alibi_slopes, inferred_heads
from attn_spec.failures import because

F64 = torch.float64
MOD_CASES = {"masks": ("none",), "dtypes": ("float64",)}


def _sizes(case, length=None, reach=0):
    """(B, H, S_q, S_kv): batch and heads from the case's leading dims; a document statement fixes the length,
    a window or prefix adds the keys it spans (its edges show only beyond them)."""
    b, h = (tuple(case.batch) + (1, 1))[:2]
    return (b, h, length, length) if length else (b, h, case.n_q + reach, case.n_kv + reach)


def _fail(measured, what, cause, got, expected, sizes, *, expected_text="", mask=None, labels=None):
    """Fail with a counterexample described by the mod's sizes (B, H, S_q, S_kv), not by attention inputs; ``labels``:
    what got and expected are (a mod's tensors are masks, scores or biases, never an attention's output)."""
    fail(measured, what=what, expected=expected_text, cause=cause, got=got, expected_tensor=expected, mask=mask,
         summary=dict(zip(("B", "H", "S_q", "S_kv"), sizes)), labels=labels)


@prop("mask-mod-statement", family="flex",
      statement="the mask_mod allows exactly the (q_idx, kv_idx) pairs of the statement named with --expect-mask",
      conventions=("mask-mod",), cases=MOD_CASES,
      examples=[Case(n_q=1, n_kv=1, d_k=1, d_v=1), Case(n_q=3, n_kv=3, d_k=1, d_v=1),
                Case(batch=(2, 2), n_q=2, n_kv=4, d_k=1, d_v=1, seed=1)],
      lesson=Lesson(unicode="mask_mod(b, h, q, kv) = statement(q, kv)   for every b, h, q < S_q, kv < S_kv",
                    latex=r"\mathrm{mask\_mod}(b, h, q, kv) = \mathrm{statement}(q, kv)\quad \forall\, b, h, q, kv",
                    check="Evaluates the mask_mod as FlexAttention does (vmapped over every index, create_mask's way) at "
                          "drawn sizes beyond the statement's window or prefix, and reports the first (b, h, q_idx, kv_idx)"
                          " where it differs, with both masks as pictures.",
                    example="mask-mod"))
def mask_mod_statement(target, case):
    """mask_mod(b, h, q_idx, kv_idx) = statement(q_idx, kv_idx) for every b, h, q_idx < S_q and kv_idx < S_kv.

    Statements: causal (kv_idx <= q_idx), sliding-window:W (q_idx - W < kv_idx <= q_idx: W keys),
    prefix-lm:P (kv_idx < P or kv_idx <= q_idx), document:IDS (ids[q_idx] == ids[kv_idx]), joined
    with +. Why: a mask_mod is the whole definition of who sees whom; FlexAttention runs whatever
    it says without complaint, so an off-by-one trains on the future or hides the present. Catches:
    < for <= (the diagonal masked), a window of W + 1 keys (q_idx - kv_idx <= W), a transposed
    triangle, a prefix off by one, documents not separated, a mask that depends on b or h.
    """
    statement = target.statement
    if statement is None:
        raise Unsupported(f"no statement named: --expect-mask {MASK_FORMS}", total=True)
    B, H, n_q, n_kv = _sizes(case, statement.length, statement.reach)
    got = target.dense(B, H, n_q, n_kv)  # [B, H, Tq, Tk]
    expected = statement.dense(n_q, n_kv)  # [Tq, Tk]
    differ = got != expected
    if not differ.any():
        return
    b, h, i, j = differ.nonzero()[0].tolist()  # the first pair, in (b, h, q_idx, kv_idx) order
    cause = because("mask-mod-differs", statement=statement, got=got, b=b, h=h)
    _fail(f"{bool(got[b, h, i, j])}", f"mask_mod(b={b}, h={h}, q_idx={i}, kv_idx={j}), the first of {int(differ.sum())} "
          f"pairs that differ at S_q={n_q}, S_kv={n_kv} (1 = may attend)", cause, got[b, h].to(F64), expected.to(F64), (B, H, n_q, n_kv),
          expected_text=f"{bool(expected[i, j])} under {statement.text}", mask=expected,
          labels=(f"the mask_mod's mask at b={b}, h={h} (1 = may attend)", f"the mask of {statement.text}"))


@prop("mask-mod-rows", family="flex",
      statement="every query keeps at least one key (a row with none gives zeros in FlexAttention and NaN in SDPA)",
      conventions=("mask-mod",), cases={**MOD_CASES, "cross": False},
      examples=[Case(n_q=4, n_kv=4, d_k=1, d_v=1)],
      lesson=Lesson(unicode="∀ b, h, q:  ∃ kv  mask_mod(b, h, q, kv)",
                    latex=r"\forall\, b, h, q\ \exists\, kv:\ \mathrm{mask\_mod}(b, h, q, kv)",
                    check="Evaluates the mask_mod on square sizes and names the query rows that keep no key.",
                    example="mask-mod"))
def mask_mod_rows(target, case):
    """For every b, h and q_idx there is a kv_idx with mask_mod(b, h, q_idx, kv_idx) True (S_q = S_kv).

    Holds for every statement the kit knows, so it is checked even when none is named. Why: a
    query that may attend nothing has no softmax; FlexAttention returns zeros for it and SDPA
    NaN, and either way that token's output carries no information. Catches: < for <= in a
    causal or window mask (query 0 then sees nothing), a window of 0 keys, an inverted mask.
    """
    statement = target.statement
    B, H, n, _ = _sizes(case.replace(n_kv=case.n_q), statement and statement.length, statement and statement.reach or 0)
    got = target.dense(B, H, n, n)  # [B, H, T, T]
    empty = ~got.any(dim=-1)  # [B, H, T]
    if not empty.any():
        return
    b, h, _ = empty.nonzero()[0].tolist()
    rows = empty[b, h].nonzero().flatten().tolist()
    cause = because("mask-mod-empty-rows", mask=got[b, h])
    _fail(f"rows {rows} keep no key", f"the query rows of mask_mod(b={b}, h={h}, q_idx, kv_idx) at S_q = S_kv = {n} "
          f"(1 = may attend)", cause, got[b, h].to(F64), None, (B, H, n, n), expected_text="every row keeps a key",
          mask=got[b, h], labels=(f"the mask_mod's mask at b={b}, h={h} (1 = may attend)", ""))


def _grid(B, H, n_q, n_kv, span, seed):
    """Scores [B, H, Tq, Tk] in float64 spread over [-span, span], shuffled, with one far beyond it."""
    gen = torch.Generator().manual_seed(seed)
    count = B * H * n_q * n_kv
    values = torch.linspace(-span, span, count, dtype=F64)[torch.randperm(count, generator=gen)]
    values[0] = 20 * span
    return values.reshape(B, H, n_q, n_kv)


def _budget(naive, expected) -> float:
    """The same-dtype statement's own error, times FACTOR, plus a floor of FLOOR_ULPS ulps of the scores."""
    err = max_error(naive, expected)
    return earned(err if err < float("inf") else 0.0, eps(naive.dtype) * max(1.0, expected.abs().max().item()))


def _softcap(target, scores, cap, dtype):
    got = target.scores(scores.to(dtype))
    expected = cap * torch.tanh(scores / cap)
    candidates = [("the score is returned unchanged: the cap is not applied", scores),
                  ("tanh without the cap factor: tanh(score / C) squashes every score into (-1, 1); multiply by C",
                   torch.tanh(scores / cap)),
                  ("the score is not divided by the cap: C * tanh(score) instead of C * tanh(score / C)",
                   cap * torch.tanh(scores))]
    return got, expected, cap * torch.tanh(scores.to(dtype) / cap), candidates


def _alibi(target, scores, n_heads, dtype):
    B, H, n_q, n_kv = scores.shape
    distance = (torch.arange(n_kv)[None, :] - torch.arange(n_q)[:, None]).to(F64)  # [Tq, Tk]: kv_idx - q_idx
    slopes = alibi_slopes(n_heads)[:, None, None]  # [H, 1, 1]
    got = target.scores(scores.to(dtype))
    expected = scores + slopes * distance
    naive = scores.to(dtype) + slopes.to(dtype) * distance.to(dtype)
    candidates = [("the bias has the wrong sign: m_h (q_idx - kv_idx) rewards distant keys", scores - slopes * distance),
                  ("the bias replaces the score instead of being added to it", (slopes * distance).expand_as(scores)),
                  ("the slopes run the wrong way: head h gets m_(H-1-h)", scores + slopes.flip(0) * distance),
                  ("the bias uses |kv_idx - q_idx| for keys after the query too (symmetric ALiBi)",
                   scores - slopes * distance.abs())]
    return got, expected, naive, candidates


def _alibi_heads(target, statement) -> int:
    """H of an alibi statement: given (alibi:H), or read from head 0's slope 2^(-8/H)."""
    if statement.arg:
        return statement.arg
    slope0 = target.scores(torch.zeros(1, 1, 1, 2, dtype=F64))[0, 0, 0, 1].item()  # m_0 (kv_idx - q_idx = 1)
    heads = inferred_heads(slope0)
    if heads is None:
        _fail(f"{slope0:.4g}", "head 0's bias at kv_idx - q_idx = 1", "the bias has the wrong sign: m_h (q_idx - kv_idx) "
              "rewards distant keys" if slope0 < 0 else "the slopes are not ALiBi's geometric 2^(-8 (h+1) / H)",
              None, None, (1, 1, 1, 2), expected_text="a slope 2^(-8/H) for some number of heads H (0.5 for 8 heads, "
                                                     "0.25 for 4, 0.7071 for 16)")
    return heads


@prop("score-mod-statement", family="flex",
      statement="the score_mod computes the statement named with --expect-score: alibi, softcap:C or relative-bias",
      conventions=("score-mod",), cases={"masks": ("none",), "dtypes": ("float64", "float32")},
      examples=[Case(n_q=4, n_kv=4, d_k=1, d_v=1), Case(batch=(2,), n_q=3, n_kv=5, d_k=1, d_v=1, dtype="float32", seed=1)],
      lesson=Lesson(unicode="alibi: s + m_h (kv − q), m_h = 2^(−8(h+1)/H);   softcap:C: C · tanh(s / C);   relative-bias: s + f_h(kv − q)",
                    latex=r"s + m_h (kv - q),\ m_h = 2^{-8(h+1)/H};\quad C \tanh(s / C);\quad s + f_h(kv - q)",
                    check="Evaluates the score_mod as FlexAttention does over every index and a grid of scores (float64 and"
                          " float32), against the statement within a budget from the statement computed in the same dtype.",
                    example="score-mod"))
def score_mod_statement(target, case):
    """score_mod(s, b, h, q_idx, kv_idx) = statement(s, h, q_idx, kv_idx) over every index and a grid of scores.

    alibi: s + m_h (kv_idx - q_idx), m_h = 2^(-8 (h+1) / H); softcap:C: C tanh(s / C);
    relative-bias: s + f_h(kv_idx - q_idx) for some f (the bias depends only on the head and the
    distance, never on the score, the batch or the absolute position). Why: a score_mod changes
    every score FlexAttention computes, and nothing downstream can tell a wrong bias from a learned
    one. Catches: tanh without the cap factor, the cap not dividing the score, ALiBi's sign flipped
    or slopes reversed, a bias that replaces the score, a "relative" bias that reads absolute positions.
    """
    statement = target.statement
    if statement is None:
        raise Unsupported(f"no statement named: --expect-score {SCORE_FORMS}", total=True)
    B, H, n_q, n_kv = _sizes(case)
    dtype = case.torch_dtype
    if statement.name == "relative-bias":
        return _relative_bias(target, _grid(B, H, n_q, n_kv, 4.0, case.seed), dtype)
    if statement.name == "softcap":
        scores = _grid(B, H, n_q, n_kv, 4 * statement.arg, case.seed)
        got, expected, naive, candidates = _softcap(target, scores, statement.arg, dtype)
    else:
        heads = _alibi_heads(target, statement)
        got, expected, naive, candidates = _alibi(target, _grid(B, heads, n_q, n_kv, 4.0, case.seed), heads, dtype)
    allowed = _budget(naive, expected)
    err = max_error(got, expected)
    if err > allowed:
        cause = next((text for text, near in candidates if max_error(got, near) <= allowed),
                     f"the score_mod does not compute {statement.text}")
        index = (~((got.double() - expected).abs() <= allowed)).nonzero()[0].tolist()  # NaN counts as wrong
        _fail(f"{got[tuple(index)].item():.6g} (max error {err:.3g}, budget {allowed:.3g})",
              f"the score_mod at (b, h, q_idx, kv_idx) = {tuple(index)}, head {index[1]} shown", cause,
              got[index[0], index[1]], expected[index[0], index[1]], got.shape,
              expected_text=f"{expected[tuple(index)].item():.6g} under {statement.text}",
              labels=(f"the score_mod's scores at b={index[0]}, h={index[1]}", f"the scores {statement.text} gives"))


def _relative_bias(target, scores, dtype):
    """The added bias depends only on (h, kv_idx - q_idx): the same for any score, any b, along each diagonal.

    The bias is read as score_mod(s) - s, so two readings of one bias differ by the rounding of an addition and a
    subtraction of numbers as large as the scores and the bias: the budget is FACTOR x FLOOR_ULPS ulps of those."""
    bias = target.scores(scores.to(dtype)).double() - scores  # [B, H, Tq, Tk]
    moved = target.scores((scores + 1.5).to(dtype)).double() - (scores + 1.5)
    allowed = FACTOR * earned(0.0, eps(dtype) * max(1.0, scores.abs().max().item(), bias.abs().max().item()))
    sizes = tuple(bias.shape)
    if max_error(moved, bias) > allowed:
        _fail(f"max difference {max_error(moved, bias):.3g}", "score_mod(s + 1.5) - (s + 1.5) against score_mod(s) - s",
              "the bias depends on the score: the score_mod is not score + bias(h, kv_idx - q_idx)", moved[0, 0],
              bias[0, 0], sizes, expected_text=f"the same bias (budget {allowed:.3g})",
              labels=("score_mod(s + 1.5) - (s + 1.5), element 0, head 0", "score_mod(s) - s, element 0, head 0"))
    if max_error(bias, bias[:1].expand_as(bias)) > allowed:
        _fail(f"max difference {max_error(bias, bias[:1].expand_as(bias)):.3g}", "the bias of each batch element "
              "against element 0", "the bias depends on the batch index b, not only on the head and the distance",
              bias[-1, 0], bias[0, 0], sizes, expected_text=f"the same bias (budget {allowed:.3g})",
              labels=(f"the bias of element {sizes[0] - 1}, head 0", "the bias of element 0, head 0"))
    along = bias[..., 1:, 1:] - bias[..., :-1, :-1]  # (q+1, kv+1) against (q, kv): same distance
    if along.numel() and along.abs().max().item() > allowed:
        b, h, i, j = (along.abs() > allowed).nonzero()[0].tolist()
        _fail(f"differs by {along[b, h, i, j].item():.3g}", f"the bias at (q_idx, kv_idx) = ({i + 1}, {j + 1}) against "
              f"({i}, {j}), the same distance kv_idx - q_idx = {j - i}", "the bias depends on the absolute positions, "
              "not only on kv_idx - q_idx", bias[b, h], None, sizes, expected_text=f"the same bias (budget {allowed:.3g})",
              labels=(f"the bias score_mod(s) - s at b={b}, h={h}", ""))
