"""``attn-spec explain``: one property as a lesson.

Sections, in order: the statement in math (unicode for a terminal, LaTeX for markdown), why it
holds and matters, what breaks it, a worked example with numbers computed now by
``attn_spec.reference``, how the kit checks it on a black box, and (for five properties) the
sympy derivation registered beside it with ``@derivation``. The math, "Why:" and "Catches:"
come from the property's docstring, the rest from its :class:`~attn_spec.checking.catalog.Lesson`:
both live beside the check, in the property's family module under ``properties/``.
"""
from __future__ import annotations

import functools
import textwrap

import torch

from attn_spec import reference

F64 = torch.float64
SECTIONS = ("statement", "why", "breaks", "example", "check")
TITLES = {"statement": "Statement", "why": "Why it holds, and why it matters", "breaks": "What breaks it",
          "example": "Worked example (computed now by attn_spec.reference)",
          "check": "How the kit checks it on a black box", "derivation": "Derivation (sympy)"}


def _doc_parts(doc: str) -> tuple[str, str, str]:
    """(math, why, catches) paragraphs of a property docstring written as 'math. Why: ... Catches: ...'."""
    why_at, catches_at = doc.find("Why:"), doc.find("Catches:")
    end_math = min(i for i in (why_at, catches_at, len(doc)) if i >= 0)
    why = doc[why_at + 4:catches_at if catches_at > why_at else len(doc)] if why_at >= 0 else ""
    catches = doc[catches_at + 8:] if catches_at >= 0 else ""
    parts = (" ".join(part.split()) for part in (doc[:end_math], why, catches))
    return tuple(part[:1].upper() + part[1:] for part in parts)


def lesson_sections(property_id: str) -> dict:
    """The sections of one property's lesson as plain data; KeyError for an unknown id."""
    from attn_spec.checking.catalog import Lesson
    from attn_spec.properties import catalog

    prop = catalog()[property_id]
    lesson = prop.lesson or Lesson(unicode="", latex="", check="", example="")
    math_text, why, catches = _doc_parts(prop.doc)
    example = EXAMPLES.get(lesson.example)
    return {"id": prop.id, "family": prop.family, "title": prop.statement, "conventions": list(prop.conventions),
            "unicode": lesson.unicode, "latex": lesson.latex, "math": math_text, "why": why or lesson.why,
            "breaks": catches, "check": lesson.check, "example": example() if example else ""}


def _pretty(expr, markdown: bool) -> str:
    import sympy as sp

    if markdown:
        return f"$$\n{sp.latex(expr)}\n$$"
    text = sp.pretty(expr, use_unicode=True, wrap_line=False)
    return text if max(map(len, text.splitlines())) <= 140 else textwrap.shorten(sp.sstr(expr), 300)


@functools.lru_cache(maxsize=None)
def derivation_steps(property_id: str) -> tuple:
    """The steps of the property's sympy derivation (run once per process), or () if it has none."""
    from attn_spec.properties import catalog

    derive = catalog()[property_id].derivation if property_id in catalog() else None
    return tuple(derive()) if derive else ()


def derivation_text(property_id: str, markdown: bool = False) -> str:
    """The numbered steps of the property's sympy derivation, or '' if it has none."""
    lines = []
    for n, (text, expr) in enumerate(derivation_steps(property_id), 1):
        lines.append(f"{n}. {text}")
        lines.append(textwrap.indent(_pretty(expr, markdown), "   "))
    return "\n".join(lines)


def render(property_id: str, fmt: str = "text") -> str:
    """The whole lesson as terminal text (``fmt="text"``) or markdown with LaTeX (``fmt="markdown"``)."""
    e, md = lesson_sections(property_id), fmt == "markdown"
    sections = dict(e)
    sections["statement"] = (f"$$\n{e['latex']}\n$$\n\n{e['math']}" if md else f"{e['unicode']}\n\n{e['math']}")
    derivation = derivation_text(property_id, md)
    out = [f"# {e['id']}\n\n{e['title']}\n\nfamily: {e['family']} · conventions: {', '.join(e['conventions'])}"
           if md else f"{e['id']}: {e['title']}\nfamily: {e['family']} · conventions: {', '.join(e['conventions'])}"]
    for key in SECTIONS + (("derivation",) if derivation else ()):
        body = derivation if key == "derivation" else sections[key]
        if key == "example" and md:
            body = f"```\n{body}\n```"
        if md:
            out.append(f"## {TITLES[key]}\n\n{body}")
        else:
            wrapped = body if key in ("example", "derivation", "statement") else textwrap.fill(body, 96)
            out.append(f"{TITLES[key]}\n{textwrap.indent(wrapped, '  ')}")
    return "\n\n".join(out) + "\n"


