"""No vacuous pass: a property holds only if its relation bit on the case and the output depends on the inputs."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import attn_spec
from attn_spec import properties, reference
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.diagnosis.mismatch import diagnose_mismatch, explain
from attn_spec.checking.runner import mark_blocked
from attn_spec.properties import catalog
from attn_spec.errors import Failure, Uninformative
from attn_spec.properties.informative import ignored_inputs, require_responsive
from attn_spec.report import PropertyResult
from attn_spec.targets.capabilities import supports
from attn_spec.targets.conventions import Target, make_target


def zeros(Q, K, V, mask=None):
    return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype, device=Q.device)


def values(Q, K, V, mask=None):
    return V


def noise(Q, K, V, mask=None):
    return torch.randn(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype, device=Q.device)


def dropout_left_on(Q, K, V, mask=None):  # noisy, yet its output follows its inputs
    return F.dropout(torch.softmax(Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1]), dim=-1), p=0.1) @ V


def _vacuity(fn, dtype="float64", case=None):
    try:
        require_responsive(fn if isinstance(fn, Target) else make_target(fn), case or Case(dtype=dtype))
    except Failure as failure:
        assert failure.vacuous
        return failure
    return None


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_a_correct_attention_responds_in_every_dtype(dtype):
    assert _vacuity(reference.reference_attention, dtype) is None
    assert _vacuity(F.scaled_dot_product_attention, dtype) is None


def test_a_multi_head_module_responds_through_its_own_forward():
    assert _vacuity(reference.MultiHeadAttention, case=MhaCase(n_q=3, n_kv=3, d_model=4, n_heads=2)) is None


@pytest.mark.parametrize("fn, ignored", [(zeros, "Q and K and V"), (values, "Q and K"), (noise, "random numbers")])
def test_an_output_that_ignores_inputs_makes_every_property_vacuous(fn, ignored):
    failure = _vacuity(fn)
    assert failure is not None and ignored in failure.cause and "only trivially" in failure.cause
    assert failure.message.startswith("the output") and "(call: attention(Q, K, V), then with" in failure.message
    assert ignored in ignored_inputs(make_target(fn), Case()) and "only trivially" not in ignored_inputs(make_target(fn), Case())


def test_noise_alone_is_not_taken_for_ignoring_the_inputs():
    for _ in range(3):
        assert _vacuity(dropout_left_on, "float32") is None


def test_the_probe_runs_once_per_target_kind_dtype_and_device():
    target = make_target(reference.reference_attention)
    require_responsive(target, Case(dtype="float32"))
    calls = target.calls
    require_responsive(target, Case(dtype="float32", n_q=5, seed=3))
    assert target.calls == calls > 0
    require_responsive(target, Case(dtype="float64"))
    assert target.calls > calls


def test_the_cases_that_probe_in_float32_share_one_probe_of_five_calls():
    """float16 and bfloat16 cases are probed in float32: their verdict is the float32 cases' (issue 25.5)."""
    target = make_target(reference.reference_attention)
    require_responsive(target, Case(dtype="float16"))
    assert target.calls == 5  # twice as it is (is it noisy?), once with each of Q, K, V replaced
    for dtype in ("float32", "bfloat16", "float16"):
        require_responsive(target, Case(dtype=dtype, n_q=3, seed=2))
    assert target.calls == 5


def test_a_target_the_probe_cannot_call_is_not_judged_by_it():
    def batched_only(Q, K, V, mask=None):
        if Q.dim() < 3:
            raise NotImplementedError("batched inputs only")
        return reference.reference_attention(Q, K, V, mask)

    assert _vacuity(batched_only) is None


def test_a_causal_only_target_is_probed_under_its_causal_mask():
    """A target that declines calls without a mask (nanoGPT's causal module) is probed with the causal one."""
    def causal_only(make):
        def attention(Q, K, V, mask=None):
            if mask is None:
                raise NotImplementedError("causal masks only")
            return make(Q, K, V, mask)
        return attention

    def probed(fn):  # a check probes the capabilities before any property runs
        target = make_target(fn)
        assert "none" not in supports(target).masks
        return target

    assert _vacuity(probed(causal_only(reference.reference_attention))) is None
    failure = _vacuity(probed(causal_only(values)))
    assert failure is not None and "Q and K" in failure.cause
    assert "(call: attention(Q, K, V, causal mask), then with" in failure.message


