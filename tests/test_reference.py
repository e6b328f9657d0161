"""The float64 reference (``attn_spec.reference``) against PyTorch's scaled_dot_product_attention,
hand-built masks, a per-head loop, and the exact sympy oracle (``attn_spec.exact``)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attn_spec.exact import exact_attention
from attn_spec.reference import MultiHeadAttention, attention, causal_mask, multihead, reference_attention
from attn_spec.reference import scores as reference_scores

F64 = torch.float64
EPS = torch.finfo(F64).eps
FAST = settings(max_examples=40, deadline=None, database=None)


def error_bound(q, k, v, mask=None, *, scale=None) -> float:
    """First-order bound on the float64 rounding error of softmax(scale Q K^T + B) V, any evaluation order.

    With u = eps/2, S = scale * max_ij sum_d |Q_id K_jd| and B = max |finite bias|:
    - scores: the dot product (d_k u S), computing and applying the scale, in either order
      (after the product, or sqrt(scale) folded into Q and K): |ds| <= (d_k + 6) u S, and
      adding the bias + u (S + B);
    - softmax: sum_j |dw_j| <= 2 max|ds| + u sum_j w_j |s_j - m| (<= n_kv u) + exp, sum and
      division (n_kv + 2) u;
    - output: the weighted sum of V rows adds n_kv u max|V|.
    Total, in eps = 2u: max|V| eps ((d_k + 6) S + B + 1.5 n_kv + 1).
    """
    d_k, n_kv = q.shape[-1], k.shape[-2]
    scale = 1 / math.sqrt(d_k) if scale is None else abs(scale)
    s = scale * (q.abs() @ k.abs().transpose(-2, -1)).max().item()  # S
    b = 0.0
    if mask is not None and mask.dtype != torch.bool and mask.isfinite().any():
        b = mask[mask.isfinite()].abs().max().item()
    return EPS * v.abs().max().item() * ((d_k + 6) * s + b + 1.5 * n_kv + 1)


@dataclass
class Inputs:
    """One attention input built from a seed; ``mask`` is None, bool (True = attend) or additive float."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    causal: bool = False
    scale: float | None = None

    @classmethod
    def build(cls, seed=0, *, n_q=3, n_kv=4, d_k=5, d_v=2, batch_q=(), batch_k=(), batch_v=(),
              mask=None, mask_batch=(), causal=False, scale=None, magnitude=1.0):
        gen = torch.Generator().manual_seed(seed)

        def randn(*shape):
            return torch.randn(shape, generator=gen, dtype=F64) * magnitude

        q, k, v = randn(*batch_q, n_q, d_k), randn(*batch_k, n_kv, d_k), randn(*batch_v, n_kv, d_v)
        m = None
        if mask is not None:
            shape = tuple(mask_batch) + (n_q, n_kv)
            keep = torch.randint(0, n_kv, shape[:-1] + (1,), generator=gen)  # [..., Tq, 1] a key every row keeps
            if causal:  # ... and that key is not in the query's future
                keep = torch.minimum(keep, torch.arange(n_q)[:, None])
            allowed = (torch.rand(shape, generator=gen) < 0.6).scatter(-1, keep, True)  # [..., Tq, Tk]
            m = allowed if mask == "bool" else (2 * torch.randn(shape, generator=gen, dtype=F64)).masked_fill(
                ~allowed, -math.inf)
        return cls(q, k, v, m, causal, scale)

    def sdpa_mask(self):
        """The mask with the causal rule folded in by hand (top-left: query i sees keys j <= i)."""
        n_q, n_kv = self.q.shape[-2], self.k.shape[-2]
        tril = torch.ones(n_q, n_kv, dtype=torch.bool).tril()  # [Tq, Tk]
        if not self.causal:
            return self.mask
        if self.mask is None:
            return tril
        return self.mask & tril if self.mask.dtype == torch.bool else self.mask.masked_fill(~tril, -math.inf)

    def reference(self):
        return attention(self.q, self.k, self.v, self.mask, causal=self.causal, scale=self.scale)

    def sdpa(self, v=None):
        """torch's SDPA on explicitly expanded inputs (no reliance on its broadcasting)."""
        v = self.v if v is None else v
        batch = torch.broadcast_shapes(self.q.shape[:-2], self.k.shape[:-2], v.shape[:-2],
                                       () if self.mask is None else self.mask.shape[:-2])
        q, k, v = (t.expand(batch + t.shape[-2:]) for t in (self.q, self.k, v))
        mask = None if self.mask is None else self.sdpa_mask().expand(batch + self.mask.shape[-2:])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                              is_causal=self.causal and mask is None)

    def bound(self, v=None):
        return error_bound(self.q, self.k, self.v if v is None else v, self.mask, scale=self.scale)


