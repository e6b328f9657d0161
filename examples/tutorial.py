# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # From a blank function to a conforming multi-head attention
#
# We write scaled dot-product attention step by step, the way most of us first do, and run
# **attn-spec** after each step. Every step makes one classic mistake; the kit names the
# property it breaks and the likely cause. Run it as a notebook (jupytext) or as a script:
# `python examples/tutorial.py`.
#
# The formula we are aiming for: $\mathrm{Attention}(Q, K, V) = \mathrm{softmax}\left(\frac{QK^\top}{\sqrt{d_k}}\right)V$,
# with a bool mask where `True` means "may attend".

# %%
import math

import torch

import attn_spec

SEED = 7  # a fixed seed: the same counterexamples every run
FUNCTION_PROPERTIES = ["rows-sum-to-one", "scale-sqrt-dk", "mask-semantics", "causal-mask"]
MODULE_PROPERTIES = ["head-concat-equivalence", "permutation-equivariance", "scale-sqrt-dk"]


def run_kit(target, only, step):
    """Print the step's title, run the quick profile on the CPU and print the verdict and the failures' headlines."""
    print(f"\n## {step}")
    report = attn_spec.check(target, profile="quick", seed=SEED, only=only, devices=["cpu"])
    for result in report.targets[0].properties:
        if result.status == "fail" and not result.blocked_by:
            print(f"FAIL {result.id}: {result.message}\n     likely cause: {result.cause}")
        elif result.status == "fail":
            print(f"FAIL {result.id} (blocked by {result.blocked_by})")
    print("verdict:", "CONFORMS" if report.conforms else "DOES NOT CONFORM")
    return report

# %% [markdown]
# ## Step 1: no scale
#
# The first attempt multiplies queries by keys and takes a softmax over the keys. It forgets to
# divide by $\sqrt{d_k}$. Expect **scale-sqrt-dk** to fail with "scores are scaled by 1 (no scaling)".


# %%
def attention_v1(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1)  # bug: no 1/sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ V


run_kit(attention_v1, FUNCTION_PROPERTIES, "Step 1: no scale")

# %% [markdown]
# ## Step 2: the softmax over the wrong axis
#
# Scaled now, but the softmax runs over `dim=-2`, the queries. Each *column* sums to 1 instead of
# each row. Expect **rows-sum-to-one** to fail ("weights sum over queries, not keys"). Its
# side effects show up elsewhere too: causal-mask and scale-sqrt-dk fail, and mask-semantics is
# reported as blocked by rows-sum-to-one: fix the first failure first.


# %%
def attention_v2(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-2) @ V  # bug: normalises over the queries


run_kit(attention_v2, FUNCTION_PROPERTIES, "Step 2: the softmax over the wrong axis")

# %% [markdown]
# ## Step 3: mask polarity
#
# Softmax fixed. Now the mask: `masked_fill(mask, -inf)` fills the positions where the mask is
# `True`, which in our convention are the keys a query *may* attend. Expect **causal-mask** to fail
# (queries see future keys) and **rows-sum-to-one** too: a query whose only allowed key gets
# masked has no key left, all its scores are -inf, and softmax gives NaN.


# %%
def attention_v3(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))  # bug: True means "may attend"
    return scores.softmax(dim=-1) @ V


run_kit(attention_v3, FUNCTION_PROPERTIES, "Step 3: mask polarity")

# %% [markdown]
# ## Step 4: the fixed function
#
# Scale, axis and polarity right: the seed's function, written once in `examples/seed_attention.py`
# (open it beside this script, or run `attention??` in Jupyter). Expect **CONFORMS**.


# %%
from seed_attention import attention  # noqa: E402 - the seed's function, as a learner writes it

run_kit(attention, FUNCTION_PROPERTIES, "Step 4: the fixed function")

# %% [markdown]
# ## Step 5: multi-head, heads split without a transpose
#
# A module with `W_Q`, `W_K`, `W_V`, `W_O` (the kit loads its own weights into them). The heads are
# split with `view(h, n, d_k)` directly: that reinterprets memory laid out as `[n, h, d_k]`, so
# tokens and heads get mixed. Expect **head-concat-equivalence** to fail ("heads are split and merged
# with view and no transpose") and **permutation-equivariance** too: outputs now depend on token
# positions. (The scale probe, which reads each head's first column, is thrown off as well.)


# %%
class MultiHeadNoTranspose(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.h, self.d_k = n_heads, d_model // n_heads
        self.W_Q, self.W_K, self.W_V, self.W_O = (torch.nn.Linear(d_model, d_model, bias=False) for _ in range(4))

    def split(self, t):  # [n, d_model] -> [h, n, d_k]
        return t.reshape(self.h, t.size(0), self.d_k)  # bug: should be view(n, h, d_k).transpose(0, 1)

    def merge(self, t):  # [h, n, d_k] -> [n, d_model]
        return t.reshape(t.size(1), -1)  # bug: the matching wrong merge

    def forward(self, x_q, x_kv, mask=None):
        heads = attention(self.split(self.W_Q(x_q)), self.split(self.W_K(x_kv)), self.split(self.W_V(x_kv)), mask)
        return self.W_O(self.merge(heads))


run_kit(MultiHeadNoTranspose, MODULE_PROPERTIES, "Step 5: multi-head, heads split without a transpose")

# %% [markdown]
# ## Step 6: the conforming multi-head module
#
# Split with `view(n, h, d_k).transpose(0, 1)`, merge with the inverse: the seed's module, in
# `examples/seed_attention.py` beside its function. Expect **CONFORMS**.


# %%
from seed_attention import MultiHeadAttention  # noqa: E402 - the seed's module

report = run_kit(MultiHeadAttention, MODULE_PROPERTIES, "Step 6: the conforming multi-head module")

# %% [markdown]
# In a notebook, `report` alone renders the HTML report with heatmaps (`Report._repr_html_`);
# `print(report)` gives the text report, and `attn-spec explain head-concat-equivalence` the lesson
# behind any property.