# Worked examples: tiny inputs, numbers computed live by the reference.

def _t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=F64)


Q, K, V = _t([[1.0, 0.0], [0.0, 2.0]]), _t([[1.0, 1.0], [0.0, -1.0]]), _t([[1.0, 2.0], [3.0, 4.0]])


def _m(name: str, t: torch.Tensor) -> str:
    rows = t.reshape(-1, t.shape[-1]).tolist() if t.dim() > 1 else [t.tolist()]
    body = ", ".join("[" + ", ".join(f"{x:.4g}" for x in r) + "]" for r in rows)
    return f"{name} = [{body}]"


def _inputs() -> list[str]:
    return [_m("Q", Q), _m("K", K), _m("V", V), "d_k = 2, scale = 1/√2"]


def _ex_weights() -> str:
    out, w = reference.attention(Q, K, V)
    return "\n".join(_inputs() + [_m("scores = Q Kᵀ/√2", Q @ K.T / 2 ** 0.5), _m("A = softmax(scores)", w),
                                  _m("row sums of A", w.sum(-1))])


def _ex_output() -> str:
    out, w = reference.attention(Q, K, V)
    return "\n".join(_inputs() + [_m("A", w), _m("out = A V", out)])


def _ex_causal() -> str:
    mask = reference.causal_mask(2, 2)
    out, w = reference.attention(Q, K, V, mask)
    return "\n".join(_inputs() + [_m("causal mask (True = may attend)", mask.double()), _m("A", w),
                                  _m("out", out) + "   (row 0 is V[0] exactly: query 0 sees key 0 only)"])


def _ex_mask() -> str:
    mask = torch.tensor([[False, True], [True, True]])
    out, w = reference.attention(Q, K, V, mask)
    v2 = V.clone()
    v2[0] = 1e6  # a masked value for query 0
    out2, _ = reference.attention(Q, K, v2, mask)
    return "\n".join(_inputs() + [_m("mask", mask.double()), _m("A", w), _m("out", out),
                                  _m("out with V[0] = 1e6", out2) + "   (row 0 unchanged: key 0 is masked for it)"])


def _ex_permutation() -> str:
    out, _ = reference.attention(Q, K, V)
    swapped, _ = reference.attention(Q.flip(0), K, V)
    same, _ = reference.attention(Q, K.flip(0), V.flip(0))
    return "\n".join(_inputs() + [_m("out", out), _m("out with the queries swapped", swapped) + "   (rows swap)",
                                  _m("out with keys and values swapped together", same) + "   (unchanged)"])


def _ex_scale() -> str:
    q, k, v = _t([[1.0, 0, 0, 0]]), _t([[0.0, 0, 0, 0], [2.0, 0, 0, 0]]), torch.eye(2, dtype=F64)
    _, w = reference.attention(q, k, v)
    _, unscaled = reference.attention(q, k, v, scale=1.0)
    return "\n".join([_m("q", q), _m("k", k) + "   (d_k = 4, raw scores 0 and 2 = √d_k)",
                      _m("A with scale 1/√4", w) + "   (σ(1) = 0.7311)",
                      _m("A with no scale", unscaled) + "   (σ(2): sharper, and worse as d_k grows)"])


def _ex_shapes() -> str:
    q, k, v = _t([[1.0, 0], [0, 1]]), _t([[1.0, 0], [0, 1], [1, 1]]), _t([[1.0], [2.0], [3.0]])
    out, w = reference.attention(q, k, v)
    return "\n".join([_m("Q [2, 2]", q), _m("K [3, 2]", k), _m("V [3, 1]", v), _m("A [2, 3]", w),
                      _m(f"out {list(out.shape)}", out) + "   (n_q rows, d_v columns)"])