@st.composite
def inputs(draw, max_len=7, max_dim=9, max_batch=2, magnitudes=(0.5, 1.0, 4.0)):
    """Random Inputs: shapes (cross included), broadcasting leading dims, mask kind, causal, scale."""
    batch = tuple(draw(st.lists(st.integers(1, 3), max_size=max_batch)))

    def leading():  # a shape broadcasting to `batch`: leading dims dropped, some set to 1
        return tuple(1 if draw(st.booleans()) else n for n in batch[draw(st.integers(0, len(batch))):])

    return Inputs.build(
        draw(st.integers(0, 2**16)), n_q=draw(st.integers(1, max_len)), n_kv=draw(st.integers(1, max_len)),
        d_k=draw(st.integers(1, max_dim)), d_v=draw(st.integers(1, max_dim)),
        batch_q=batch, batch_k=leading(), batch_v=leading(), mask=draw(st.sampled_from([None, "bool", "float"])),
        mask_batch=leading(), causal=draw(st.booleans()),
        scale=draw(st.none() | st.floats(0.05, 2.0)), magnitude=draw(st.sampled_from(magnitudes)))


# -- against torch.nn.functional.scaled_dot_product_attention ----------------------------------------

SCENARIOS = {
    "self-attention": dict(n_q=5, n_kv=5, d_k=8, d_v=8),
    "cross n_q<n_kv, d_v>d_k": dict(n_q=2, n_kv=7, d_k=3, d_v=6),
    "cross n_q>n_kv, d_v<d_k": dict(n_q=7, n_kv=3, d_k=6, d_v=1),
    "one query one key": dict(n_q=1, n_kv=1, d_k=1, d_v=1),
    "bool mask": dict(mask="bool"),
    "bool mask per batch": dict(mask="bool", batch_q=(2, 3), batch_k=(2, 3), batch_v=(2, 3), mask_batch=(2, 3)),
    "float mask": dict(mask="float"),
    "float mask per batch": dict(mask="float", batch_q=(3,), batch_k=(3,), batch_v=(3,), mask_batch=(3,)),
    "causal, n_q == n_kv": dict(n_q=5, n_kv=5, causal=True),
    "causal, n_q < n_kv (top-left)": dict(n_q=3, n_kv=6, causal=True),
    "causal, n_q > n_kv (top-left)": dict(n_q=6, n_kv=3, causal=True),
    "causal and bool mask": dict(n_q=5, n_kv=5, causal=True, mask="bool"),
    "explicit scale": dict(scale=0.3),
    "explicit scale 1": dict(scale=1.0, magnitude=2.0),
    "batch dims": dict(batch_q=(2, 3), batch_k=(2, 3), batch_v=(2, 3)),
    "broadcast batch dims": dict(batch_q=(2, 3), batch_k=(3,), batch_v=(1, 3)),
    "broadcast q over batch": dict(batch_q=(), batch_k=(4,), batch_v=(4,)),
    "large scores": dict(n_kv=6, magnitude=6.0),
}