def test_an_uninformative_case_is_drawn_again():
    with pytest.raises(Uninformative):  # a mask that masks no key
        properties.mask_semantics(reference.reference_attention, Case(n_q=2, n_kv=2, mask="none"))
    with pytest.raises(Uninformative):  # one batch element: nothing to be independent of
        properties.batch_independence(reference.reference_attention, Case(batch=(1,), n_q=2, n_kv=2))
    with pytest.raises(Uninformative):  # one token: no permutation moves anything
        properties.permutation_equivariance(reference.MultiHeadAttention,
                                            MhaCase(n_q=1, n_kv=1, d_model=4, n_heads=2, self_attention=True))
    with pytest.raises(Uninformative):  # Q = 0: shifting the keys moves no score
        properties.key_shift_invariance(reference.reference_attention, Case(n_q=2, n_kv=3, magnitude=0.0))


def test_vacuous_failures_are_blocked_by_the_root_and_block_nothing():
    rows = [PropertyResult("rows-sum-to-one", "fail", vacuous=True),
            PropertyResult("matches-reference", "fail"),
            PropertyResult("mask-semantics", "fail", vacuous=True),
            PropertyResult("value-linearity", "pass")]
    mark_blocked(rows, catalog())
    assert [r.blocked_by for r in rows] == ["matches-reference", None, "matches-reference", None]
    alone = [PropertyResult("permutation-equivariance", "fail", vacuous=True)]  # the root was not run
    mark_blocked(alone, catalog())
    assert alone[0].blocked_by is None


@pytest.mark.parametrize("make, words", [
    (lambda q, k, v: torch.zeros(3, 2, dtype=torch.float64), "all zeros"),
    (lambda q, k, v: v, "V itself"),
    (lambda q, k, v: q, "Q itself"),
    (lambda q, k, v: v.mean(dim=0, keepdim=True).expand(3, 2), "mean of V"),
    (lambda q, k, v: torch.full((3, 2), 0.25, dtype=torch.float64), "constant 0.25"),
])
def test_the_root_names_an_output_that_is_no_attention(make, words):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, generator=gen, dtype=torch.float64) for _ in range(3))
    assert words in diagnose_mismatch(make(q, k, v), q, k, v, None, 1e-12)


def _wrong(scale=None, dim=-1, ignore_mask=False):
    """A classic mistake written out by hand: the properties' causes must name it."""
    def attention(q, k, v, mask):
        s = q @ k.transpose(-2, -1) * (q.shape[-1] ** -0.5 if scale is None else scale(q.shape[-1]))  # [Tq, Tk]
        if mask is not None and not ignore_mask:
            s = s.masked_fill(~mask, -math.inf)
        return torch.softmax(s, dim=dim) @ v  # [Tq, Dv]
    return attention


@pytest.mark.parametrize("wrong, masked, words", [
    (_wrong(scale=lambda d: 1.0), False, "not scaled (missing 1/sqrt(d_k))"),
    (_wrong(scale=lambda d: 1 / d), False, "scaled by 1/d_k instead of 1/sqrt(d_k)"),
    (_wrong(scale=lambda d: d ** 0.5), False, "multiplied by sqrt(d_k)"),
    (_wrong(dim=-2), False, "the softmax runs over the query axis"),
    (_wrong(dim=-2), True, "the softmax runs over the query axis"),
    (_wrong(ignore_mask=True), True, "the mask is ignored"),
])
def test_the_cause_names_a_classic_mistake(wrong, masked, words):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    mask = reference.causal_mask(3, 3) if masked else None
    assert words in diagnose_mismatch(wrong(q, k, v, mask), q, k, v, mask, 1e-9)


