"""Long cases judged on chosen rows (attn_spec.checking.rows): which rows, that they are exact, the cache,
and the gallery of kernels wrong only in some rows (tests/gallery/rows.py) caught at every rung, forward and
backward (the gradients' upstream G given on the chosen rows only: grad_tolerance.judged_backward)."""
from __future__ import annotations

import json
import re

import pytest
import torch

import attn_spec
from attn_spec.checking import chunked, grad_tolerance, rows
from attn_spec.checking.tolerance import budget, max_error
from attn_spec.errors import Failure
from gallery.rows import GRAD_ROW_BUGS, ROW_BUGS, backward_correct, sdpa_rows

RUNGS = ["2,2,1100,64", "2,2,4100,64"]  # about 1k and 4k rows, neither a multiple of a tile: both judged on chosen rows


def test_the_rows_chosen_are_where_kernel_bugs_live():
    why = rows.choose(4100, 4100)
    for row in (0, 1, 4098, 4099, 15, 16, 17, 63, 64, 65, 127, 128, 129, 1023, 1024, 4096, 4097):
        assert row in why, row
    assert "last partial tile" in why[4097] or "power of two" in why[4097]
    assert any("random" in reason for reason in why.values())
    assert all(0 <= r < 4100 for r in why) and list(why) == sorted(why)
    bottom_right = rows.choose(100, 1000)  # bottom-right: row i's last key is i + 900
    assert "causal edge (key 959, offset 900)" in bottom_right[59]  # its last key ends the key tile 960 = 15 x 64
    again = rows.choose(4100, 4100)  # the same rows where kernels go wrong every time: a failure there reproduces
    assert _fixed(again) == _fixed(why) and len(again) == len(why)
    assert set(again) != set(why)  # the random ones drawn afresh by the kit's own generator: no target can know them
    assert len(rows.choose(16384, 16384)) <= 120 and len(rows.choose(131072, 131072)) <= 140  # O(k n d), k small


def _fixed(why: dict) -> dict:
    """The rows chosen for where kernels go wrong (not the random ones)."""
    return {row: reason for row, reason in why.items() if reason != "drawn at random"}


def test_a_short_case_is_judged_whole_as_before():
    q, k, v = (torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    ref = rows.reference(q, k, v)
    full = chunked.reference_output(q, k, v)
    assert ref.why is None and torch.equal(ref.exact, full) and ref.budget == budget(q, k, v, None, full)


@pytest.mark.parametrize("causal", [False, True])
def test_chosen_rows_are_the_whole_reference_s_rows_and_budgets_are_alike(causal):
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 1500, 16, generator=gen) for _ in range(3))
    mask = torch.rand(1, 1, 1, 1500, generator=gen) > 0.2  # padding
    ref = rows.reference(q, k, v, mask, causal=causal)
    assert ref.why is not None and len(ref.why) < 100
    full = chunked.attention(q, k, v, mask, causal=causal)  # [1, 2, 1500, 16] float64
    assert max_error(ref.exact, ref.rows_of(full)) < 1e-14
    whole = budget(q, k, v, mask, full, causal=causal)
    assert 0.5 * whole <= ref.budget <= 1.05 * whole  # the same floor; the naive error sampled on fewer rows
    got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask if not causal else
                                                           mask & torch.ones(1500, 1500, dtype=torch.bool).tril())
    assert ref.holds(got)
    ref.check(got, what="the output against the float64 reference")


def test_one_reference_per_case_shared_and_bounded(monkeypatch):
    rows.clear()
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 1500, 16, generator=gen) for _ in range(3))
    first = rows.reference(q, k, v)
    assert rows.reference(q.clone(), k.clone(), v.clone()) is first  # the same values: the same reference
    q2 = q.clone()
    q2[0, 0, 700, 3] += 1.0
    assert rows.reference(q2, k, v) is not first  # one value differs: computed again
    q[0, 0, 0, 0] += 1.0  # the caller writes into its tensors: the copies kept are unchanged
    assert rows.reference(q, k, v) is not first
    inputs = rows._nbytes(q, k, v)
    monkeypatch.setitem(rows.CACHE_BYTES, "cpu", int(2.1 * inputs))
    newest = rows.reference(q2, k, v, causal=True)
    assert list(rows._CACHE.values())[-1][1] is newest and len(rows._CACHE) == 1  # beyond the bound: the newest
    monkeypatch.setitem(rows.CACHE_BYTES, "cpu", inputs)  # inputs above half the bound: neither copied nor kept
    assert rows.reference(q, k, v, causal=True).why is not None and len(rows._CACHE) == 1
    rows.clear()


def _named_row(message):
    found = re.search(r"at query row (\d+)", message)
    assert found, message
    return int(found.group(1))


