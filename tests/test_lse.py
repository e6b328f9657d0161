"""The LSE a serving kernel returns (lse-equals-logsumexp): its budget, the probed base and empty-row value it is
judged in, and the kernels that keep another base, another empty-row value, or no LSE at all."""
import math
from pathlib import Path

import pytest

import torch

import attn_spec
from attn_spec.checking.tolerance import lse_budget, same_dtype_lse
from attn_spec.targets.loading import load_target

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "serving_kernels.py"
ONLY = ["lse-equals-logsumexp"]


def decode_kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False, return_softmax_lse=False):
    return load_target(f"{KERNELS}:decode_kernel")(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal,
                                                    return_softmax_lse=return_softmax_lse)


def test_same_dtype_lse_is_logsumexp_and_its_budget_covers_float32_but_not_a_missing_scale():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 7, 8, generator=g, dtype=torch.float64)
    mask = torch.rand(5, 7, generator=g) < 0.7
    mask[:, 0] = True  # every row has a key
    ref = torch.logsumexp((q @ k.transpose(1, 2) / math.sqrt(8)).masked_fill(~mask, -math.inf), dim=-1)  # [2, 5]
    assert torch.allclose(same_dtype_lse(q, k, mask), ref, atol=1e-12)
    limit = lse_budget(q.float(), k.float(), mask, ref, torch.float32)
    got = torch.logsumexp((q.float() @ k.float().transpose(1, 2) / math.sqrt(8)).masked_fill(~mask, -math.inf), -1)
    assert (got.double() - ref).abs().max() <= limit < 1e-4
    unscaled = torch.logsumexp((q @ k.transpose(1, 2)).masked_fill(~mask, -math.inf), dim=-1)
    assert (unscaled - ref).abs().max() > 100 * limit
    assert same_dtype_lse(q, k, torch.zeros(5, 7, dtype=torch.bool)).isneginf().all()  # no key: -inf, not NaN


def test_a_base_2_lse_is_read_in_base_2():
    """FlashInfer keeps its LSE in base 2 (m + log2(d)): the header finds it, the property divides by ln 2 before."""
    def base2_decode(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False, return_softmax_lse=False):
        found = decode_kernel(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse)
        return (found[0], found[1] / math.log(2)) if return_softmax_lse else found

    report = attn_spec.check(base2_decode, profile="quick", seed=0, only=ONLY)
    assert "LSE: 2" in str(report) and report.conforms, str(report)


def test_a_kernel_that_returns_no_lse_is_a_skip():
    report = attn_spec.check(load_target(f"{KERNELS}:sdpa_decode"), profile="quick", seed=0, only=ONLY)
    assert report.targets[0].properties[0].status == "skip" and "returns no LSE" in report.targets[0].properties[0].message


def test_the_cpu_flash_ops_empty_row_lse_of_0_is_its_probed_behaviour_not_a_failure():
    report = attn_spec.check(load_target(f"{KERNELS}:flash_cpu_decode"), profile="quick", seed=1, only=ONLY)
    assert "LSE of an empty row: 0 (not neutral" in str(report) and report.conforms, str(report)


def test_an_lse_of_nan_for_a_row_with_no_key_fails():
    """NaN is never an empty row's value (FlashInfer #4450: an empty split-KV chunk gave NaN): -inf is expected."""
    def nan_when_empty(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False, return_softmax_lse=False):
        found = decode_kernel(q, k_cache, v_cache, k, v, cache_seqlens, causal, return_softmax_lse)
        return (found[0], found[1].masked_fill(found[1].isneginf(), math.nan)) if return_softmax_lse else found

    report = attn_spec.check(nan_when_empty, profile="quick", seed=0, only=ONLY)
    result = report.targets[0].properties[0]
    assert "LSE of an empty row: nan" in str(report) and result.status == "fail", str(report)
    assert "a row with no key to attend" in result.message and "-inf" in result.message


@pytest.mark.slow
def test_flexattentions_returned_lse_conforms():
    """FlexAttention (eager) with a document mask returns its LSE [H, T_q] in natural log: it holds."""
    report = attn_spec.check(load_target(f"{KERNELS}:flex_varlen"), profile="quick", seed=0, dtypes=["float32"],
                             only=ONLY)
    assert report.conforms and report.targets[0].properties[0].status == "pass", str(report)
