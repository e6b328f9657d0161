"""A target is called only with what it takes, and judged only on it: bool masks unless additive ones are
declared, its own GQA grouping, the [B, H, n, d] layout models use, declines that are its own, causal-only modules."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import find

import attn_spec
from attn_spec.checking.cases import Case
from attn_spec.checking.strategies import cases
from attn_spec.cli import main
from attn_spec.errors import KitUsageError
from attn_spec.targets.behaviours import probe_behaviours
from attn_spec.targets.capabilities import probe_capabilities
from attn_spec.targets.conventions import make_target
from gallery.libraries import NanoGPTAdapter, einsum_bool_mask
from gallery.robustness import gqa_first_kv_head_only, gqa_tile_grouped, grouped_query_attention

QUICK = dict(profile="quick", seed=4)


def tutorial_mask_eq_zero(Q, K, V, mask=None):
    """The Annotated Transformer's attention: masked_fill(mask == 0, -1e9)."""
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    return torch.softmax(scores, dim=-1) @ V


def recording(seen):
    def attention(Q, K, V, mask=None):
        seen.add(None if mask is None else mask.dtype)
        return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)
    return attention


# ---------------------------------------------------------------- masks (bool unless declared)


@pytest.mark.slow
def test_function_targets_get_bool_masks_only():
    seen = set()
    assert attn_spec.check(recording(seen), name="recording", **QUICK).conforms
    assert seen == {None, torch.bool}


def test_declared_additive_masks_are_checked():
    seen = set()
    report = attn_spec.check(recording(seen), name="recording", masks="bool,additive", only=["mask-semantics"], **QUICK)
    assert report.conforms and report.targets[0].masks == ["bool", "additive"]
    assert torch.float64 in seen or torch.float32 in seen


@pytest.mark.slow
@pytest.mark.parametrize("fn", [tutorial_mask_eq_zero, einsum_bool_mask])
def test_code_that_reads_masks_as_bool_is_right_unless_additive_masks_are_declared(fn):
    only, dtypes = ["mask-semantics", "matches-reference", "causal-mask"], ["float64", "float32"]
    assert attn_spec.check(fn, only=only, dtypes=dtypes, **QUICK).conforms  # -1e9: no float16 here
    report = attn_spec.check(fn, only=only, dtypes=dtypes, masks=["bool", "additive"], **QUICK)
    (semantics,) = [p for p in report.targets[0].properties if p.id == "mask-semantics"]
    assert semantics.status == "fail" and "read as a keep-mask" in semantics.cause
    assert "--masks bool,additive" in semantics.counterexample["reproduce"]
    assert "masks=('bool', 'additive')" in semantics.counterexample["reproduce"]


def test_sdpa_and_multihead_attention_take_additive_masks():
    assert make_target(F.scaled_dot_product_attention).masks == ("bool", "additive")
    assert make_target(torch.nn.MultiheadAttention).masks == ("bool", "additive")
    assert make_target(einsum_bool_mask).masks == ("bool",)
    report = attn_spec.check(torch.nn.MultiheadAttention, only=["mask-semantics"], dtypes=["float64"], **QUICK)
    assert report.conforms, str(report)


def test_an_additive_only_target_gets_float_masks():
    def additive_only(Q, K, V, mask=None):
        assert mask is None or mask.dtype == Q.dtype, "given a bool mask"
        scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
        return torch.softmax(scores if mask is None else scores + mask, dim=-1) @ V

    report = attn_spec.check(additive_only, masks=("additive",), only=["causal-mask", "mask-semantics"], **QUICK)
    assert report.conforms, str(report)


def test_unknown_mask_forms_are_usage_errors(capsys):
    with pytest.raises(KitUsageError, match="bool, additive"):
        attn_spec.check(einsum_bool_mask, masks="float", **QUICK)
    assert main(["check", "gallery.libraries:einsum_bool_mask", "--masks", "bool,floats"]) == 2
    assert "'floats' is not one of bool, additive" in capsys.readouterr().err


# ---------------------------------------------------------------- GQA grouping (a behaviour)


@pytest.mark.parametrize("fn, grouping", [(F.scaled_dot_product_attention, "blocked"),
                                          (grouped_query_attention, "blocked"), (gqa_tile_grouped, "tile"),
                                          (gqa_first_kv_head_only, "other"), (einsum_bool_mask, "n/a")])
def test_gqa_grouping_is_probed(fn, grouping):
    assert probe_behaviours(make_target(fn))["gqa-grouping"] == grouping


