"""Serving kernels: the decode convention detected from flash-attn's names, its header probes, the float64
decode reference, the CPU kernels of examples/serving_kernels.py conforming with no flags, and flash-attn's
own kernel where a GPU and the library are present."""
import importlib.util
import math
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec import reference
from attn_spec.cli import main
from attn_spec.errors import KitUsageError
from attn_spec.targets.conventions import make_target
from attn_spec.targets.loading import load_target
from attn_spec.serving_reference import decode_reference
from gallery.serving import decode_top_left

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "serving_kernels.py"


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None,
                            cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0, rotary_interleaved=True,
                            alibi_slopes=None, num_splits=0, return_softmax_lse=False):
    """flash-attn 2.8's signature, as it is (the body is the kit's own reference)."""
    out, lse, k_after, v_after = decode_reference(q, k_cache, v_cache, cache_seqlens, k, v, cache_leftpad,
                                                  causal=causal, scale=softmax_scale)
    k_cache.copy_(k_after)
    v_cache.copy_(v_after)
    out = out.to(q.dtype)
    return (out, lse.float()) if return_softmax_lse else out


def test_flash_attn_signature_is_detected_and_probed():
    target = make_target(flash_attn_with_kvcache)
    assert target.convention == "decode"
    assert target.behaviour() == {"causal-alignment": "bottom-right", "writes-cache": "yes", "unread-nan": "ignored",
                                  "lse-base": "e", "lse-empty-row": "-inf", "page-sizes": "any", "grouped-heads": "yes"}
    assert make_target(decode_top_left).behaviour()["causal-alignment"] == "top-left"


def test_decode_reference_is_the_last_rows_of_full_causal_attention():
    g = torch.Generator().manual_seed(0)
    L, S, H, D = 7, 3, 2, 4
    q, k, v = (torch.randn(1, L, H, D, generator=g, dtype=torch.float64) for _ in range(3))  # [B, L, H, D]
    full, _ = reference.attention(*(t[0].transpose(0, 1) for t in (q, k, v)), causal=True)  # [H, L, D]
    cache = [torch.zeros(1, L + 2, H, D, dtype=torch.float64) for _ in range(2)]
    cache[0][:, :L - S], cache[1][:, :L - S] = k[:, :L - S], v[:, :L - S]
    out, lse, k_after, _ = decode_reference(q[:, L - S:], *cache, torch.tensor([L - S]), k[:, L - S:], v[:, L - S:])
    assert torch.allclose(out[0].transpose(0, 1), full[:, L - S:], atol=1e-12)
    assert torch.equal(k_after[:, :L], k[:, :])  # the appended rows are exactly the new ones
    scores = torch.einsum("hd,lhd->hl", q[0, L - 1], k[0]) / math.sqrt(D)  # [H, L]: the last token sees every key
    assert torch.allclose(lse[0, :, -1], torch.logsumexp(scores, dim=-1), atol=1e-12)


