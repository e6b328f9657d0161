"""Paged KV caches through the decode convention's block_table: the float64 reference's paged path, a paged cache only
for a kernel whose signature names block_table, the paged kernels of examples/ checked with no flags, and what
FlexAttention's PagedAttention does in eager mode on the CPU."""
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec.cli import main
from attn_spec.targets.conventions import make_target
from attn_spec.targets.loading import load_target
from attn_spec.serving_reference import decode_reference, gather_pages

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
examples_paged = load_target(f"{EXAMPLES / 'serving_kernels.py'}:paged_decode_kernel")
PAGED = ["paged-equals-contiguous", "paged-outside-invariance", "paged-append-writes-exactly", "paged-capacity-contract"]


def _paged_copy(cache, page, extra_pages, gen):
    """cache [B, n, H, D] (n a multiple of page) in a scrambled pool with spare pages: (pool, block_table)."""
    B, n = cache.shape[:2]
    width = n // page
    pool = torch.randn(B * width + extra_pages, page, *cache.shape[2:], generator=gen, dtype=cache.dtype)
    table = torch.randperm(pool.shape[0], generator=gen)[:B * width].view(B, width).to(torch.int32)
    pool[table.long()] = cache.view(B, width, page, *cache.shape[2:])
    return pool, table


@pytest.mark.parametrize("page", [1, 3, 12])
def test_the_paged_reference_is_the_contiguous_one_through_the_block_table(page):
    g = torch.Generator().manual_seed(page)
    B, n, S, H, D = 2, 12, 2, 2, 4
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    caches = [torch.randn(B, n, H, D, generator=g, dtype=torch.float64) for _ in range(2)]
    k_new, v_new = (torch.randn(B, S, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    seqlens = torch.tensor([5, 10])
    pools = [_paged_copy(t, page, 3, torch.Generator().manual_seed(1)) for t in caches]  # the same table for both
    table = pools[0][1]
    assert torch.equal(gather_pages(pools[0][0], table), caches[0])
    want = decode_reference(q, *caches, seqlens, k_new, v_new)
    got = decode_reference(q, pools[0][0], pools[1][0], seqlens, k_new, v_new, block_table=table)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(gather_pages(got[2], table), want[2]) and torch.equal(gather_pages(got[3], table), want[3])
    spare = torch.ones(pools[0][0].shape[0], dtype=torch.bool)
    spare[table.long().flatten()] = False
    assert torch.equal(got[2][spare], pools[0][0][spare])  # pages the table does not list are left alone
    with pytest.raises(ValueError, match="capacity"):
        decode_reference(q, pools[0][0], pools[1][0], torch.tensor([5, n - S + 1]), k_new, v_new, block_table=table)


def test_a_paged_cache_only_for_a_kernel_whose_signature_names_block_table():
    def contiguous(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, causal=False):
        return q

    def anything(q, k_cache, v_cache, **kwargs):
        return q

    for kernel in (contiguous, anything):
        target = make_target(kernel)
        assert "block_table" not in target.accepts and target.paged().startswith("no")
        report = attn_spec.check(kernel, profile="quick", seed=0, only=PAGED[:1])
        result = report.targets[0].properties[0]
        assert result.status == "skip" and "takes no block_table" in result.message, result.message
    paged = make_target(load_target(f"{EXAMPLES / 'serving_kernels.py'}:paged_decode_kernel"))
    assert "block_table" in paged.accepts and "paged caches: yes" in paged.notes()[1]


def test_a_kernel_that_takes_only_large_pages_is_checked_on_multiples_of_them():
    """flash-attn 2 takes page sizes that are multiples of 256 only: the header says so, and the paged properties
    draw such pages (rather than failing it on page 1)."""
    def pages_of_16(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
        if block_table is not None and k_cache.shape[1] % 16:
            raise RuntimeError("Paged KV cache block size must be divisible by 16")
        return examples_paged(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal)

    target = make_target(pages_of_16)
    assert target.behaviour()["page-sizes"] == "multiples of 16 (page 1: RuntimeError)"
    report = attn_spec.check(pages_of_16, profile="quick", seed=0, only=PAGED)
    assert report.conforms, str(report)


def test_the_paged_reference_kernel_conforms_with_no_flags(capsys):
    code = main(["check", f"{EXAMPLES / 'serving_kernels.py'}:paged_decode_kernel", "--profile", "quick", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 0 and "(decode convention): CONFORMS" in out, out
    assert all(f"{pid}  " in out for pid in PAGED) and "paged caches: yes" in out


@pytest.mark.slow
def test_flex_paged_attention_in_eager_mode_conforms_and_its_zero_weighted_reads_are_reported():
    """FlexAttention's PagedAttention on the CPU, in eager mode, through examples/flex_paged_decode.py: its eager path
    materialises the scores over the whole pool and multiplies every slot's value by its weight 0, so NaN in a free
    slot gives NaN. A behaviour (its compiled kernels skip masked blocks), probed and reported like the dense
    masked-nan; the invariance properties then poison unread rows with a finite stale value, and it conforms."""
    pytest.importorskip("torch.nn.attention.experimental._paged_attention")
    report = attn_spec.check(load_target(f"{EXAMPLES / 'flex_paged_decode.py'}:flex_paged_decode"), profile="quick",
                             seed=1)
    target = report.targets[0]
    assert target.conforms, str(report)
    assert "NaN in unread cache rows: propagates" in str(report)


def test_a_kernel_that_multiplies_free_pages_by_zero_is_named_where_the_probe_found_nan_ignored():
    """The probe reads a contiguous cache; a kernel that is right there but multiplies every pool slot by its weight
    over a paged cache fails paged-outside-invariance on NaN, with the root that says so."""
    from gallery.serving import paged_free_slots_times_zero

    report = attn_spec.check(paged_free_slots_times_zero, profile="quick", seed=0, only=PAGED)
    target = report.targets[0]
    assert "NaN in unread cache rows: ignored" in str(report)
    assert {p.id for p in target.properties if p.status == "fail"} == {"paged-outside-invariance"}, str(report)
    assert [(d.mistake, d.root) for d in target.diagnoses] == [("masked-slots-times-zero", "paged-outside-invariance")]


def test_a_kernel_that_takes_only_paged_caches_is_probed_through_pages():
    """The unread-nan probe asks a kernel that refuses a contiguous cache through a block table instead: Flex's
    adapter made paged-only still reads as "propagates", the reference paged kernel as "ignored"."""
    def paged_only(kernel):
        def decode(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None, causal=False):
            if block_table is None:
                raise ValueError("a block_table is required")
            return kernel(q, k_cache, v_cache, k, v, cache_seqlens, block_table, causal=causal)
        return decode

    pytest.importorskip("torch.nn.attention.experimental._paged_attention")
    flex = load_target(f"{EXAMPLES / 'flex_paged_decode.py'}:flex_paged_decode")
    assert make_target(paged_only(flex)).behaviour()["unread-nan"] == "propagates"
    assert make_target(paged_only(examples_paged)).behaviour()["unread-nan"] == "ignored"


def test_a_kernel_that_reads_the_unread_row_is_not_taken_for_one_that_propagates_nan():
    """A kernel that reads the last page whole attends the probe's row past cache_seqlens with a nonzero weight: a
    finite value there moves its output, so the probe says "read", and the invariance properties keep NaN."""
    from gallery.serving import paged_tail_read

    assert make_target(paged_tail_read).behaviour()["unread-nan"].startswith("read (a bug")
    report = attn_spec.check(paged_tail_read, profile="quick", seed=0, only=["paged-outside-invariance"])
    result = report.targets[0].properties[0]
    assert result.status == "fail" and "with NaN in the" in result.message, result.message


def test_a_silent_read_past_the_block_table_is_a_failure_that_names_the_overrun():
    from gallery.serving import paged_block_table_overrun

    report = attn_spec.check(paged_block_table_overrun, profile="quick", seed=0, only=PAGED[3:])
    result = report.targets[0].properties[0]
    assert result.status == "fail" and "past the block table's capacity" in result.message, result.message
    assert [d.mistake for d in report.targets[0].diagnoses] == ["block-table-overrun"]


def test_explain_teaches_a_paged_mistake(capsys):
    assert main(["explain", "page-tail-read"]) == 0
    out = capsys.readouterr().out
    assert "unfilled tail" in out and "def page_tail_read" in out
