"""A kernel's envelope is a declaration: its own refusals (head dims, dtypes, d_v != d_k, n_q != n_kv) are probed in
the header, the check draws inside them, the verdict line names them, and ``--require`` turns a gap into a failure.
Inside the envelope the bugs kernels ship are caught, each with a root (tests/gallery/kernels.py: plain-torch stand-ins
that declare envelopes as Triton and CUDA kernels do)."""
import json
import xml.etree.ElementTree as ET

import pytest
from hypothesis import given, settings
import torch

import attn_spec
from attn_spec.checking import strategies, tolerance
from attn_spec.checking.cases import Case
from attn_spec.errors import KitUsageError
from attn_spec.reference import attention
from attn_spec.targets.capabilities import probe_capabilities
from attn_spec.targets.conventions import make_target
from attn_spec.targets.envelope import fit_widths
from gallery import kernels

QUICK = dict(profile="quick", seed=1)
FLASH_ENVELOPE = "within head dims 16/32/64/128, no masks, self-attention only, d_v = d_k only, float16 and bfloat16 only"


def test_the_probes_read_a_kernels_own_refusals_as_its_envelope_and_a_crash_as_none():
    target = make_target(kernels.flash)
    values, lacks = probe_capabilities(target)
    assert values["head-dims"] == "16/32/64/128" and "head dim 1: 16, 32, 64 or 128 only" in lacks["head-dims"]
    assert [values[name] for name in ("float64", "float32", "float16", "bfloat16")] == ["no", "no", "yes", "yes"]
    assert values["cross"] == values["dv-ne-dk"] == "no" and "its own check" in lacks["cross"]
    taken = target.supported
    assert taken.head_dims == (16, 32, 64, 128) and taken.dtypes == ("float16", "bfloat16") and not taken.cross

    def crashes_at_width_3(q, k, v, is_causal=False, scale=None):  # an index error inside the computation
        return torch.nn.functional.scaled_dot_product_attention(q, k, v[..., [0, 1, 2, 5][:v.shape[-1]]]
                                                                if v.shape[-1] == 3 else v, is_causal=is_causal)
    values, _ = probe_capabilities(make_target(crashes_at_width_3), dtypes=("float32",))
    assert values["head-dims"] == "yes"  # a crash is no declaration: width 3 is drawn, and fails


def test_a_correct_kernel_conforms_within_its_envelope_in_every_format():
    report = attn_spec.check(kernels.flash, only=["matches-reference", "rows-sum-to-one", "scale-sqrt-dk"], **QUICK)
    (t,) = report.targets
    assert t.conforms and t.verdict == f"CONFORMS {FLASH_ENVELOPE}", t.verdict
    assert all(p.status == "pass" for p in t.properties), [(p.id, p.message) for p in t.properties]
    data = json.loads(report.to_json())["targets"][0]
    assert data["verdict"] == t.verdict and data["envelope"][0]["phrase"] == "within head dims 16/32/64/128"
    assert t.verdict in report.render("markdown")
    assert ET.fromstring(report.render("junit")).find(".//property[@name='verdict']").get("value") == t.verdict


def test_require_turns_a_gap_in_the_envelope_into_a_failure():
    report = attn_spec.check(kernels.flash, only=["scale-sqrt-dk"], require=["head-dims=1-256", "dtypes=float32"],
                             **QUICK)
    results = {p.id: p for p in report.targets[0].properties}
    assert results["capability:head-dims"].status == results["capability:dtypes"].status == "fail"
    assert results["capability:head-dims"].message.startswith("required head-dims=1-256, found head dims 1, 2, 3, 8, "
                                                             "24, 96, 256 refused")
    assert results["capability:dtypes"].message.startswith("required dtypes=float32, found float32 no: its own check")
    met = attn_spec.check(kernels.flash, only=["scale-sqrt-dk"], require=["head-dims=16-16", "dtypes=float16"],
                          **QUICK).targets[0]
    assert met.conforms, [(p.id, p.message) for p in met.properties]
    with pytest.raises(KitUsageError):
        attn_spec.check(kernels.flash, require=["head-dims=big"], **QUICK)


