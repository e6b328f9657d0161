"""Extra teaching text for ``attn-spec explain``, keyed by property id.

The property's docstring (in its own module) stays the source of the math, the "Why:" and the
"Catches:"; this table adds what a docstring cannot hold well: the statement typeset as
unicode (terminal) and LaTeX (markdown), how the kit checks it on a black box, and which live
worked example (``attn_spec.lessons.EXAMPLES``) illustrates it. ``why`` is used only when the
docstring has no "Why:" paragraph. ``tests/test_teaching.py`` fails if a registered property
has no entry here.
"""
from __future__ import annotations

EXPLANATIONS: dict[str, dict[str, str]] = {
    "rows-sum-to-one": {
        "unicode": "A = softmax(Q Kᵀ/√d_k),   Σⱼ Aᵢⱼ = 1,   Aᵢⱼ ≥ 0",
        "latex": r"A = \mathrm{softmax}\!\left(\frac{QK^\top}{\sqrt{d_k}}\right),\quad \sum_j A_{ij} = 1,\quad A_{ij} \ge 0",
        "check": "V = ones [Tk, 1] makes the output the row sums of the weights; V = identity reads the "
                 "weights themselves (attn_spec.checking.probes). Sums are compared with 1 within the calibrated budget.",
        "example": "weights",
    },
    "causal-mask": {
        "unicode": "Aᵢⱼ = 0 for j > i,   outᵢ depends on K₀..ᵢ, V₀..ᵢ only",
        "latex": r"A_{ij} = 0 \ \text{for}\ j > i,\qquad \mathrm{out}_i = f(Q_i, K_{\le i}, V_{\le i})",
        "check": "Reads the weights with V = identity under a causal mask and looks above the diagonal; then "
                 "changes K and V at future positions and checks earlier outputs do not move.",
        "example": "causal",
    },
    "permutation-equivariance": {
        "unicode": "attn(P Q, K, V) = P attn(Q, K, V),   attn(Q, S K, S V) = attn(Q, K, V)",
        "latex": r"\mathrm{attn}(PQ, K, V) = P\,\mathrm{attn}(Q, K, V),\quad \mathrm{attn}(Q, SK, SV) = \mathrm{attn}(Q, K, V)",
        "check": "Calls the target on permuted queries (and on keys and values permuted together) and compares "
                 "with the permuted (or unchanged) output of the original call.",
        "example": "permutation",
    },
    "scale-sqrt-dk": {
        "unicode": "scores = Q Kᵀ · 1/√d_k",
        "latex": r"S = \frac{QK^\top}{\sqrt{d_k}}",
        "check": "One query e₀ and two keys 0 and √d_k·e₀: raw score gap √d_k, so the weight on the second key "
                 "is σ(s·√d_k); V = [[0], [1]] reads it and s = logit(w)/√d_k is the scale applied.",
        "example": "scale",
    },
    "cross-attention-shapes": {
        "unicode": "Q ∈ ℝ^(n_q×d_k), K ∈ ℝ^(n_kv×d_k), V ∈ ℝ^(n_kv×d_v)  ⇒  attn(Q, K, V) ∈ ℝ^(n_q×d_v)",
        "latex": r"Q \in \mathbb{R}^{n_q\times d_k},\ K \in \mathbb{R}^{n_{kv}\times d_k},\ V \in \mathbb{R}^{n_{kv}\times d_v}"
                 r"\ \Rightarrow\ \mathrm{attn}(Q,K,V) \in \mathbb{R}^{n_q\times d_v}",
        "check": "Draws rectangular cases (n_q ≠ n_kv, d_v ≠ d_k); the adapter checks the output shape and the "
                 "property that it is finite.",
        "example": "shapes",
    },
    "head-concat-equivalence": {
        "unicode": "MHA(x_q, x_kv) = Concat(head₁, …, head_h) W_Oᵀ,   headᵢ = attn(x_q W_Qᵢᵀ, x_kv W_Kᵢᵀ, x_kv W_Vᵢᵀ)",
        "latex": r"\mathrm{MHA}(x_q, x_{kv}) = \mathrm{Concat}(\mathrm{head}_1,\dots,\mathrm{head}_h)\,W_O^\top,\quad "
                 r"\mathrm{head}_i = \mathrm{attn}(x_q W_{Q,i}^\top, x_{kv} W_{K,i}^\top, x_{kv} W_{V,i}^\top)",
        "check": "Loads chosen weights into the module (W_Q, W_K, W_V, W_O) and compares its forward with the "
                 "per-head float64 reference, concatenated and projected; h = 1 must be single-head attention.",
        "example": "multihead",
    },
    "matches-reference": {
        "unicode": "|attn(Q, K, V) − ref₆₄(Q, K, V)| ≤ k·|naive − ref₆₄| + floor",
        "latex": r"\left|\mathrm{attn}(Q,K,V) - \mathrm{ref}_{64}(Q,K,V)\right| \le k\,\left|\mathrm{naive} - \mathrm{ref}_{64}\right| + \mathrm{floor}",
        "check": "Compares the output with the float64 reference, elementwise, within a budget calibrated from "
                 "the error of two naive implementations in the same dtype (attn_spec.checking.tolerance).",
        "example": "output",
    },
    "mask-semantics": {
        "unicode": "Aᵢⱼ = 0 where maskᵢⱼ = False,   outᵢ = Σ_{j allowed} Aᵢⱼ Vⱼ",
        "latex": r"A_{ij} = 0 \ \text{where}\ \mathrm{mask}_{ij} = \mathrm{False},\qquad \mathrm{out}_i = \sum_{j\ \mathrm{allowed}} A_{ij} V_j",
        "check": "Reads the weights under a random mask, moves K and V at masked positions to huge values and "
                 "checks the output does not move, and compares a bool mask with the additive 0/−∞ mask.",
        "example": "mask",
    },
    "batch-independence": {
        "unicode": "out[b] = attn(Q[b], K[b], V[b], mask[b])   for every batch index b",
        "latex": r"\mathrm{out}[b] = \mathrm{attn}(Q[b], K[b], V[b], \mathrm{mask}[b])\quad \forall b",
        "check": "Runs each batch element alone and compares with its slice of the batched output; makes element 0 "
                 "huge and checks the others do not move; broadcasts K/V/mask with expand.",
        "example": "batch",
    },
    "value-linearity": {
        "unicode": "attn(Q, K, aV₁ + bV₂) = a·attn(Q, K, V₁) + b·attn(Q, K, V₂),   minⱼ Vⱼ ≤ outᵢ ≤ maxⱼ Vⱼ",
        "latex": r"\mathrm{attn}(Q,K,aV_1+bV_2) = a\,\mathrm{attn}(Q,K,V_1) + b\,\mathrm{attn}(Q,K,V_2),\quad \min_j V_j \le \mathrm{out}_i \le \max_j V_j",
        "check": "Calls the target with V₁, V₂ and a·V₁ + b·V₂ and compares; checks each output lies between the "
                 "smallest and largest allowed value.",
        "example": "linearity",
    },
    "key-shift-invariance": {
        "unicode": "attn(Q, K + 𝟙cᵀ, V) = attn(Q, K, V),   softmax(s + t·𝟙) = softmax(s)",
        "latex": r"\mathrm{attn}(Q, K + \mathbf{1}c^\top, V) = \mathrm{attn}(Q, K, V),\qquad \mathrm{softmax}(s + t\mathbf{1}) = \mathrm{softmax}(s)",
        "check": "Adds the same vector c to every key and compares the outputs within the budget.",
        "example": "shift",
    },
    "numerical-stability": {
        "unicode": "softmax(s)ⱼ = exp(sⱼ − maxₖ sₖ) / Σₗ exp(sₗ − maxₖ sₖ)   finite for |s| ≫ log(finfo.max)",
        "latex": r"\mathrm{softmax}(s)_j = \frac{e^{s_j - \max_k s_k}}{\sum_l e^{s_l - \max_k s_k}}\ \text{finite for}\ |s| \gg \log(\mathrm{finfo.max})",
        "check": "Scales some query rows so their largest score is far beyond exp's range in the dtype and compares "
                 "with the float64 reference, which subtracts the row max.",
        "example": "stability",
    },
    "determinism": {
        "unicode": "attn(X) ≡ attn(X)   bitwise, across calls",
        "latex": r"\mathrm{attn}(X) \equiv \mathrm{attn}(X)\ \text{(bitwise)}",
        "why": "Inference must be reproducible for evaluation, caching and debugging.",
        "check": "Calls the target twice on the same inputs, with a call on other inputs in between, and compares bitwise.",
        "example": "output",
    },
    "inputs-unchanged": {
        "unicode": "Q, K, V, mask after the call ≡ before the call",
        "latex": r"(Q, K, V, \mathrm{mask})_{\text{after}} \equiv (Q, K, V, \mathrm{mask})_{\text{before}}",
        "check": "Keeps copies of every input and compares them bitwise with the inputs after the call.",
        "example": "output",
    },
    "dtype-device": {
        "unicode": "attn(Q, K, V).dtype = Q.dtype,   attn(Q, K, V).device = Q.device",
        "latex": r"\mathrm{attn}(Q,K,V).\mathrm{dtype} = Q.\mathrm{dtype},\quad \mathrm{attn}(Q,K,V).\mathrm{device} = Q.\mathrm{device}",
        "check": "Draws cases in every dtype and device and compares the output's dtype and device with the inputs'.",
        "example": "dtype",
    },
    "non-contiguous": {
        "unicode": "attn(strided X) = attn(X.contiguous())",
        "latex": r"\mathrm{attn}(\text{strided } X) = \mathrm{attn}(X.\mathrm{contiguous}())",
        "check": "Builds the same values as a transpose, a slice of a NaN-filled buffer and a stride-0 expand, and "
                 "compares with the contiguous call.",
        "example": "strided",
    },
    "long-sequences": {
        "unicode": "|attn(Q, K, V) − ref₆₄| ≤ budget   for n_kv in the hundreds or thousands, d_k ≤ 256",
        "latex": r"\left|\mathrm{attn}(Q,K,V) - \mathrm{ref}_{64}\right| \le \mathrm{budget}\ \text{for large}\ n_{kv},\ d_k \le 256",
        "check": "Draws four times as many keys as usual (and wide heads) and compares with the reference.",
        "example": "output",
    },
    "gqa-equivalence": {
        "unicode": "attn(Q[g·H_kv heads], K[H_kv], V[H_kv]) = attn(Q, K′, V′),   K′ = repeat_interleave(K, g)",
        "latex": r"\mathrm{attn}(Q_{[gH_{kv}]}, K_{[H_{kv}]}, V_{[H_{kv}]}) = \mathrm{attn}(Q, K', V'),\quad K' = \mathrm{repeat\_interleave}(K, g)",
        "check": "Calls the target with fewer K/V heads than query heads and compares with the call on K/V "
                 "repeated with repeat_interleave; a target that refuses unequal head counts is skipped.",
        "example": "gqa",
    },
    "gradients": {
        "unicode": "∂A/∂s = diag(a) − a aᵀ,   dV = Aᵀ G,   dS = A ⊙ (G Vᵀ − rowsum(A ⊙ G Vᵀ)),   dQ = dS K/√d_k",
        "latex": r"\frac{\partial a}{\partial s} = \mathrm{diag}(a) - a a^\top,\quad dV = A^\top G,\quad "
                 r"dS = A \odot (G V^\top - \mathrm{rowsum}(A \odot G V^\top)),\quad dQ = \frac{dS\,K}{\sqrt{d_k}}",
        "check": "Asks the target for a vector-Jacobian product (target.vjp) with a random G and compares dQ, dK, "
                 "dV with the closed form; in float64 also with finite differences of its own forward along random "
                 "directions; no gradient may reach future keys under a causal mask.",
        "example": "gradients",
    },
    "scale-argument": {
        "unicode": "attn(Q, K, V, scale=s) = softmax(s · Q Kᵀ) V",
        "latex": r"\mathrm{attn}(Q,K,V,\mathrm{scale}=s) = \mathrm{softmax}(s\,QK^\top)\,V",
        "check": "Passes explicit scales (including negative ones) and compares with the reference at that scale.",
        "example": "scale-arg",
    },
    "is-causal": {
        "unicode": "attn(Q, K, V, is_causal=True) = attn(Q, K, V, mask = [j ≤ i + offset])",
        "latex": r"\mathrm{attn}(Q,K,V,\mathrm{is\_causal}) = \mathrm{attn}(Q,K,V,\mathrm{mask}=[j \le i + \mathrm{offset}])",
        "why": "A flag is how fused kernels are told to be causal without a mask tensor; if it is ignored or "
               "built for square shapes only, a decoder silently sees the future.",
        "check": "Calls the target with is_causal=True and compares with an explicit top-left and bottom-right "
                 "causal mask; which one matches is reported as a convention.",
        "example": "causal",
    },
    "devices-agree": {
        "unicode": "|attn_dev(Q, K, V) − attn_cpu(Q, K, V)| ≤ 2 · budget",
        "latex": r"\left|\mathrm{attn}_{\mathrm{dev}}(Q,K,V) - \mathrm{attn}_{\mathrm{cpu}}(Q,K,V)\right| \le 2\,\mathrm{budget}",
        "check": "Draws inputs on each non-CPU device, copies them to the CPU, and compares the two outputs.",
        "example": "output",
    },
}
