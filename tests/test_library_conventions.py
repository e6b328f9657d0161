"""Real libraries through the adapter layer: SDPA, nn.MultiheadAttention, a Hugging Face module."""
import importlib.util

import pytest
import torch
import torch.nn.functional as F

import attn_spec
from attn_spec.targets.conventions import detect_convention, make_target
from attn_spec.cli import main
from attn_spec.targets.module_adapters import TorchMhaAdapter
from attn_spec.errors import KitUsageError

QUICK = ["--profile", "quick", "--seed", "3"]
MASKS = ["causal-mask", "mask-semantics", "head-concat-equivalence", "matches-reference"]


@pytest.mark.slow
def test_sdpa_conforms_with_no_flags(capsys):
    code = main(["check", "torch.nn.functional:scaled_dot_product_attention", *QUICK])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "(sdpa convention): CONFORMS" in out
    assert "skipped scale-argument" not in out and "skipped is-causal" not in out  # both really checked


@pytest.mark.parametrize("obj", [torch.nn.MultiheadAttention, torch.nn.MultiheadAttention(8, 2),
                                 torch.nn.MultiheadAttention(8, 2, batch_first=True)],
                         ids=["class", "instance", "instance-batch-first"])
def test_multihead_attention_conforms(obj):
    assert detect_convention(obj) == "torch-mha"
    report = attn_spec.check(obj, profile="quick", seed=3, only=MASKS + ["permutation-equivariance", "scale-sqrt-dk"])
    statuses = {p.id: p.status for p in report.targets[0].properties}
    assert report.conforms, str(report)
    assert statuses["head-concat-equivalence"] == "pass"  # read through in_proj_weight / out_proj


def test_multihead_attention_uses_both_mask_paths():
    seen = set()

    class Spy(torch.nn.MultiheadAttention):
        def forward(self, *args, **kwargs):
            seen.update(k for k in ("attn_mask", "key_padding_mask") if kwargs.get(k) is not None)
            return super().forward(*args, **kwargs)

    assert attn_spec.check(Spy, convention="torch-mha", profile="quick", seed=3, only=["mask-semantics"]).conforms
    assert seen == {"attn_mask", "key_padding_mask"}


def test_forgetting_mha_mask_polarity_is_caught():
    class NoInversion(TorchMhaAdapter):  # passes True = attend straight into MHA's True = ignore
        def forward(self, module, x_q, x_kv, mask):
            out, _ = module(x_q[:, None], x_kv[:, None], x_kv[:, None], attn_mask=mask, need_weights=False)
            return out[:, 0]

    target = make_target(NoInversion(torch.nn.MultiheadAttention), "NoInversion", "adapter")
    report = attn_spec.check(target, profile="quick", seed=3, only=["causal-mask"])
    assert not report.conforms
    assert "inverted polarity" in report.targets[0].properties[0].cause


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_hugging_face_vit_through_the_readme_adapter(capsys):
    code = main(["check", "examples/hf_vit_adapter.py:ViTAdapter", *QUICK,
                 "--only", "rows-sum-to-one", "head-concat-equivalence", "matches-reference", "cross-attention-shapes"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "skipped cross-attention-shapes" in out and "self-attention only" in out  # a capability, not a failure


def test_a_function_without_a_mask_argument_skips_mask_properties():
    def no_mask(Q, K, V):
        return F.scaled_dot_product_attention(Q, K, V)

    report = attn_spec.check(no_mask, profile="quick", seed=3, only=["causal-mask", "rows-sum-to-one"])
    result = {p.id: p for p in report.targets[0].properties}
    assert result["causal-mask"].status == "skip" and "takes no mask argument" in result["causal-mask"].message
    assert result["rows-sum-to-one"].status == "pass"  # checked on the unmasked inputs


def test_not_implemented_for_some_inputs_checks_the_rest():
    def square_only(Q, K, V, mask=None):
        if Q.shape[-2] != K.shape[-2]:
            raise NotImplementedError("cross-attention")
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)

    report = attn_spec.check(square_only, profile="quick", seed=3, only=["matches-reference", "cross-attention-shapes"])
    result = {p.id: p for p in report.targets[0].properties}
    assert result["matches-reference"].status == "pass" and "cross-attention" in result["matches-reference"].message
    assert result["cross-attention-shapes"].status == "skip"


def test_other_exceptions_fail_the_property():
    def crashes_on_masks(Q, K, V, mask=None):  # an assert, ValueError or TypeError of its own would declare
        if mask is not None:
            raise RuntimeError("masks are hard")
        return F.scaled_dot_product_attention(Q, K, V)

    report = attn_spec.check(crashes_on_masks, profile="quick", seed=3, only=["causal-mask"])
    (result,) = report.targets[0].properties
    assert result.status == "fail" and "RuntimeError: masks are hard" in result.message
    assert "raise RuntimeError" in result.counterexample["traceback"]


def test_ambiguous_callables_ask_for_a_convention():
    def factory(d, h):
        return torch.nn.MultiheadAttention(d, h)

    with pytest.raises(KitUsageError, match="--convention") as error:
        detect_convention(factory)
    for name in ("function", "sdpa", "module", "torch-mha", "adapter"):
        assert name in str(error.value)
    assert make_target(factory, "factory", "torch-mha").convention == "torch-mha"