@pytest.mark.slow
@pytest.mark.parametrize("shape", RUNGS)
@pytest.mark.parametrize("name", sorted(ROW_BUGS))
def test_kernels_wrong_in_some_rows_are_caught_at_every_rung(name, shape):
    fn, wrong = ROW_BUGS[name]
    report = attn_spec.check(fn, shapes=[shape], dtypes=["float32"], devices=["cpu"], only=["matches-reference"],
                             diagnose=False)
    result = report.targets[0].properties[0]
    assert result.status == "fail", (name, shape, result.message)
    n_q = int(shape.split(",")[2])
    assert _named_row(result.message) in wrong(n_q), result.message  # the failure names a row it gets wrong
    if set(wrong(n_q)) & set(rows.choose(n_q, n_q)):  # among the rows judged exactly: named with why it was chosen
        assert "(chosen: " in result.message, result.message
    else:
        assert "not one of the" in result.message, result.message


@pytest.mark.slow
@pytest.mark.parametrize("shape", RUNGS)
def test_the_same_kernel_without_its_mistake_conforms_and_the_header_says_how_rows_were_judged(shape):
    report = attn_spec.check(sdpa_rows, shapes=[shape], dtypes=["float32"], devices=["cpu"],
                             only=["matches-reference", "causal-mask", "numerical-stability"])
    assert report.conforms, str(report)
    n_q = int(shape.split(",")[2])
    k = len(rows.choose(n_q, n_q))
    assert f"rows judged exactly: {k} of {n_q} in each of the 4 batch elements x heads" in str(report)
    assert json.loads(report.to_json())["rows_judged"][shape].startswith(f"rows judged exactly: {k} of {n_q}")


def test_the_gradients_of_the_chosen_rows_are_those_of_the_whole_case():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 1500, 16, generator=gen) for _ in range(3))
    mask = torch.ones(1500, 1500, dtype=torch.bool).tril()
    g = torch.randn(1, 2, 1500, 16, generator=gen)
    judged = grad_tolerance.judged_backward(q, k, v, mask, g)
    assert _fixed(judged.why) == _fixed(rows.choose(1500, 1500)) and judged.q.shape[-2] == len(judged.why)
    off = torch.ones(1500, dtype=torch.bool)
    off[judged.index] = False
    assert not judged.upstream[..., off, :].any()  # G is zero off the chosen rows
    expected, allowed = judged.reference_and_budgets()
    whole = grad_tolerance.reference_grads(q, k, v, mask, judged.upstream)  # O(n^2 d): the whole case, same G
    for got, want in zip(expected, whole):
        assert max_error(got, want) < 1e-12
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=mask)
    sdpa = torch.autograd.grad(out, leaves, judged.upstream)
    assert all(max_error(got, want) <= budget for got, want, budget in zip(sdpa, expected, allowed))
    assert not sdpa[0][..., off, :].any()  # a row without G has no dQ


@pytest.mark.slow
@pytest.mark.parametrize("shape", RUNGS)
@pytest.mark.parametrize("name", sorted(GRAD_ROW_BUGS))
def test_backwards_wrong_in_some_rows_are_caught_at_every_rung(name, shape):
    fn, wrong = GRAD_ROW_BUGS[name]
    report = attn_spec.check(fn, shapes=[shape], dtypes=["float32"], devices=["cpu"], only=["gradients"],
                             diagnose=False)
    result = report.targets[0].properties[0]
    assert result.status == "fail", (name, shape, result.message)
    if wrong is not None:  # dQ is wrong: the failure names a chosen row it gets wrong, and why it was chosen
        n_q = int(shape.split(",")[2])
        assert _named_row(result.message) in wrong(n_q) and "(chosen: " in result.message, result.message


@pytest.mark.slow
@pytest.mark.parametrize("shape", RUNGS)
def test_the_same_backward_without_its_mistake_conforms(shape):
    report = attn_spec.check(backward_correct, shapes=[shape], dtypes=["float32"], devices=["cpu"],
                             only=["gradients"])
    assert report.conforms, str(report)


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_a_long_case_is_drawn_once_and_handed_out_as_fresh_copies(mask):
    from attn_spec.checking.cases import _KEPT, Case
    case = Case(batch=(1, 2), n_q=3000, n_kv=3000, d_k=8, d_v=8, values="normal", mask=mask, dtype="float32", seed=1)
    first = case.tensors()
    assert case in _KEPT and (mask != "causal" or _KEPT[case][3] is None)  # no [n_q, n_kv] mask is kept
    first[0].add_(1.0)  # a target writes into what it got: the next copy is as drawn
    for again, drawn in zip(case.tensors(), case._draw()):
        assert (again is None and drawn is None) or (torch.equal(again, drawn) and again.stride() == drawn.stride())