def _ex_shift() -> str:
    c = _t([5.0, -3.0])
    out, w = reference.attention(Q, K, V)
    out2, w2 = reference.attention(Q, K + c, V)
    return "\n".join(_inputs() + [_m("c", c), _m("A", w), _m("A with K + c", w2),
                                  f"max |out(K + c) − out(K)| = {(out2 - out).abs().max().item():.2g}"])


def _ex_linearity() -> str:
    v2 = _t([[0.0, -1.0], [2.0, 5.0]])
    out1, out2 = reference.attention(Q, K, V)[0], reference.attention(Q, K, v2)[0]
    mixed = reference.attention(Q, K, 2 * V - v2)[0]
    return "\n".join(_inputs() + [_m("V₂", v2), _m("attn(Q, K, 2V − V₂)", mixed),
                                  _m("2 attn(Q, K, V) − attn(Q, K, V₂)", 2 * out1 - out2),
                                  "each output lies between the smallest and largest V entry of its column"])


def _ex_stability() -> str:
    q = Q * 400  # scores up to ~800: exp overflows even in float64
    out, w = reference.attention(q, K, V)
    naive = torch.exp(q @ K.T / 2 ** 0.5)
    return "\n".join([_m("Q × 400", q), _m("exp(scores), no max subtracted", naive),
                      _m("naive weights exp/Σexp", naive / naive.sum(-1, keepdim=True)) + "   (inf/inf = nan)",
                      _m("A (max subtracted first)", w), _m("out", out)])


def _ex_batch() -> str:
    q = torch.stack([Q, Q * 3])  # [2, 2, 2]
    batched = reference.attention(q, K, V)[0]
    alone = torch.stack([reference.attention(x, K, V)[0] for x in q])
    return "\n".join(_inputs() + ["Q batch = [Q, 3Q] (shape [2, 2, 2])", _m("batched out", batched),
                                  f"max |batched − each alone| = {(batched - alone).abs().max().item():.2g}"])


def _ex_dtype() -> str:
    out = reference.reference_attention(Q.float(), K.float(), V.float())
    return "\n".join(_inputs() + [f"inputs float32 → output {out.dtype}, device {out.device}", _m("out", out)])


def _ex_strided() -> str:
    k_t = K.T.contiguous().T  # same values, column-major storage
    out, out2 = reference.attention(Q, K, V)[0], reference.attention(Q, k_t, V)[0]
    return "\n".join(_inputs() + [f"K.stride() = {K.stride()}, transposed copy stride = {k_t.stride()}",
                                  _m("out", out), f"max |out(strided K) − out| = {(out2 - out).abs().max().item():.2g}"])


def _ex_gqa() -> str:
    q = torch.stack([Q, Q.flip(0)])  # [Hq=2, 2, 2]
    k, v = K[None], V[None]  # [Hkv=1, 2, 2]
    out = reference.attention(q, reference.repeat_kv(k, 2), reference.repeat_kv(v, 2))[0]
    return "\n".join(_inputs() + ["2 query heads [Q, Q flipped] share 1 K/V head (g = 2)",
                                  _m("out, head 0 and head 1", out) + "   (each head reads KV head h // g = 0)"])


def _ex_gradients() -> str:
    _, w = reference.attention(Q, K, V)
    a = w[0]
    jac = torch.diag(a) - torch.outer(a, a)
    g = _t([[1.0, 0.0], [0.0, 1.0]])
    return "\n".join(_inputs() + [_m("a = A[0]", a), _m("∂a/∂s = diag(a) − a aᵀ", jac) + "   (rows sum to 0)",
                                  _m("G", g), _m("dV = Aᵀ G", w.T @ g)])


def _ex_scale_arg() -> str:
    _, w = reference.attention(Q, K, V, scale=-0.5)
    _, w1 = reference.attention(Q, K, V, scale=1.0)
    return "\n".join(_inputs() + [_m("A with scale = −0.5", w) + "   (a negative scale prefers the smallest score)",
                                  _m("A with scale = 1", w1)])


