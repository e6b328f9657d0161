"""Packed batches: the varlen convention detected from flash-attn's and PyTorch's names, its header probes, the
float64 varlen reference, the packed segments the strategies draw, the CPU kernels of examples/serving_kernels.py
conforming with no flags, a kernel that dies on zero keys failing (not killing) the check, and flash-attn's own
kernel where a GPU and the library are present."""
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, seed, settings

import attn_spec
from attn_spec import reference
from attn_spec.checking.cases import Case
from attn_spec.checking.strategies import cases
from attn_spec.cli import main
from attn_spec.errors import KitUsageError
from attn_spec.targets.conventions import make_target
from attn_spec.targets.loading import load_target
from attn_spec.serving_reference import varlen_reference
from attn_spec.targets.serving_varlen import cu_seqlens
from gallery.serving import varlen_attn_names, varlen_top_left

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "serving_kernels.py"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """flash-attn 2.8's signature, as it is (the body is the kit's own reference)."""
    out, lse = varlen_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, window=window_size,
                                scale=softmax_scale, softcap=softcap or None)
    return (out.to(q.dtype), lse.float(), None) if return_attn_probs else out.to(q.dtype)


def test_flash_attn_signature_is_detected_and_probed():
    target = make_target(flash_attn_varlen_func)
    assert target.convention == "varlen" and target.dialect == "flash"
    assert target.behaviour() == {"causal-alignment": "bottom-right per sequence", "lse-layout": "[H, T_q]",
                                  "lse-base": "e", "lse-empty-row": "-inf", "grouped-heads": "yes"}
    assert target.accepts == {"softmax_scale", "causal", "window_size", "softcap", "return_attn_probs"}
    assert make_target(varlen_top_left).behaviour()["causal-alignment"] == "top-left per sequence"


def test_varlen_attn_names_are_called_by_their_own_names():
    """PyTorch's varlen_attn: scale=, causal as window_size=(-1, 0), the LSE through return_aux, [T_q, H] read back."""
    seen = []

    def spy(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)):
        seen.append({"scale": scale, "window_size": window_size, "lse": return_aux is not None and return_aux.lse})
        return varlen_attn_names(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux=return_aux,
                                 scale=scale, window_size=window_size)

    target = make_target(spy)
    assert target.convention == "varlen" and target.dialect == "torch"
    assert target.behaviour()["causal-alignment"] == "bottom-right per sequence"
    assert target.behaviour()["lse-layout"] == "[T_q, H]" and target.behaviour()["lse-base"] == "e"
    assert {"scale": None, "window_size": (-1, 0), "lse": False} in seen
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 3, 2, generator=g, dtype=torch.float64), torch.randn(4, 3, 2, generator=g, dtype=torch.float64)
    out, lse = target.varlen(q, k, k, cu_seqlens([1, 2]), cu_seqlens([3, 1]), 2, 3, lse=True, scale=0.5)
    want_out, want_lse = varlen_reference(q, k, k, cu_seqlens([1, 2]), cu_seqlens([3, 1]), scale=0.5)
    assert lse.shape == (3, 3) and torch.allclose(lse.double(), want_lse) and torch.allclose(out, want_out)
    assert seen[-1] == {"scale": 0.5, "window_size": (-1, -1), "lse": True}


@pytest.mark.slow
def test_a_kernel_is_called_only_with_the_options_its_signature_has():
    def plain(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        return flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)

    target = make_target(plain)
    assert target.accepts == set() and not target.takes("causal")
    assert target.behaviour()["causal-alignment"].startswith("n/a")
    report = attn_spec.check(plain, profile="quick", seed=0)
    assert report.conforms, str(report)


