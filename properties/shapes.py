"""The shapes family: the output's shape in cross-attention (n_q != n_kv, d_v != d_k).

Each function's docstring states the math, why it matters, and the bugs it catches.
"""
from __future__ import annotations

import torch

from attn_spec import reference
from attn_spec.checking.assertions import fail
from attn_spec.checking.cases import Case
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.properties.informative import require_responsive
from attn_spec.failures import because


@prop("cross-attention-shapes", family="shapes",
      statement="n_q != n_kv and d_v != d_k give output [..., n_q, d_v]", cases={"cross": True},
      at_scale="every property's call checks the output shape at such sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=2, d_v=1), Case(n_q=3, n_kv=1, d_k=1, d_v=2)],
      lesson=Lesson(unicode="Q ∈ ℝ^(n_q×d_k), K ∈ ℝ^(n_kv×d_k), V ∈ ℝ^(n_kv×d_v)  ⇒  attn(Q, K, V) ∈ ℝ^(n_q×d_v)",
                    latex=r"Q \in \mathbb{R}^{n_q\times d_k},\ K \in \mathbb{R}^{n_{kv}\times d_k},\ V \in \mathbb{R}^{n_{kv}\times d_v}"
                          r"\ \Rightarrow\ \mathrm{attn}(Q,K,V) \in \mathbb{R}^{n_q\times d_v}",
                    check="Draws rectangular cases (n_q ≠ n_kv, d_v ≠ d_k); the adapter checks the output shape and the "
                          "property that it is finite.",
                    example="shapes"))
def cross_attention_shapes(target, case):
    """out = softmax(Q K^T / sqrt(d_k)) V has shape [..., n_q, d_v] for any n_kv and d_k.

    Why: cross-attention (decoder queries over encoder keys) has as many outputs as queries
    and as wide as the values. Catches: K used for V, the output built from the key count,
    d_v assumed equal to d_k, a causal mask hard-coded for square shapes.
    """
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    out = target.attend(q, k, v, mask)  # shape checked by the adapter: [..., Tq, Dv]
    if not torch.isfinite(out).all():
        fail("NaN or inf", what="the output of a rectangular case", expected="finite values",
             call=f"attention(Q [{case.n_q}, {case.d_k}], K [{case.n_kv}, {case.d_k}], V [{case.n_kv}, {case.d_v}])",
             cause=because("nonfinite-shape", target=target, case=case), got=out,
             expected_tensor=reference.attention(q, k, v, mask)[0])
