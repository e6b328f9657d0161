"""What serving cases draw (issue 24): cache lengths, page sizes, spare pages, num_splits and grouped heads are part
of the drawn Case, so Hypothesis draws and shrinks them and a counterexample's reproduction rebuilds them; a decode
kernel's fixed shapes (--shapes B,H,[HKV,]S_NEW,S_CACHE,D[,page=P]); grouped heads and softcap in varlen."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec.checking.cases import Case
from attn_spec.checking.shapes import Shape
from attn_spec.checking.strategies import PROFILES, cases
from attn_spec.cli import main
from attn_spec.errors import KitUsageError
from attn_spec.targets.conventions import make_target
from attn_spec.targets.loading import load_target
from test_strategies import draw_many

KERNELS = Path(__file__).resolve().parents[1] / "examples" / "serving_kernels.py"
paged_kernel = load_target(f"{KERNELS}:paged_decode_kernel")
split_kernel = load_target(f"{KERNELS}:split_decode_kernel")
decode_kernel = load_target(f"{KERNELS}:decode_kernel")




@pytest.mark.slow
def test_decode_cases_draw_cache_lengths_pages_splits_and_grouped_heads():
    drawn = draw_many(cases("default", batch=True, masks=("none",), same_width=True, cache=True, pages=True,
                            splits=True, grouped=1))
    for c in drawn:
        S = min(c.n_q, c.n_kv)
        assert len(c.cache_lengths) == c.batch[0] and all(S <= n <= c.n_kv for n in c.cache_lengths)
        assert c.page_size >= 1 and 0 <= c.spare_pages <= 3 and 0 <= c.num_splits <= PROFILES["default"].max_splits
        assert not c.kv_heads or (len(c.batch) >= 2 and c.batch[-1] % c.kv_heads == 0 and c.batch[-1] > c.kv_heads)
    pages = {c.page_size for c in drawn}
    assert {1, 2, 3, 16} <= pages  # page 1, small pages, the profile's larger one
    assert any(c.page_size > c.n_kv + 2 for c in drawn)  # a page longer than every sequence
    assert any(c.page_size > 1 and any(n % c.page_size for n in c.cache_lengths) for c in drawn)  # a non-divisor
    assert {c.spare_pages for c in drawn} == {0, 1, 2, 3}
    assert {c.num_splits for c in drawn} == set(range(PROFILES["default"].max_splits + 1))
    assert any(len(set(c.cache_lengths)) > 1 for c in drawn)  # lengths that differ across the batch
    assert {c.kv_heads for c in drawn} == {0, 1, 2}


def test_a_kernels_smallest_page_size_is_what_pages_are_drawn_in_multiples_of():
    drawn = draw_many(cases("quick", batch=True, cache=True, pages=True, page_granule=256), n=60)
    assert {c.page_size for c in drawn} == {256, 512}


@pytest.mark.slow
def test_grouped_heads_only_where_asked():
    assert all(not c.kv_heads for c in draw_many(cases("default", batch=True, segments=True), n=100))
    varlen = draw_many(cases("default", batch=True, segments=True, grouped=0), n=200)
    assert {c.kv_heads for c in varlen} == {0, 1, 2}
    assert all(c.batch[-1] % c.kv_heads == 0 for c in varlen if c.kv_heads)


def _wrong_at(page_ok):
    """The paged reference kernel, its output shifted where ``page_ok(page size)`` is False."""
    def kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
        out = paged_kernel(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal)
        return out if block_table is None or page_ok(k_cache.shape[1]) else out + 1
    return kernel


def _counterexample(kernel, prop, profile="quick", seed_=0):
    report = attn_spec.check(kernel, name="kernel", profile=profile, seed=seed_, only=[prop])
    result = report.targets[0].properties[0]
    assert result.status == "fail", str(report)
    return result


def test_a_kernel_wrong_only_at_page_size_3_is_caught_by_the_hand_picked_example():
    result = _counterexample(_wrong_at(lambda page: page != 3), "paged-equals-contiguous")
    assert result.case.page_size == 3 and "page_size=3" in result.counterexample.reproduce
    assert "in pages of 3" in result.message


@pytest.mark.slow
def test_a_kernel_wrong_at_even_page_sizes_is_drawn_and_shrunk_to_page_2():
    """No hand-picked example has an even page (1, 3, 9): Hypothesis must draw one, and shrinks it to 2."""
    result = _counterexample(_wrong_at(lambda page: page % 2), "paged-equals-contiguous")
    assert result.case.page_size == 2 and "page_size=2" in result.counterexample.reproduce
    assert result.case.spare_pages == 0  # shrunk: no spare page needed to show it


@pytest.mark.slow
def test_a_kernel_wrong_at_four_splits_or_more_is_drawn_and_shrunk_to_4():
    """The hand-picked splits are 1, 2, 3 and 0; the default profile draws num_splits up to 4."""
    def kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False, num_splits=0):
        out = split_kernel(q, k_cache, v_cache, k, v, cache_seqlens, causal=causal, num_splits=num_splits)
        return out + 1 if num_splits >= 4 else out

    assert attn_spec.check(kernel, name="kernel", profile="quick", seed=0, only=["split-kv-agree"]).conforms
    result = _counterexample(kernel, "split-kv-agree", profile="default")
    assert result.case.num_splits == 4 and "num_splits=4" in result.counterexample.reproduce


def test_a_kernel_that_reads_the_first_elements_length_for_all_shows_two_lengths():
    """cache_seqlens[0] used for every element: the counterexample has two elements of different lengths."""
    def kernel(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
        return decode_kernel(q, k_cache, v_cache, k, v, cache_seqlens[:1].expand(q.shape[0]).clone(), causal=causal)

    result = _counterexample(kernel, "decode-equals-full-causal")
    lengths = result.case.cache_lengths
    assert len(lengths) == 2 and lengths[0] != lengths[1], lengths
    assert f"cache_lengths={lengths!r}" in result.counterexample.reproduce


@pytest.mark.slow
def test_a_drawn_counterexample_reproduces_from_its_snippet():
    result = _counterexample(_wrong_at(lambda page: page % 2), "paged-equals-contiguous")
    namespace = {}
    exec(result.counterexample.reproduce.split("\nattn_spec.reproduce")[0], namespace)  # the snippet's Case line
    assert namespace["case"] == result.case


@pytest.mark.slow
def test_a_varlen_counterexample_shows_its_zero_length_segment():
    from gallery.serving import varlen_nan_on_empty

    result = _counterexample(varlen_nan_on_empty, "varlen-equals-per-sequence")
    assert any(n_k == 0 for _, n_k in result.case.segments), result.case


# -- fixed decode shapes ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, shape", [
    ("2,4,2,1,64,8", Shape(2, 4, 2, 1, 64, 8)),  # B,H,HKV,S_NEW,S_CACHE,D
    ("2,4,1,64,8", Shape(2, 4, 4, 1, 64, 8)),  # B,H,S_NEW,S_CACHE,D
    ("4,32,8,1,4096,128,page=256", Shape(4, 32, 8, 1, 4096, 128, page=256)),
    ("1,2,3,5,4,page=2", Shape(1, 2, 2, 3, 5, 4, page=2))])
def test_decode_shapes_parse(text, shape):
    assert Shape.parse(text) == shape and Shape.parse(str(shape)) == shape


@pytest.mark.parametrize("text", ["1,2,3,4,page=0", "1,2,3,4,page=x", "1,2,3,4,5,6,7", "page=16", "1,2,page=4,3,4"])
def test_bad_decode_shapes_are_usage_errors_that_show_the_forms(text, capsys):
    assert main(["check", f"{KERNELS}:decode_kernel", "--shapes", text]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attn-spec check: error: ") and repr(text) in err
    assert "B,H,[HKV,]S_NEW,S_CACHE,D[,page=P]" in err
    with pytest.raises(KitUsageError, match=r"S_NEW,S_CACHE,D"):
        attn_spec.check(decode_kernel, shapes=[text])


def test_a_decode_shape_is_a_batch_of_decode_calls():
    from attn_spec.checking.shapes import Rung, decode_case

    shape = Shape.parse("3,4,2,2,40,8,page=5")
    case = decode_case(shape, Rung(shape, "float32", "cpu"), seed=0)
    assert (case.batch, case.kv_heads, case.n_q, case.n_kv, case.page_size) == ((3, 4), 2, 2, 40, 5)
    assert case.cache_lengths[0] == 40 and all(2 <= n <= 40 for n in case.cache_lengths)


def test_decode_kernels_at_fixed_shapes(capsys):
    code = main(["check", f"{KERNELS}:paged_decode_kernel", "--shapes", "3,4,2,2,24,8,page=5", "--seed", "0"])
    out = capsys.readouterr().out
    assert code == 0 and "CONFORMS" in out and "not checked" not in out, out
    code = main(["check", "gallery.serving:paged_tail_read", "--shapes", "2,2,1,9,8,page=4", "--seed", "0",
                 "--only", "paged-outside-invariance"])
    out = capsys.readouterr().out
    assert code == 1 and "[page-tail-read]" in out and "page_size=4" in out, out
    code = main(["check", f"{KERNELS}:decode_kernel", "--shapes", "2,2,8,4,8", "--only", "decode-equals-full-causal"])
    out = capsys.readouterr().out
    assert code == 1 and "S_NEW=8 new tokens per sequence, more than its S_CACHE=4" in out, out


# -- grouped heads and softcap in varlen -----------------------------------------------------------

def test_the_header_says_whether_a_serving_kernel_takes_grouped_heads():
    from gallery.serving import decode_top_left, paged_tail_read

    assert make_target(load_target(f"{KERNELS}:varlen_kernel")).behaviour()["grouped-heads"] == "yes"
    assert make_target(decode_kernel).behaviour()["grouped-heads"] == "yes"
    for kernel in (paged_tail_read, decode_top_left):  # they broadcast [H] against [H_kv] and raise
        assert make_target(kernel).behaviour()["grouped-heads"] == "no (RuntimeError)"
    nested = make_target(load_target(f"{KERNELS}:nested_sdpa_varlen"))  # torch 2.13's nested SDPA: no enable_gqa
    assert nested.behaviour()["grouped-heads"].startswith("no")


@pytest.mark.slow
def test_a_varlen_kernel_that_tiles_grouped_heads_is_caught_with_grouped_heads_drawn():
    from gallery.serving import varlen_kv_heads_tiled

    report = attn_spec.check(varlen_kv_heads_tiled, profile="quick", seed=0, only=["varlen-equals-per-sequence"])
    result = report.targets[0].properties[0]
    assert result.status == "fail" and result.case.kv_heads and result.case.batch[-1] > result.case.kv_heads
    assert [d.mistake for d in report.targets[0].diagnoses] == ["varlen-kv-heads-tiled"]


@pytest.mark.slow
def test_a_varlen_kernel_that_ignores_softcap_is_named():
    from gallery.serving import varlen_softcap_ignored

    report = attn_spec.check(varlen_softcap_ignored, profile="quick", seed=0, only=["varlen-equals-per-sequence"])
    result = report.targets[0].properties[0]
    assert result.status == "fail" and "softcap=" in result.message, result.message
    assert [d.mistake for d in report.targets[0].diagnoses] == ["varlen-softcap-ignored"]


def test_the_varlen_reference_softcaps_and_groups():
    from attn_spec.serving_reference import varlen_reference
    from attn_spec.targets.serving_varlen import cu_seqlens

    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 2, generator=g, dtype=torch.float64) * 4  # [T_q, H, D]
    k, v = (torch.randn(5, 2, 2, generator=g, dtype=torch.float64) for _ in range(2))  # [T_k, H_kv, D]
    out, _ = varlen_reference(q, k, v, cu_seqlens([3]), cu_seqlens([5]), softcap=2.0)
    k4, v4 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)  # head h reads K/V head h // 2
    scores = torch.einsum("qhd,khd->hqk", q, k4) / math.sqrt(2)
    want = torch.einsum("hqk,khd->qhd", torch.softmax(2.0 * torch.tanh(scores / 2.0), -1), v4)
    assert torch.allclose(out, want, atol=1e-12)
    tiled, _ = varlen_reference(q, k, v, cu_seqlens([3]), cu_seqlens([5]), softcap=2.0, grouping="tiled")
    assert not torch.allclose(tiled, out)


def test_a_decode_case_with_grouped_heads_reads_them_grouped():
    from attn_spec.properties.serving.decode import decode_inputs

    q, k_full, _, lengths, _ = decode_inputs(Case(batch=(2, 2, 3), kv_heads=1, n_q=1, n_kv=4, cache_lengths=(4, 2)))
    assert q.shape == (2, 1, 6, 2) and k_full.shape == (2, 6, 2, 2) and lengths.tolist() == [4, 2]


def test_the_scale_ladder_decodes_one_token_over_each_length(monkeypatch):
    from attn_spec import properties
    from attn_spec.checking import shapes

    monkeypatch.setitem(shapes.SCALE_LENGTHS, "cpu", (40,))
    monkeypatch.setattr(shapes, "SCALE_HEAD_DIMS", (8,))
    (rung,) = shapes.rungs(None, devices=["cpu"])
    (case,) = shapes.fixed_cases(properties.catalog()["decode-equals-full-causal"], "decode", rung, seed=0)
    assert rung.ladder and (case.n_q, case.n_kv, case.cache_lengths) == (1, 40, (40,))
    report = attn_spec.check(decode_kernel, profile="scale", seed=0, devices=["cpu"], only=["decode-equals-full-causal"])
    assert report.conforms, str(report)