@pytest.mark.parametrize("options", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_matches_sdpa(options):
    x = Inputs.build(seed=7, **options)
    out, weights = x.reference()
    expected = x.sdpa()
    assert out.dtype == F64 and out.shape == expected.shape
    assert weights.shape == expected.shape[:-1] + (x.k.shape[-2],)
    assert (out - expected).abs().max().item() <= 2 * x.bound()


@FAST
@given(inputs())
def test_matches_sdpa_random(x):
    out, _ = x.reference()
    expected = x.sdpa()
    assert out.shape == expected.shape
    assert (out - expected).abs().max().item() <= 2 * x.bound()


@FAST
@given(inputs())
def test_weights_are_distributions_read_by_sdpa(x):
    """The returned weights: rows sum to 1, masked entries exactly 0, and SDPA with V = I reads the same."""
    _, w = x.reference()  # [..., Tq, Tk]
    n_kv = x.k.shape[-2]
    assert w.ge(0).all() and w.le(1).all()
    assert (w.sum(-1) - 1).abs().max().item() <= (n_kv + 1) * EPS
    mask = x.sdpa_mask()
    if mask is not None:
        blocked = ~mask if mask.dtype == torch.bool else mask.isneginf()
        assert w.masked_select(blocked.expand(w.shape)).eq(0).all()
    eye = torch.eye(n_kv, dtype=F64)  # [Tk, Tk]: V = I makes the output the weights
    assert (w - x.sdpa(v=eye)).abs().max().item() <= 2 * x.bound(v=eye)


# -- causal alignment and fully masked rows -----------------------------------------------------------

@pytest.mark.parametrize("n_q, n_kv", [(3, 6), (4, 4), (6, 3), (1, 5), (5, 1)])
def test_bottom_right_causal_matches_a_hand_built_mask(n_q, n_kv):
    x = Inputs.build(seed=3, n_q=n_q, n_kv=n_kv, batch_q=(2,), batch_k=(2,), batch_v=(2,))
    hand = torch.tensor([[j <= i + n_kv - n_q for j in range(n_kv)] for i in range(n_q)])  # [Tq, Tk]
    out, w = attention(x.q, x.k, x.v, causal=True, causal_alignment="bottom-right")
    out_hand, w_hand = attention(x.q, x.k, x.v, hand)
    assert torch.equal(out, out_hand) and torch.equal(w, w_hand)
    seen = hand.any(-1)  # rows with at least one key: the last n_kv rows when n_q > n_kv
    expected = F.scaled_dot_product_attention(x.q[:, seen], x.k, x.v, attn_mask=hand[seen])
    assert (out[:, seen] - expected).abs().max().item() <= 2 * x.bound()
    assert out[:, ~seen].eq(0).all() and w[:, ~seen].eq(0).all()
    assert int(seen.sum()) == min(n_q, n_kv)


def test_top_left_and_bottom_right_agree_on_square_inputs():
    x = Inputs.build(seed=5, n_q=4, n_kv=4)
    top = attention(x.q, x.k, x.v, causal=True)
    bottom = attention(x.q, x.k, x.v, causal=True, causal_alignment="bottom-right")
    assert all(torch.equal(a, b) for a, b in zip(top, bottom))


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_fully_masked_rows_give_zero_weights_and_outputs(kind):
    x = Inputs.build(seed=11, n_q=4, n_kv=5, d_v=3)
    allowed = torch.ones(4, 5, dtype=torch.bool)
    allowed[1] = False  # query 1 may attend nothing
    allowed[3, 2:] = False
    mask = allowed if kind == "bool" else torch.zeros(4, 5, dtype=F64).masked_fill(~allowed, -math.inf)
    out, w = attention(x.q, x.k, x.v, mask)
    assert out[1].eq(0).all() and w[1].eq(0).all()
    assert not out.isnan().any() and not w.isnan().any()
    rows = torch.tensor([0, 2, 3])
    expected = F.scaled_dot_product_attention(x.q[rows], x.k, x.v, attn_mask=mask[rows])
    assert (out[rows] - expected).abs().max().item() <= 2 * x.bound()
    assert exact_attention(x.q, x.k, x.v, mask)[1].eq(0).all()


def test_reference_attention_keeps_dtype_and_device():
    x = Inputs.build(seed=2, batch_q=(2,), batch_k=(2,), batch_v=(2,))
    mask = torch.rand(3, 4, generator=torch.Generator().manual_seed(0)) < 0.7
    mask[:, 0] = True
    for dtype in (torch.float32, torch.bfloat16):
        got = reference_attention(x.q.to(dtype), x.k.to(dtype), x.v.to(dtype), mask)
        assert got.dtype == dtype and got.device == x.q.device
        assert torch.equal(got, attention(x.q.to(dtype), x.k.to(dtype), x.v.to(dtype), mask)[0].to(dtype))


def test_reference_in_the_inputs_dtype_and_with_a_softmax_hook():
    """dtype=None computes in the inputs' own dtype (a mistake model replayed exactly), the same formula rounded
    there; ``softmax`` swaps the map from scores to weights (a mistake model's hook), the rest unchanged."""
    x = Inputs.build(seed=3, n_q=3, n_kv=4)
    q, k, v = (t.float() for t in (x.q, x.k, x.v))
    out, w = attention(q, k, v, causal_mask(3, 4), dtype=None)
    assert out.dtype == w.dtype == torch.float32
    assert (out.double() - attention(x.q, x.k, x.v, causal_mask(3, 4))[0]).abs().max() < 1e-6
    hooked, w = attention(x.q, x.k, x.v, softmax=torch.sigmoid)
    assert torch.equal(w, torch.sigmoid(reference_scores(x.q, x.k))) and torch.equal(hooked, w @ x.v.double())


# -- multi-head: the function and the module against a per-head loop --------------------------------

def per_head_loop(x_q, x_kv, W_Q, W_K, W_V, W_O, n_heads, mask=None):
    """Multi-head attention written out head by head: head h owns output features h*Dh:(h+1)*Dh."""
    d_head = x_q.shape[-1] // n_heads
    heads, weights = [], []
    for h in range(n_heads):
        rows = slice(h * d_head, (h + 1) * d_head)  # nn.Linear: y = x W^T, so features are rows of W
        q, k, v = x_q @ W_Q[rows].T, x_kv @ W_K[rows].T, x_kv @ W_V[rows].T  # [T, Dh]
        scores = q @ k.T / math.sqrt(d_head)  # [Tq, Tk]
        if mask is not None:
            scores = scores.masked_fill(~(mask[h] if mask.dim() == 3 else mask), -math.inf)
        weights.append(torch.softmax(scores, dim=-1))
        heads.append(weights[-1] @ v)  # [Tq, Dh]
    return torch.cat(heads, dim=-1) @ W_O.T, torch.stack(weights)  # [Tq, D], [H, Tq, Tk]


def _mha_inputs(seed, n_q, n_kv, d_model, n_heads, mask):
    gen = torch.Generator().manual_seed(seed)
    x_q = torch.randn(n_q, d_model, generator=gen, dtype=F64)  # [Tq, D]
    x_kv = torch.randn(n_kv, d_model, generator=gen, dtype=F64)  # [Tk, D]
    W = [torch.randn(d_model, d_model, generator=gen, dtype=F64) / math.sqrt(d_model) for _ in range(4)]
    m = None
    if mask:
        shape = (n_heads, n_q, n_kv) if mask == "per-head" else (n_q, n_kv)
        m = (torch.rand(shape, generator=gen) < 0.5).scatter(-1, torch.zeros(shape[:-1] + (1,), dtype=torch.long), True)
    return x_q, x_kv, W, m


# Both sides differ only in summation order (~1e-15); a wrong head split or scale is off by O(1).
LOOP_TOL = 1e-12

MHA_SHAPES = [(3, 3, 4, 2, None), (2, 5, 6, 3, "shared"), (4, 2, 8, 4, "per-head"), (1, 1, 3, 1, None),
              (5, 3, 6, 1, "shared")]


@pytest.mark.parametrize("n_q, n_kv, d_model, n_heads, mask", MHA_SHAPES)
def test_multihead_matches_per_head_loop(n_q, n_kv, d_model, n_heads, mask):
    x_q, x_kv, W, m = _mha_inputs(1, n_q, n_kv, d_model, n_heads, mask)
    out, weights = multihead(x_q, x_kv, *W, n_heads, m)
    want_out, want_weights = per_head_loop(x_q, x_kv, *W, n_heads, m)
    assert out.shape == (n_q, d_model) and weights.shape == (n_heads, n_q, n_kv)
    torch.testing.assert_close(out, want_out, rtol=0, atol=LOOP_TOL)
    torch.testing.assert_close(weights, want_weights, rtol=0, atol=LOOP_TOL)


@pytest.mark.parametrize("n_q, n_kv, d_model, n_heads, mask", MHA_SHAPES)
def test_module_matches_per_head_loop(n_q, n_kv, d_model, n_heads, mask):
    x_q, x_kv, W, m = _mha_inputs(2, n_q, n_kv, d_model, n_heads, mask)
    module = MultiHeadAttention(d_model, n_heads).double()  # float64 weights: nothing rounded on loading
    with torch.no_grad():
        for layer, w in zip((module.W_Q, module.W_K, module.W_V, module.W_O), W):
            layer.weight.copy_(w)
    want, _ = per_head_loop(x_q, x_kv, *W, n_heads, m)
    torch.testing.assert_close(module(x_q, x_kv, m), want, rtol=0, atol=LOOP_TOL)
    got32 = module(x_q.float(), x_kv.float(), m)  # computes in float64, answers in the input's dtype
    assert got32.dtype == torch.float32
    torch.testing.assert_close(got32, want.float())


def test_one_head_is_single_head_attention():
    x_q, x_kv, W, _ = _mha_inputs(3, 3, 4, 5, 1, None)
    out, _ = multihead(x_q, x_kv, *W, 1)
    heads, _ = attention(x_q @ W[0].T, x_kv @ W[1].T, x_kv @ W[2].T)
    torch.testing.assert_close(out, heads @ W[3].T, rtol=0, atol=LOOP_TOL)


def test_module_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="d_model=6 is not divisible by n_heads=4"):
        MultiHeadAttention(6, 4)