def test_the_draws_reach_the_kernel_its_head_dims_and_lengths_past_its_blocks():
    taken, drawn = (16, 32, 64, 128), []

    @settings(max_examples=60, derandomize=True, database=None, deadline=None)  # the same 60 draws every run
    @given(strategies.cases("quick", head_dims=taken))
    def draw(case):
        drawn.append(case)

    draw()
    assert {c.d_k for c in drawn} <= set(taken) and {c.d_v for c in drawn} <= set(taken)
    assert any(max(c.n_q, c.n_kv) == 200 for c in drawn)  # no multiple of 16, 64 or 128


def test_a_probe_of_the_kits_own_is_fitted_into_the_envelope_with_the_same_numbers():
    """V = [[0], [1]] of the scale probe, V = I of the behaviours: zero columns, Q rescaled, V split in blocks."""
    target = make_target(kernels.flash_cross)
    probe_capabilities(target)
    q, k = torch.randn(3, 2), torch.randn(2, 2)  # [Tq=3, Dk=2], [Tk=2, Dk=2]
    v = torch.eye(2)  # [Tk=2, Dv=2]
    got = target.attend(q, k, v)  # the kernel never sees a head dim of 2
    assert torch.allclose(got.double(), attention(q.double(), k.double(), v.double())[0], atol=1e-5)
    wide = torch.randn(2, 200)  # wider than any head dim it takes: two calls of 128 columns
    fitted_q, _, blocks, d_v = fit_widths(target.supported, q, k, wide, None)
    assert fitted_q.shape[-1] == 128 and [b.shape[-1] for b in blocks] == [128, 128] and d_v == 200
    assert torch.allclose(target.attend(q, k, wide).double(), attention(q.double(), k.double(), wide.double())[0],
                          atol=1e-4)


def test_the_budget_takes_the_scores_the_call_computed_not_a_bound():
    """At 128 x 256, d 64 the bound max|q| max|k| d scale is ~30 times the largest score: a kernel reading only the
    first n_q keys (cross-attention) passed under it at float16."""
    case = Case(n_q=128, n_kv=256, d_k=64, d_v=64, dtype="float16", values="normal", seed=3)
    q, k, v, _ = case.tensors()
    bound = q.abs().max().item() * k.abs().max().item() * 64 / 8
    assert tolerance.max_score(q, k) < bound / 10
    ref = attention(q, k, v)[0]
    wrong = kernels.reads_nq_keys(q[None, None], k[None, None], v[None, None])[0, 0]
    assert tolerance.max_error(wrong, ref) > tolerance.budget(q, k, v, None, ref)
    right = kernels.flash_cross(q[None, None], k[None, None], v[None, None])[0, 0]
    assert tolerance.max_error(right, ref) <= tolerance.budget(q, k, v, None, ref)


@pytest.mark.parametrize("kernel, failing, phrase", [
    (kernels.drops_tail_rows, "matches-reference", ""),
    (kernels.reads_nq_keys, "matches-reference", ""),
    (kernels.half_partials, "matches-reference", ""),
    (kernels.k_with_v_strides, "non-contiguous", "another's strides"),
])
def test_each_kernel_bug_fails_inside_the_envelope_with_a_root(kernel, failing, phrase):
    report = attn_spec.check(kernel, only=["matches-reference", "non-contiguous"], **QUICK)
    (t,) = report.targets
    results = {p.id: p for p in t.properties}
    assert results[failing].status == "fail", [(p.id, p.status, p.message) for p in t.properties]
    assert t.diagnoses and phrase in (results[failing].cause or "")
    assert "within head dims 16/32/64/128" not in t.verdict  # a failing verdict names no envelope to trust
    if kernel is kernels.reads_nq_keys:  # told apart from a hard-coded causal mask by a second probe (n_q = 3)
        assert [d.mistake for d in t.diagnoses] == ["keys-cut-to-queries"]


def test_the_causal_alignment_of_a_kernel_is_probed_inside_its_envelope():
    top = attn_spec.check(kernels.top_left, only=["scale-sqrt-dk"], require=["causal-alignment=bottom-right"],
                          **QUICK).targets[0]
    assert top.behaviours["causal-alignment"] == "top-left"
    assert {p.id: p.status for p in top.properties}["convention:causal-alignment"] == "fail"
    right = attn_spec.check(kernels.flash_cross, only=["scale-sqrt-dk"], require=["causal-alignment=bottom-right"],
                            **QUICK).targets[0]
    assert right.behaviours["causal-alignment"] == "bottom-right" and right.conforms