def test_a_mismatch_is_worded_by_the_catalog_model_that_reproduces_it():
    """mismatch asks the catalog: its causes are the models' own words (Mistake.cause_for), written nowhere else."""
    from pathlib import Path

    from attn_spec.diagnosis import MISTAKES
    from attn_spec.diagnosis import mismatch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    for mid, scale in (("scale-missing", 1.0), ("scale-one-over-dk", 1 / 4), ("scale-temperature", 1 / 8)):
        got = reference.attention(q, k, v, scale=scale)[0]
        assert diagnose_mismatch(got, q, k, v, None, 1e-9) == MISTAKES[mid].cause_for(temperature=4)
    source = Path(mismatch.__file__).read_text()
    assert not [m.id for m in MISTAKES.values() if (m.cause or m.sentence)[:24] in source]


def _max_over_queries(Q, K, V, mask=None):  # the stabilising max over dim=-2: not shift invariant
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    e = torch.exp(s - s.amax(dim=-2, keepdim=True))
    return e / e.sum(dim=-1, keepdim=True) @ V


def _max_over_tensor(Q, K, V, mask=None):  # the stabilising max over the whole tensor: rows underflow to 0/0
    s = Q @ K.transpose(-2, -1) / math.sqrt(Q.shape[-1])
    e = torch.exp(s - s.max())
    return e / e.sum(dim=-1, keepdim=True) @ V


def _softcap_without_factor(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                            softcap=None):  # tanh(s / cap): the cap's factor forgotten
    s = query @ key.transpose(-2, -1) / math.sqrt(query.shape[-1])
    s = s if softcap is None else torch.tanh(s / softcap)
    return torch.softmax(s if attn_mask is None else s.masked_fill(~attn_mask, -math.inf), dim=-1) @ value


@pytest.mark.parametrize("fn, pid, mid", [(_max_over_queries, "key-shift-invariance", "max-over-queries"),
                                          (_max_over_tensor, "numerical-stability", "max-over-tensor"),
                                          (_softcap_without_factor, "softcap", "softcap-without-factor")])
def test_a_key_shift_large_scores_and_a_softcap_are_worded_by_the_catalog(fn, pid, mid):
    """key-shift-invariance, numerical-stability and softcap ask the catalog too: their cause is the reproducing
    model's own words (Mistake.cause_for), which those property files do not write."""
    from pathlib import Path

    from attn_spec.diagnosis import MISTAKES

    report = attn_spec.check(fn, profile="quick", seed=0, devices=["cpu"], dtypes=["float64"], only=[pid],
                             diagnose=False)
    (row,) = json.loads(report.to_json())["targets"][0]["properties"]
    assert row["status"] == "fail" and row["cause"] == MISTAKES[mid].cause_for()
    files = ("softmax.py", "scores.py", "numerics.py")
    source = "".join((Path(properties.__file__).parent / name).read_text() for name in files)
    assert not [m.id for m in MISTAKES.values() if m.cause and m.cause[:24] in source]


def test_the_cause_names_a_bshd_kernel_that_attends_over_the_heads():
    def kernel(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):  # [B, S, H, D], read as [B, H, S, D]
        return F.scaled_dot_product_attention(q, k, v, scale=softmax_scale, is_causal=causal)

    target = make_target(kernel, convention="sdpa", layout="bshd")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))  # [B, H, S, D]
    got = target.attend(q, k, v, None)
    assert "attends over the heads instead of the sequence" in explain(target, got, q, k, v, None, 1e-9)
    assert explain(make_target(kernel, convention="sdpa", layout="bhsd"), got, q, k, v, None, 1e-9) == ""


def test_json_marks_the_vacuous_rows():
    report = attn_spec.check(zeros, profile="quick", seed=1, devices=["cpu"], dtypes=["float64"],
                             only=["matches-reference", "permutation-equivariance", "determinism"])
    rows = {p["id"]: p for p in json.loads(report.to_json())["targets"][0]["properties"]}
    assert rows["matches-reference"]["vacuous"] is False and rows["matches-reference"]["blocked_by"] is None
    assert "all zeros" in rows["matches-reference"]["cause"]
    for pid in ("permutation-equivariance", "determinism"):
        assert rows[pid]["status"] == "fail" and rows[pid]["vacuous"] is True
        assert rows[pid]["blocked_by"] == "matches-reference"