# -- against the exact sympy oracle ----------------------------------------------------------------

def test_exact_oracle_on_hand_computed_cases():
    """Checks of the oracle itself, independent of the reference."""
    one = torch.ones(1, 1, dtype=F64)
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731 - two keys with scores x, 0: weight sigmoid(x)
    keys = torch.tensor([[1.0], [0.0]], dtype=F64)
    assert exact_attention(one, keys, keys).item() == pytest.approx(sigmoid(1), rel=EPS, abs=0)
    q4, k4 = torch.ones(1, 4, dtype=F64), torch.tensor([[1.0] * 4, [0.0] * 4], dtype=F64)
    assert exact_attention(q4, k4, keys).item() == pytest.approx(sigmoid(2), rel=EPS, abs=0)  # 4 / sqrt(4)
    assert exact_attention(q4, k4, keys, scale=0.25).item() == pytest.approx(sigmoid(1), rel=EPS, abs=0)
    bias = torch.tensor([[0.0, 1.5]], dtype=F64)
    assert exact_attention(q4, k4, keys, bias, scale=0.25).item() == pytest.approx(sigmoid(-0.5), rel=EPS, abs=0)
    v = torch.tensor([[1.0, 2.0], [3.0, 5.0], [-4.0, 8.0]], dtype=F64)
    uniform = exact_attention(torch.zeros(2, 3, dtype=F64), torch.randn(3, 3, dtype=F64), v)  # q = 0: the mean
    assert torch.equal(uniform, torch.tensor([[0.0, 5.0], [0.0, 5.0]], dtype=F64))
    batched = exact_attention(torch.zeros(2, 1, 1, 3, dtype=F64), torch.zeros(3, 3, 3, dtype=F64), v)
    assert batched.shape == (2, 3, 1, 2) and batched.eq(torch.tensor([0.0, 5.0], dtype=F64)).all()


