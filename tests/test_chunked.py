"""The chunked float64 reference and the chunked same-dtype implementations behind the error budget
(``attn_spec.checking.chunked``, ``tolerance.by_rows``, ``grad_tolerance``), against the one-shot
reference (``attn_spec.reference``) and the exact sympy oracle, with chunks of a row or two so that
small inputs exercise every path long ones take."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from test_reference import Inputs, error_bound, inputs

from attn_spec import reference
from attn_spec.checking import chunked, grad_tolerance, tolerance
from attn_spec.checking.cases import Case
from attn_spec.exact import exact_attention

FAST = settings(max_examples=25, deadline=None, database=None)


def rows_per_chunk(x, rows=2) -> int:
    """chunk_bytes that make chunks of ``rows`` query rows for these inputs."""
    return 8 * x.k.shape[-2] * rows


@pytest.fixture
def tiny_chunks(monkeypatch):
    """Chunks of 3 rows of 8 keys on the CPU: every 'long' path runs on small inputs."""
    monkeypatch.setitem(chunked.CHUNK_BYTES, "cpu", 8 * 8 * 3)


@FAST
@given(inputs())
def test_chunked_reference_matches_the_one_shot_reference(x):
    """Masks (bool, float, per batch element), causal, scale, broadcast batch dims, cross shapes."""
    for alignment in ("top-left", "bottom-right"):
        expected, _ = reference.attention(x.q, x.k, x.v, x.mask, causal=x.causal, scale=x.scale,
                                          causal_alignment=alignment)
        got = chunked.attention(x.q, x.k, x.v, x.mask, causal=x.causal, scale=x.scale, causal_alignment=alignment,
                                chunk_bytes=rows_per_chunk(x))
        assert got.dtype == torch.float64 and got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 2 * x.bound()


@settings(max_examples=10, deadline=None, database=None)
@given(inputs(max_len=3, max_dim=3, max_batch=1, magnitudes=(0.5, 1.0, 8.0)))
def test_chunked_reference_is_within_rounding_of_exact(x):
    got = chunked.attention(x.q, x.k, x.v, x.mask, causal=x.causal, scale=x.scale, chunk_bytes=8 * x.k.shape[-2])
    exact = exact_attention(x.q, x.k, x.v, x.sdpa_mask(), scale=x.scale)
    assert (got - exact).abs().max().item() <= x.bound()


def test_padding_mask_and_rows_with_no_key():
    """A [..., 1, Tk] key-padding mask serves every row; a row with no allowed key gives zeros."""
    case = Case(batch=(3, 2), n_q=5, n_kv=9, d_k=4, d_v=3, values="normal", mask="padding", seed=3)
    q, k, v, mask = case.tensors()
    assert mask.shape == (3, 2, 1, 9) and mask.any(dim=-1).all() and not mask.all()
    expected, _ = reference.attention(q, k, v, mask)
    got = chunked.attention(q, k, v, mask, chunk_bytes=8 * 9 * 2)
    assert (got - expected).abs().max().item() <= 2 * error_bound(q, k, v)
    empty = torch.ones(5, 9, dtype=torch.bool)
    empty[2] = False  # query 2 may attend nothing
    got = chunked.attention(q, k, v, empty, chunk_bytes=8 * 9)
    assert got[..., 2, :].abs().max() == 0 and got[..., 1, :].abs().max() > 0


def test_reference_output_is_the_one_shot_reference_when_it_fits_and_chunked_beyond(tiny_chunks):
    small = Case(n_q=1, n_kv=3, d_k=2, d_v=2, values="normal").tensors()
    assert chunked.fits(*small)
    assert torch.equal(chunked.reference_output(*small), reference.attention(*small)[0])
    x = Inputs.build(seed=2, n_q=7, n_kv=8, d_k=3, d_v=2, batch_q=(2,), batch_k=(2,), batch_v=(2,), mask="bool")
    assert not chunked.fits(x.q, x.k, x.v, x.mask)
    got = chunked.reference_output(x.q, x.k, x.v, x.mask)
    assert (got - reference.attention(x.q, x.k, x.v, x.mask)[0]).abs().max().item() <= 2 * x.bound()
    assert len(chunked.row_chunks(7, 8, chunked.CHUNK_BYTES["cpu"])) == 3  # rows 0-2, 3-5, 6


@pytest.mark.parametrize("absolute", [False, True])
@pytest.mark.parametrize("mask", [None, "bool", "float"])
def test_chunked_reference_gradients_match_the_closed_form(tiny_chunks, mask, absolute):
    x = Inputs.build(seed=5, n_q=7, n_kv=8, d_k=3, d_v=4, batch_q=(2,), batch_k=(1,), batch_v=(2,), mask=mask,
                     mask_batch=(2,))
    grad_out = torch.randn(2, 7, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    chunked_grads = grad_tolerance.reference_grads(x.q, x.k, x.v, x.mask, grad_out, absolute=absolute)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(chunked.CHUNK_BYTES, "cpu", 2**24)  # one shot
        one_shot = grad_tolerance.reference_grads(x.q, x.k, x.v, x.mask, grad_out, absolute=absolute)
    for got, want in zip(chunked_grads, one_shot):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item())


def _close(got, want, bound) -> bool:
    """Equal NaN pattern (a row with no allowed key is 0/0 in a naive form) and values within ``bound``."""
    got, want = got.double(), want.double()
    return torch.equal(got.isnan(), want.isnan()) and (got - want).nan_to_num(0.0).abs().max().item() <= bound


def _same_dtype_bound(x, dtype):
    return 64 * torch.finfo(dtype).eps * max(1.0, x.v.abs().max().item()) * (math.sqrt(x.k.shape[-2]) + 8)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_chunked_naive_implementations_round_like_the_one_shot_ones(tiny_chunks, dtype, causal):
    """By rows, each naive form does each row's arithmetic as the one-shot form does: same values
    up to the matmul's own blocking, so the budget they set is the same."""
    x = Inputs.build(seed=6, n_q=7, n_kv=8, d_k=3, d_v=2, batch_q=(2,), batch_k=(2,), batch_v=(2,), mask="bool",
                     mask_batch=(2,))
    q, k, v = (t.to(dtype) for t in (x.q, x.k, x.v))
    mask = x.mask & reference.causal_mask(7, 8) if causal else x.mask
    for impl in (tolerance.naive_attention, tolerance.seed_attention):
        got = tolerance.by_rows(impl, q, k, v, x.mask, causal=causal)
        assert _close(got, impl(q, k, v, mask), _same_dtype_bound(x, dtype))
    grad_out = torch.randn(2, 7, 2, generator=torch.Generator().manual_seed(2), dtype=dtype)
    chunked_grads = grad_tolerance.naive_grads(tolerance.naive_attention, q, k, v, x.mask, grad_out)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(chunked.CHUNK_BYTES, "cpu", 2**24)
        one_shot = grad_tolerance.naive_grads(tolerance.naive_attention, q, k, v, x.mask, grad_out)
    for got, want in zip(chunked_grads, one_shot):
        assert _close(got, want, _same_dtype_bound(x, dtype) * 8)