def _ex_multihead() -> str:
    x = _t([[1.0, 0.5], [-1.0, 2.0]])
    eye = torch.eye(2, dtype=F64)
    w_o = _t([[1.0, 2.0], [0.0, 1.0]])
    out, w = reference.multihead(x, x, eye, eye, eye, w_o, 2)
    heads = [reference.attention(x[:, i:i + 1], x[:, i:i + 1], x[:, i:i + 1])[0] for i in range(2)]
    concat = torch.cat(heads, dim=-1) @ w_o.T
    return "\n".join([_m("x", x), "d_model = 2, h = 2 heads of width 1, W_Q = W_K = W_V = I", _m("W_O", w_o),
                      _m("head 0 weights", w[0]), _m("head 1 weights", w[1]), _m("MHA(x)", out),
                      _m("Concat(head₀, head₁) W_Oᵀ", concat)])


def _ex_window() -> str:
    q = k = _t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    v = _t([[1.0], [2.0], [3.0]])
    out, w = reference.attention(q, k, v, window=2)
    return "\n".join([_m("Q = K", q), _m("V", v), _m("window of w = 2 keys (True = may attend)",
                                                     reference.causal_mask(3, 3, window=2).double()),
                      _m("A", w) + "   (query 2 sees keys 1 and 2, not key 0)", _m("out", out)])


def _ex_softcap() -> str:
    q = Q * 4  # scores up to about 11
    _, w = reference.attention(q, K, V)
    _, capped = reference.attention(q, K, V, softcap=2.0)
    s = q @ K.T / 2 ** 0.5
    return "\n".join([_m("Q × 4", q), _m("scores s", s), _m("2 · tanh(s / 2)", 2 * torch.tanh(s / 2)) + "   (in (−2, 2))",
                      _m("A without a cap", w), _m("A with softcap = 2", capped) + "   (flatter: no score exceeds 2)"])


def _ex_mask_mod() -> str:
    causal = reference.causal_mask(3, 3)
    strict = causal & ~torch.eye(3, dtype=torch.bool)  # kv_idx < q_idx
    _, w = reference.attention(Q[:1].expand(3, 2), K[:1].expand(3, 2), V[:1].expand(3, 2), causal)
    return "\n".join([_m("causal: kv_idx <= q_idx", causal.double()), _m("written with <: kv_idx < q_idx", strict.double())
                       + "   (row 0 keeps no key)", _m("A under the causal mask, equal scores", w),
                       "under the strict mask query 0 attends nothing: FlexAttention gives it 0.0, SDPA NaN"])


def _ex_score_mod() -> str:
    slopes = 2.0 ** (-8.0 * torch.arange(1, 3, dtype=F64) / 2)  # 2 heads
    distance = (torch.arange(3)[None, :] - torch.arange(3)[:, None]).double()  # kv_idx - q_idx
    return "\n".join([_m("ALiBi slopes m_h for H = 2", slopes), _m("kv_idx − q_idx", distance),
                      _m("head 0 bias m_0 (kv_idx − q_idx)", slopes[0] * distance) + "   (distant keys lose score)",
                      _m("softcap:2 of scores [−10, −1, 0, 1, 10]", 2 * torch.tanh(_t([-10.0, -1, 0, 1, 10]) / 2))])


def _ex_decode() -> str:
    return "\n".join([_m("decode: 2 new tokens over 4 keys, causal bottom-right (kv_idx <= 2 + q_idx)",
                          reference.causal_mask(2, 4, alignment="bottom-right").double()),
                       _m("the same aligned top-left (kv_idx <= q_idx): the new tokens lose the keys before them",
                          reference.causal_mask(2, 4).double()),
                       _m("out with q = 0 and V = [1, 2, 3, 4], bottom-right (the last 2 rows of full causal)",
                          _decode_means("bottom-right")),
                       _m("the same, top-left (what SDPA's is_causal gives)", _decode_means("top-left"))])


def _decode_means(alignment: str) -> torch.Tensor:
    """Two new tokens with q = 0 over 4 keys whose values are 1..4: each output is the mean of the keys it sees."""
    out, _ = reference.attention(torch.zeros(2, 1, dtype=F64), torch.zeros(4, 1, dtype=F64),
                                 torch.arange(1.0, 5.0, dtype=F64)[:, None], causal=True, causal_alignment=alignment)
    return out  # [2, 1]