def test_varlen_reference_is_each_sequence_alone():
    g = torch.Generator().manual_seed(1)
    segments = [(2, 3), (0, 2), (3, 1), (1, 0)]
    q = torch.randn(6, 2, 4, generator=g, dtype=torch.float64)  # [T_q, H, D]
    k, v = (torch.randn(6, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))  # [T_k, H, D]
    cu_q, cu_k = cu_seqlens(s[0] for s in segments), cu_seqlens(s[1] for s in segments)
    out, lse = varlen_reference(q, k, v, cu_q, cu_k, causal=True)
    for b in range(len(segments)):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        alone, _ = reference.attention(*(t.transpose(0, 1) for t in (q[rows], k[keys], v[keys])), causal=True,
                                       causal_alignment="bottom-right")  # [H, n_q, D]
        assert torch.allclose(out[rows].transpose(0, 1), alone, atol=1e-12)
    assert torch.isneginf(lse[:, 5]).all() and (out[5] == 0).all()  # the sequence with no key: 0, LSE -inf
    assert torch.isneginf(lse[:, 3]).all()  # (3, 1) causal bottom-right: its first two queries see no key


@pytest.mark.slow
def test_the_strategies_draw_packed_segments_with_zero_lengths():
    drawn = []

    @seed(0)
    @settings(max_examples=200, database=None, deadline=None)
    @given(cases("default", segments=True))
    def record(case):
        drawn.append(case)

    record()
    assert all(case.n_q == sum(s[0] for s in case.segments) and case.n_kv == sum(s[1] for s in case.segments)
               for case in drawn)
    lengths = [n for case in drawn for pair in case.segments for n in pair]
    assert 0 in lengths and max(lengths) > 8 and max(len(case.segments) for case in drawn) == 4


def test_a_case_with_segments_survives_json():
    case = Case(batch=(2,), n_q=3, n_kv=1, segments=((3, 0), (0, 1)))
    back = Case(**json.loads(json.dumps(dataclasses.asdict(case))))
    assert back == case and hash(back) == hash(case) and "packed segments (n_q, n_kv) (3, 0) (0, 1)" in case.summary()


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["varlen_kernel", "nested_sdpa_varlen"])
def test_cpu_kernels_conform_with_no_flags(kernel, capsys):
    code = main(["check", f"{KERNELS}:{kernel}", "--profile", "quick", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "(varlen convention): CONFORMS" in out, out


@pytest.mark.slow
def test_a_fixed_shape_is_a_packed_batch_for_a_varlen_kernel(capsys):
    """--shapes B,H,HKV,NQ,NKV,D: B sequences of up to NQ queries over up to NKV keys, the first the longest."""
    from attn_spec.checking.shapes import Rung, Shape, packed_case

    case = packed_case(Shape.parse("5,4,2,16,40,8"), Rung(Shape.parse("5,4,2,16,40,8"), "float32", "cpu"), seed=0)
    assert len(case.segments) == 5 and case.segments[0] == (16, 40) and case.kv_heads == 2
    assert all(1 <= q <= 16 and 1 <= k <= 40 for q, k in case.segments) and case.n_q == sum(q for q, _ in case.segments)
    code = main(["check", f"{KERNELS}:varlen_kernel", "--shapes", "3,4,2,12,20,8", "--seed", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "(varlen convention): CONFORMS" in out and "not checked" not in out, out
    assert main(["check", "gallery.serving:varlen_segments_ignored", "--shapes", "4,2,16,8", "--seed", "0"]) == 1
    assert "[varlen-segments-ignored]" in capsys.readouterr().out


@pytest.mark.slow
def test_flexattention_with_a_document_mask_is_a_varlen_kernel():
    """FlexAttention in eager mode, one call over the packed batch with a document mask_mod: causal bottom-right per
    sequence, its LSE natural-log, [H, T_q], -inf for a row with no key (one property here: eager Flex is slow)."""
    target = make_target(load_target(f"{KERNELS}:flex_varlen"))
    assert target.behaviour() == {"causal-alignment": "bottom-right per sequence", "lse-layout": "[H, T_q]",
                                  "lse-base": "e", "lse-empty-row": "-inf", "grouped-heads": "yes"}
    report = attn_spec.check(target, profile="quick", seed=0, dtypes=["float32"], only=["varlen-equals-per-sequence"])
    assert report.conforms, str(report)


def test_list_conventions_shows_varlen_and_it_can_be_forced(capsys):
    assert main(["list", "--conventions"]) == 0
    assert "varlen" in capsys.readouterr().out
    target = make_target(flash_attn_varlen_func, "kernel", convention="varlen")
    assert target.convention == "varlen"


@pytest.mark.slow
def test_a_varlen_kernel_gets_only_the_varlen_properties():
    report = attn_spec.check(load_target(f"{KERNELS}:varlen_kernel"), profile="quick", seed=0,
                             only=["segment-isolation", "rows-sum-to-one", "decode-equals-full-causal"])
    assert [p.id for p in report.targets[0].properties] == ["segment-isolation"]


def test_a_signature_that_cannot_take_the_varlen_call_is_a_usage_error():
    def short(q, k, v, cu_seqlens_q, cu_seqlens_k):
        return q

    with pytest.raises(KitUsageError, match="cannot follow the varlen convention") as raised:
        make_target(short, "short", convention="varlen")
    assert "(q, k, v, cu_seqlens_q, cu_seqlens_k)" in str(raised.value)


def flash_cpu_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_attn_probs=False):
    """The CPU flash op of torch 2.13 on each sequence's rows, unguarded: zero keys kill the process (SIGFPE)."""
    outs, lses = [], []
    for b in range(len(cu_seqlens_q) - 1):
        rows, keys = slice(int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])), slice(int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1]))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t[None].transpose(1, 2) for t in (q[rows], k[keys], v[keys])), 0.0, False)[:2]  # [1, H, n, D]
        outs.append(out[0].transpose(0, 1))  # [n_q, H, D]
        lses.append(lse[0])  # [H, n_q]
    out, lse = torch.cat(outs), torch.cat(lses, dim=1)
    return (out, lse, None) if return_attn_probs else out