def test_budget_of_a_long_case_is_the_one_shot_budget(tiny_chunks):
    q, k, v, mask = Case(batch=(2,), n_q=9, n_kv=8, d_k=4, d_v=3, dtype="float32", values="normal", mask="random",
                         seed=4).tensors()
    ref = chunked.reference_output(q, k, v, mask)
    long_budget = tolerance.budget(q, k, v, mask, ref)
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(chunked.CHUNK_BYTES, "cpu", 2**24)
        one_shot = tolerance.budget(q, k, v, mask, ref)
    assert long_budget == pytest.approx(one_shot, rel=0.1)  # 0.97 to 1.03 over seeds
    assert long_budget >= tolerance.FLOOR_ULPS * tolerance.floor_unit(q, k, v)


def test_row_peaks_are_the_largest_allowed_scores(tiny_chunks):
    q, k, _, mask = Case(batch=(2,), n_q=9, n_kv=8, d_k=4, d_v=3, values="normal", mask="random", seed=8).tensors()
    scores = (q @ k.transpose(-2, -1) / 2).masked_fill(~mask, 0.0)  # [2, Tq, Tk], scale 1/sqrt(4)
    expected = scores.gather(-1, scores.abs().argmax(dim=-1, keepdim=True))[..., 0]
    assert torch.allclose(chunked.row_peaks(q, k, mask), expected, rtol=1e-12, atol=0)