def test_gqa_is_checked_against_the_grouping_found_and_can_be_required():
    report = attn_spec.check(gqa_tile_grouped, only=["gqa-equivalence"], **QUICK)
    assert report.conforms and report.targets[0].behaviours["gqa-grouping"] == "tile"
    assert "gqa-grouping=tile" in str(report)
    report = attn_spec.check(gqa_tile_grouped, only=["gqa-equivalence"], require=["gqa-grouping=blocked"], **QUICK)
    (required,) = [p for p in report.targets[0].properties if p.id == "convention:gqa-grouping"]
    assert not report.conforms and "found gqa-grouping=tile" in required.message


# ---------------------------------------------------------------- [B, H, n, d], heads split by view + transpose


def test_heads_layout_is_a_non_contiguous_view_of_the_same_values():
    case = Case(batch=(2, 3), n_q=4, n_kv=5, d_k=2, d_v=3, layout="heads", seed=1)
    for t, plain in zip(case.tensors()[:3], case.replace(layout="contiguous").tensors()[:3]):
        assert not t.is_contiguous() and torch.equal(t, plain)
        assert t.transpose(1, 2).is_contiguous()  # a [B, n, H, d] buffer seen as [B, H, n, d]
    assert "view(B, n, H, d).transpose(1, 2)" in case.summary()


def test_every_profile_draws_four_dimensional_heads():
    for profile in ("quick", "default", "thorough"):
        found = find(cases(profile), lambda c: len(c.batch) == 2 and c.layout == "heads")
        assert found.tensors()[0].dim() == 4


# ---------------------------------------------------------------- a decline is the target's own


def _declines(exc):
    def attention(Q, K, V, mask=None):
        if mask is not None:
            raise exc
        return F.scaled_dot_product_attention(Q, K, V)
    return attention


def interpolates(Q, K, V, mask=None):
    """A masked path that reaches a NotImplementedError raised by torch's own Python code."""
    if mask is not None:
        F.interpolate(mask.float(), scale_factor=2.0)  # 2-D input: torch raises NotImplementedError
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


@pytest.mark.parametrize("fn, value, reason", [
    (_declines(NotImplementedError("no masks here")), "no", "raised NotImplementedError: no masks here"),
    (_declines(attn_spec.Unsupported("no masks here")), "no", "declined: no masks here"),
    (interpolates, "raises", "NotImplementedError"),
    ("sparse_mask", "raises", "Could not run 'aten::bitwise_not'"),
])
def test_only_the_targets_own_not_implemented_error_declares(fn, value, reason):
    from gallery.masking import sparse_mask

    values, lacks = probe_capabilities(make_target(sparse_mask if fn == "sparse_mask" else fn))
    assert values["mask"] == value and reason in lacks["mask"]


def test_a_not_implemented_error_inside_torch_is_a_crash_with_its_traceback():
    from gallery.masking import sparse_mask

    report = attn_spec.check(sparse_mask, only=["causal-mask"], **QUICK)
    (result,) = report.targets[0].properties
    assert result.status == "fail" and "NotImplementedError" in result.message
    assert "inside torch" in result.cause and "to_sparse" in result.counterexample["traceback"]


# ---------------------------------------------------------------- causal-only modules are checked


@pytest.mark.slow
def test_a_causal_only_module_is_probed_and_checked_on_causal_self_attention():
    values, lacks = probe_capabilities(make_target(NanoGPTAdapter, convention="adapter"))
    assert values["mask"] == "causal-only" and values["unmasked"] == "no" and values["cross"] == "no"
    assert all(values[name] == "yes" for name in ("dv-ne-dk", "autograd", "float64", "float16"))
    assert values["batch"] == "n/a"  # a multi-head convention is checked one sequence at a time
    report = attn_spec.check(NanoGPTAdapter, convention="adapter", dtypes=["float64", "float32"], **QUICK)
    statuses = {p.id: p.status for p in report.targets[0].properties}
    assert report.conforms, str(report)
    assert statuses["scale-sqrt-dk"] == statuses["causal-mask"] == statuses["gradients"] == "pass"
    assert sum(status == "pass" for status in statuses.values()) >= 14, statuses
    assert "mask (causal-only)" in str(report)


def test_an_inverted_built_in_causal_mask_fails(capsys):
    code = main(["check", "gallery.libraries:NanoGPTInvertedMask", "--convention", "adapter",
                 "--only", "matches-reference", "--dtypes", "float64", "--seed", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "matches-reference  fail" in out, out


def test_a_target_that_declines_everything_has_nothing_checked(capsys, tmp_path):
    path = tmp_path / "declines.py"
    path.write_text("def attention(Q, K, V, mask=None):\n    raise NotImplementedError('not written yet')\n")
    assert main(["check", f"{path}:attention", "--profile", "quick", "--seed", "1"]) == 1
    out = capsys.readouterr().out
    assert "NOTHING CHECKED" in out and "CONFORMS" not in out
    assert "skipped matches-reference: not checked:" in out