@pytest.mark.slow
def test_a_kernel_that_dies_on_zero_keys_fails_the_check_and_does_not_end_it():
    target = make_target(flash_cpu_varlen)
    assert target.behaviour()["lse-empty-row"] == "crashes (SIGFPE)"
    report = attn_spec.check(target, profile="quick", seed=0, only=["varlen-degenerate-lengths"])
    result = report.targets[0].properties[0]
    assert result.status == "fail" and "the process dies (SIGFPE)" in result.message, result.message


GPU = torch.cuda.is_available()


@pytest.mark.skipif(not (GPU and importlib.util.find_spec("flash_attn")), reason="flash-attn and a GPU are not present")
def test_flash_attn_varlen_func_conforms():  # pragma: no cover - runs on a GPU machine with flash-attn
    from flash_attn import flash_attn_varlen_func as kernel

    report = attn_spec.check(kernel, profile="quick", seed=0, dtypes=["float16", "bfloat16"], devices=["cuda"])
    assert report.conforms, str(report)


@pytest.mark.skipif(not GPU, reason="torch's varlen_attn runs on a GPU only")
def test_torch_varlen_attn_conforms():  # pragma: no cover - runs on a GPU machine
    from torch.nn.attention.varlen import varlen_attn

    report = attn_spec.check(varlen_attn, profile="quick", seed=0, dtypes=["float16", "bfloat16"], devices=["cuda"])
    assert report.conforms, str(report)


def test_the_varlen_lesson_has_a_worked_example(capsys):
    assert main(["explain", "segment-isolation"]) == 0
    assert "cu_seqlens_q = [0, 2, 3]" in capsys.readouterr().out
    assert main(["explain", "varlen-segments-ignored"]) == 0
    assert "cu_seqlens is ignored" in capsys.readouterr().out