@pytest.mark.parametrize("kernel", ["decode_kernel", "sdpa_decode"])
def test_cpu_kernels_conform_with_no_flags(kernel, capsys):
    code = main(["check", f"{KERNELS}:{kernel}", "--profile", "quick", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "(decode convention): CONFORMS" in out, out
    assert "causal alignment bottom-right, writes the cache: yes" in out


def test_list_conventions_shows_decode(capsys):
    assert main(["list", "--conventions"]) == 0
    assert "decode" in capsys.readouterr().out


def test_a_decode_kernel_gets_only_the_decode_properties():
    report = attn_spec.check(load_target(f"{KERNELS}:decode_kernel"), profile="quick", seed=0,
                             only=["decode-equals-full-causal", "rows-sum-to-one"])
    assert [p.id for p in report.targets[0].properties] == ["decode-equals-full-causal"]


@pytest.mark.parametrize("convention, kernel, shown", [
    ("decode", lambda q, k_cache: q, "(q, k_cache)"), ("merge", lambda v_a, s_a, v_b: v_a, "(v_a, s_a, v_b)")])
def test_a_serving_kernel_whose_signature_cannot_take_the_call_is_a_usage_error(convention, kernel, shown):
    """Checked before anything runs (targets.call_shapes), as for the attention conventions."""
    with pytest.raises(KitUsageError, match=f"cannot follow the {convention} convention") as raised:
        make_target(kernel, "kernel", convention=convention)
    assert shown in str(raised.value)


GPU = torch.cuda.is_available()


@pytest.mark.skipif(not (GPU and importlib.util.find_spec("flash_attn")), reason="flash-attn and a GPU are not present")
def test_flash_attn_with_kvcache_conforms():  # pragma: no cover - runs on a GPU machine with flash-attn
    from flash_attn import flash_attn_with_kvcache as kernel

    report = attn_spec.check(kernel, profile="quick", seed=0, dtypes=["float16", "bfloat16"], devices=["cuda"])
    assert report.conforms, str(report)


def test_merge_kernels_are_detected_and_their_base_probed():
    for name, base in (("merge_state", "e"), ("merge_state_base2", "2")):
        target = make_target(load_target(f"{KERNELS}:{name}"))
        assert target.convention == "merge" and target.behaviour()["lse-base"] == base


def merge_state_float32(v_a, s_a, v_b, s_b):
    """A correct merge that works in float32 whatever it is given: its weights differ from float64's in the 8th digit."""
    s_a, s_b, v_a, v_b = (t.float() for t in (s_a, s_b, v_a, v_b))
    s = torch.logaddexp(s_a, s_b)  # [T, H]
    return (torch.exp(s_a - s)[..., None] * v_a + torch.exp(s_b - s)[..., None] * v_b), s


def test_the_merge_base_is_read_within_float32_rounding():
    from attn_spec.targets.serving_merge import lse_base

    assert lse_base(make_target(merge_state_float32)) == "e"


def test_merge_reference_equals_attention_over_the_union():
    from attn_spec.checking.cases import Case
    from attn_spec.properties.serving.merge import partial_states
    from attn_spec.serving_reference import merge_reference

    parts, (out, lse) = partial_states(Case(batch=(2,), n_q=3, n_kv=7, d_k=4, d_v=4, values="normal", seed=5))
    v, s = parts[0]
    for part in parts[1:]:
        v, s = merge_reference(v, s, *part)
    assert len(parts) >= 2 and torch.allclose(v, out, atol=1e-12) and torch.allclose(s, lse, atol=1e-12)


@pytest.mark.parametrize("kernel", ["merge_state", "merge_state_base2"])
def test_cpu_merge_kernels_conform_with_no_flags(kernel, capsys):
    code = main(["check", f"{KERNELS}:{kernel}", "--profile", "quick", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "(merge convention): CONFORMS" in out, out


@pytest.mark.slow
def test_the_serving_benchmark_runs_at_tiny_sizes_on_the_cpu():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(KERNELS.parents[1] / "benchmarks" / "bench_serving.py"), "--tiny"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "decode_kernel" in done.stdout and "merge-empty-neutral" in done.stdout and "FAIL" not in done.stdout


def test_the_cpu_flash_ops_empty_row_lse_is_found_and_named():
    """torch 2.13's CPU flash op gives a row with no key LSE 0, not -inf: a behaviour, reported, not punished."""
    target = make_target(load_target(f"{KERNELS}:flash_cpu_decode"))
    assert target.behaviour()["lse-empty-row"].startswith("0 (not neutral in a merge")
    assert make_target(load_target(f"{KERNELS}:decode_kernel")).behaviour()["lse-empty-row"] == "-inf"


def zero_key_flash_decode(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False,
                          return_softmax_lse=False):
    """Slices every sequence to its rows and calls the CPU flash op on them: zero rows kill the process (SIGFPE)."""
    rows = int(cache_seqlens[0])
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(1, 2), k_cache[:, :rows].transpose(1, 2), v_cache[:, :rows].transpose(1, 2), 0.0, False)[:2]
    return (out.transpose(1, 2), lse) if return_softmax_lse else out.transpose(1, 2)


def test_a_kernel_that_dies_on_zero_keys_is_probed_in_a_child():
    assert make_target(zero_key_flash_decode).behaviour()["lse-empty-row"] == "crashes (SIGFPE)"