def _ex_merge() -> str:
    scores = torch.tensor([0.0, 1.0, 2.0], dtype=F64)  # one query over 3 keys, V = [1, 2, 3]
    values = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    lse_a, lse_b = torch.logsumexp(scores[:1], 0), torch.logsumexp(scores[1:], 0)
    out_a, out_b = values[0], (torch.softmax(scores[1:], 0) * values[1:]).sum()
    lse = torch.logaddexp(lse_a, lse_b)
    merged = torch.exp(lse_a - lse) * out_a + torch.exp(lse_b - lse) * out_b
    return "\n".join([_m("scores of one query over 3 keys (V = [1, 2, 3]), split as {0} and {1, 2}", scores),
                       _m("(out, lse) of each part", torch.stack([torch.stack([out_a, lse_a]), torch.stack([out_b, lse_b])])),
                       _m("merged (out, lse)", torch.stack([merged, lse])),
                       _m("attention over all 3 keys (out, lse)", torch.stack([(torch.softmax(scores, 0) * values).sum(),
                                                                              torch.logsumexp(scores, 0)]))])


def _ex_dropout() -> str:
    gen = torch.Generator().manual_seed(0)
    kept = torch.rand(3, 4, generator=gen) >= 0.25  # [Tq=3, Tk=4]: p = 0.25
    return "\n".join([_m("weights with q = k = 0 (4 keys)", torch.full((3, 4), 0.25, dtype=F64)),
                       _m("one draw of dropout_p = 0.25: kept weights are 0.25 / (1 - 0.25) = 1/3",
                          kept.to(F64) * (0.25 / 0.75))])
def _ex_varlen() -> str:
    from attn_spec.serving_reference import segment_mask, varlen_reference

    mask = torch.zeros(3, 5, dtype=F64)  # a packed batch: sequence 0 is 2 queries over 3 keys, sequence 1 is 1 over 2
    mask[:2, :3], mask[2:, 3:] = segment_mask(2, 3, causal=True).double(), segment_mask(1, 2, causal=True).double()
    flat = reference.causal_mask(3, 5).double()
    q, k, v = torch.zeros(3, 1, 1, dtype=F64), torch.zeros(5, 1, 1, dtype=F64), torch.arange(1.0, 6.0, dtype=F64)
    out = [varlen_reference(q, k, v.reshape(5, 1, 1), cu_q, cu_k, causal=True, alignment=alignment)[0].flatten()
           for cu_q, cu_k, alignment in (([0, 2, 3], [0, 3, 5], "bottom-right"), ([0, 3], [0, 5], "top-left"))]
    return "\n".join([_m("cu_seqlens_q = [0, 2, 3], cu_seqlens_k = [0, 3, 5]: causal per sequence, bottom-right", mask),
                      _m("causal over packed positions, cu_seqlens ignored: query 2 sees sequence 0's keys", flat),
                      _m("out with q = 0 and V = [1, 2, 3, 4, 5], per sequence (each row the mean of the keys it sees)",
                         out[0]), _m("the same with cu_seqlens ignored", out[1])])


def _ex_alibi() -> str:
    from attn_spec.properties.alibi import bias

    added = bias((0.5,), 2, 4)[0]  # [2, 4]: one head, slope 0.5, 2 queries over 4 keys
    return "\n".join([_m("the bias -0.5 |i + 4 - 2 - j| (2 queries, 4 keys)", added),
                       _m("the weights with q = 0: softmax(bias)", torch.softmax(added, dim=-1))])


EXAMPLES = {"weights": _ex_weights, "output": _ex_output, "causal": _ex_causal, "mask": _ex_mask,
            "permutation": _ex_permutation, "scale": _ex_scale, "shapes": _ex_shapes, "shift": _ex_shift,
            "linearity": _ex_linearity, "stability": _ex_stability, "batch": _ex_batch, "dtype": _ex_dtype,
            "strided": _ex_strided, "gqa": _ex_gqa, "gradients": _ex_gradients, "scale-arg": _ex_scale_arg,
            "multihead": _ex_multihead, "window": _ex_window, "softcap": _ex_softcap, "mask-mod": _ex_mask_mod,
            "score-mod": _ex_score_mod, "decode": _ex_decode, "merge": _ex_merge,
            "dropout": _ex_dropout, "alibi": _ex_alibi,
            "varlen": _ex_varlen}
