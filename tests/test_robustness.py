"""What the gallery cannot show about the robustness and gradient properties: skips with their
reasons, the finite-difference check's own catch, and the closed-form reference gradients."""
import math

import pytest

import torch

import attn_spec
from attn_spec.targets.conventions import make_target
from attn_spec.checking.cases import Case
from attn_spec.checking.grad_tolerance import grad_budgets, reference_grads
from attn_spec.checking.tolerance import max_error
from gallery.core import SeedMultiHead, seed_function


def _only(target, prop, **kwargs):
    report = attn_spec.check(target, profile="quick", seed=0, only=[prop], **kwargs)
    return report.targets[0].properties[0]


def detached(Q, K, V, mask=None):
    return seed_function(Q, K, V, mask).detach()


def test_a_non_differentiable_target_fails_gradients_unless_declared_inference_only():
    report = attn_spec.check(detached, profile="quick", seed=0, only=["gradients"])
    result = report.targets[0].properties[0]
    assert result.status == "fail"
    assert "not differentiable" in result.message and "through .detach()" in result.message
    assert [d.mistake for d in report.targets[0].diagnoses] == ["output-detached"]
    assert "--inference-only" in str(report)  # the way out, for an inference kernel
    result = _only(detached, "gradients", inference_only=True)
    assert result.status == "skip"
    assert result.message.startswith("not checked: declared an inference kernel") and ".detach()" in result.message


def test_library_conventions_without_autograd_keep_the_skip():
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask).detach()

    result = _only(sdpa, "gradients")
    assert result.status == "skip" and result.message.startswith("not checked: no autograd")


@pytest.mark.slow
def test_finite_differences_catch_a_backward_that_is_not_the_forward_derivative():
    """The backward returns the exact attention gradients, so only finite differences can see that the
    forward has an extra term the backward ignores."""

    class Inconsistent(torch.autograd.Function):
        @staticmethod
        def forward(ctx, Q, K, V, mask):
            ctx.save_for_backward(Q, K, V)
            ctx.mask = mask
            return seed_function(Q, K, V, mask) + 0.01 * (Q**2).sum(dim=-1, keepdim=True)

        @staticmethod
        def backward(ctx, grad_out):
            Q, K, V = ctx.saved_tensors
            grads = reference_grads(Q, K, V, ctx.mask, grad_out)
            return (*(g.to(Q.dtype) for g in grads), None)

    def attention(Q, K, V, mask=None):
        return Inconsistent.apply(Q, K, V, mask)

    result = _only(attention, "gradients", dtypes=["float64"])
    assert result.status == "fail"
    assert result.message.startswith("finite differences along a random direction u: <G, J u> = ")
    assert "finite differences" in result.cause


def test_reference_gradients_equal_autograd_in_float64():
    for case in (Case(batch=(2,), n_q=3, n_kv=4, d_k=3, d_v=2, values="normal", mask="random", seed=s)
                 for s in range(3)):
        q, k, v, mask = case.tensors()
        grad_out = torch.randn(2, 3, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(case.seed))
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        scores = (leaves[0] @ leaves[1].transpose(-2, -1) / math.sqrt(3)).masked_fill(~mask, -math.inf)
        expected = torch.autograd.grad(scores.softmax(dim=-1) @ leaves[2], leaves, grad_out)
        for got, want in zip(reference_grads(q, k, v, mask, grad_out), expected):
            assert max_error(got, want) < 1e-14


def test_gradient_budget_covers_rounding_where_the_gradient_cancels_to_zero():
    """All V rows equal: dQ and dK are exactly 0, yet a float32 backward rounds; the floor must allow it."""
    q, k, _, _ = Case(n_q=5, n_kv=7, d_k=4, d_v=3, dtype="float32", values="normal", seed=1).tensors()
    v = torch.linspace(-1, 1, 3).expand(7, 3).contiguous()  # [Tk, Dv], every row the same
    grad_out = torch.randn(5, 3, generator=torch.Generator().manual_seed(2))
    expected = reference_grads(q, k, v, None, grad_out)
    assert expected[0].abs().max() < 1e-15
    _, *grads = make_target(seed_function).vjp(q, k, v, None, grad_out)
    assert grads[0].abs().max() > 0  # float32 really rounds here
    for got, want, allowed in zip(grads, expected, grad_budgets(q, k, v, None, grad_out, expected)):
        assert max_error(got, want) <= allowed


def test_vjp_through_a_module_over_batch_dims():
    """The module convention embeds attention once per batch element; its gradients must still flow."""
    q, k, v, mask = Case(batch=(2,), n_q=3, n_kv=3, d_k=2, d_v=2, values="normal", mask="causal").tensors()
    grad_out = torch.ones(2, 3, 2, dtype=torch.float64)
    _, *grads = make_target(SeedMultiHead, convention="module").vjp(q, k, v, mask, grad_out)
    for got, want in zip(grads, reference_grads(q, k, v, mask, grad_out)):
        assert max_error(got, want) < 1e-12


def test_gqa_equivalence_skips_a_target_without_grouped_heads_and_says_why():
    result = _only(seed_function, "gqa-equivalence")
    assert result.status == "skip"
    assert "no grouped-query attention" in result.message and "KV heads" in result.message