@settings(max_examples=30, deadline=None, database=None)
@given(inputs(max_len=3, max_dim=3, max_batch=1, magnitudes=(0.5, 1.0, 8.0)))
def test_reference_is_within_rounding_of_exact(x):
    """The float64 reference is exact up to its rounding: |ref - exact| <= error_bound (a few eps of max|V|
    when the scores are small; it grows with the scores, since softmax amplifies their rounding)."""
    out, _ = x.reference()
    exact = exact_attention(x.q, x.k, x.v, x.sdpa_mask(), scale=x.scale)
    assert (out - exact).abs().max().item() <= x.bound()


def test_exact_oracle_tells_float32_from_float64():
    """The bound is not vacuous: the same attention computed naively in float32 is far outside it."""
    x = Inputs.build(seed=4, n_q=3, n_kv=3, d_k=3, d_v=2)
    q, k, v = x.q.float(), x.k.float(), x.v.float()
    naive32 = torch.softmax(q @ k.T / math.sqrt(3), dim=-1) @ v  # [Tq, Dv]
    exact = exact_attention(q, k, v)  # the float32 inputs, exactly
    assert (naive32.double() - exact).abs().max().item() > 1000 * error_bound(q.double(), k.double(), v.double())


# ------------------------------------------------------------------ the rules every part of the kit calls


def _bools(rows):
    return torch.tensor(rows, dtype=torch.bool)


def test_which_keys_a_query_sees_alignment_and_window():
    """Query i sits at key position i + offset (offset 0 top-left, n_kv - n_q bottom-right) and sees key j when
    j <= i + offset and, with a window of w keys, i + offset - w < j."""
    from attn_spec.reference import key_offset, keyless_rows, visible

    assert (key_offset(2, 4), key_offset(2, 4, "bottom-right"), key_offset(3, 1, "bottom-right")) == (0, 2, -2)
    assert torch.equal(causal_mask(2, 4), _bools([[1, 0, 0, 0], [1, 1, 0, 0]]))
    assert torch.equal(causal_mask(2, 4, alignment="bottom-right"), _bools([[1, 1, 1, 0], [1, 1, 1, 1]]))
    assert torch.equal(causal_mask(2, 4, alignment="bottom-right", window=2), _bools([[0, 1, 1, 0], [0, 0, 1, 1]]))
    assert torch.equal(causal_mask(3, 3, window=1), torch.eye(3, dtype=torch.bool))  # a window of 1: itself only
    assert torch.equal(causal_mask(3, 1, alignment="bottom-right"), _bools([[0], [0], [1]]))
    assert keyless_rows(3, 1, alignment="bottom-right").tolist() == [True, True, False]
    # positions, not rows: flash-attn's window (left 1, right 1) is w = 2, one key ahead
    assert torch.equal(visible(torch.arange(3), 3, window=2, ahead=1), _bools([[1, 1, 0], [1, 1, 1], [0, 1, 1]]))
    assert torch.equal(visible(torch.tensor([5]), 3, ahead=None), _bools([[1, 1, 1]]))


def test_each_sequence_of_a_packed_batch_has_its_own_offset():
    """Varlen and decode align each sequence bottom-right by its own n_q and n_kv (flash-attn's
    construct_local_mask): a sequence of 3 queries over 1 key has two rows that see nothing."""
    from attn_spec.serving_reference import segment_mask

    assert torch.equal(segment_mask(1, 3, causal=True), _bools([[1, 1, 1]]))  # one decode step sees the whole cache
    assert torch.equal(segment_mask(2, 2, causal=True), _bools([[1, 0], [1, 1]]))
    assert torch.equal(segment_mask(3, 1, causal=True), _bools([[0], [0], [1]]))
    assert torch.equal(segment_mask(2, 3, causal=True, alignment="top-left"), _bools([[1, 0, 0], [1, 1, 0]]))
    assert torch.equal(segment_mask(2, 4, window=(1, 0)), _bools([[0, 1, 1, 0], [0, 0, 1, 1]]))  # w = left + 1
    assert torch.equal(segment_mask(2, 2), torch.ones(2, 2, dtype=torch.bool))


def test_folding_a_mask_with_the_pattern():
    """A bool mask is and-ed with the keys the pattern allows; a float mask keeps its values there and gets -inf
    elsewhere; no mask is the pattern itself."""
    from attn_spec.reference import fold, fold_causal

    allowed = _bools([[1, 0, 0], [1, 1, 0]])
    assert torch.equal(fold(None, allowed), allowed)
    assert torch.equal(fold(_bools([[0, 1, 1], [1, 1, 1]]), allowed), _bools([[0, 0, 0], [1, 1, 0]]))
    bias = torch.tensor([[0.5, 1.0, 2.0], [-1.0, 3.0, 4.0]], dtype=F64)
    inf = math.inf
    assert torch.equal(fold(bias, allowed), torch.tensor([[0.5, -inf, -inf], [-1.0, 3.0, -inf]], dtype=F64))
    assert torch.equal(fold_causal(bias, 2, 3), fold(bias, allowed))  # is_causal written as its mask: top-left
    assert torch.equal(fold_causal(None, 2, 3, window=1), _bools([[1, 0, 0], [0, 1, 0]]))


def test_query_head_h_reads_kv_head_h_over_g():
    """Grouped K/V heads: with g = H / H_kv, query head h reads K/V head h // g (blocked, not tiled), as SDPA's
    enable_gqa does."""
    from attn_spec.reference import repeat_kv

    heads = torch.tensor([10.0, 20.0]).reshape(2, 1, 1)  # [H_kv = 2, T = 1, D = 1]
    assert repeat_kv(heads, 2).flatten().tolist() == [10.0, 10.0, 20.0, 20.0]
    packed = torch.tensor([[10.0, 20.0]]).reshape(1, 2, 1)  # [T, H_kv, D]: the serving layout, heads on dim 1
    assert repeat_kv(packed, 3, 1).flatten().tolist() == [10.0, 10.0, 10.0, 20.0, 20.0, 20.0]
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 3, 2, generator=g, dtype=F64), *torch.randn(2, 2, 5, 2, generator=g, dtype=F64)
    out, _ = attention(q, repeat_kv(k, 2), repeat_kv(v, 2))  # [4, 3, 2]
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rtol=0, atol=1e-12)


def test_the_lse_and_its_empty_row():
    """lse = log sum_j exp(s_j); a row with no allowed key has LSE -inf (neutral in a merge) and zero weights."""
    from attn_spec.reference import lse, lse_weights

    inf = math.inf
    scores = torch.tensor([[0.0, 0.0, -inf], [1.0, 2.0, 3.0], [-inf, -inf, -inf]], dtype=F64)
    row_lse = lse(scores)
    assert row_lse[0].item() == pytest.approx(math.log(2), abs=1e-15)
    assert row_lse[1].item() == pytest.approx(math.log(math.e + math.e ** 2 + math.e ** 3), abs=1e-14)
    assert row_lse[2].item() == -inf
    weights = lse_weights(scores, row_lse)
    assert weights[0].tolist() == [0.5, 0.5, 0.0] and weights[2].tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(weights[1], torch.softmax(scores[1], dim=-1), rtol=0, atol=1e-15)


def test_the_earned_budget_is_factor_times_naive_plus_the_floor():
    """|target - ref64| <= FACTOR * |naive - ref64| + FLOOR_ULPS * unit, stated once (checking.tolerance.earned)."""
    from attn_spec.checking import tolerance

    assert (tolerance.FACTOR, tolerance.FLOOR_ULPS) == (4.0, 2.0)
    assert tolerance.earned(0.25, 0.125) == 1.25
    assert tolerance.earned(0.0, 0.5) == 1.0  # an exact naive run: the floor alone
    assert tolerance.earned(0.25, 0.125, factor=8.0) == 2.25  # the gradients' factor
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(3, 4, generator=g).float() for _ in range(3))
    ref = attention(q, k, v)[0]
    naive = tolerance.naive_error(q, k, v, None, ref)
    assert tolerance.budget(q, k, v, None, ref) == tolerance.earned(naive, tolerance.floor_unit(q, k, v)) > 0
