"""Capabilities are probed, reported with their reasons, and fail a check only when required."""
import json

import pytest
import torch
import torch.nn.functional as F

import attn_spec
from attn_spec.targets.conventions import make_target
from attn_spec.targets.capabilities import CAPABILITIES, probe_capabilities
from attn_spec.cli import main
from attn_spec.targets.module_adapters import TorchMhaAdapter

QUICK = dict(profile="quick", seed=1)


def seed_attention(Q, K, V, mask=None):
    return F.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


def no_mask(Q, K, V):
    return F.scaled_dot_product_attention(Q, K, V)


def unbatched(Q, K, V, mask=None):
    if Q.dim() > 2:
        raise NotImplementedError("2-D inputs only")
    return seed_attention(Q, K, V, mask)


def crashes_on_batches(Q, K, V, mask=None):
    if Q.dim() > 2:
        raise ValueError("expected 2-D inputs")
    return seed_attention(Q, K, V, mask)


def square_values(Q, K, V, mask=None):
    if V.shape[-1] != K.shape[-1]:
        raise NotImplementedError("d_v must equal d_k")
    return seed_attention(Q, K, V, mask)


def detached(Q, K, V, mask=None):
    return seed_attention(Q, K, V, mask).detach()


def float32_only(Q, K, V, mask=None):
    if Q.dtype != torch.float32:
        raise NotImplementedError(f"{Q.dtype} kernels are not written yet")
    return seed_attention(Q, K, V, mask)


class SelfOnly(TorchMhaAdapter):
    self_attention_only = True


def probe(obj, **kwargs):
    return probe_capabilities(make_target(obj, convention=kwargs.pop("convention", None)), **kwargs)


def test_a_plain_function_has_all_but_the_sdpa_arguments_and_gqa():
    values, lacks = probe(seed_attention, dtypes=["float32", "float64", "float16", "bfloat16"])
    assert list(values) == list(CAPABILITIES)
    assert [name for name, value in values.items() if value != "yes"] == ["scale", "is-causal", "gqa"]
    assert "takes no scale argument" in lacks["scale"]
    assert "RuntimeError" in lacks["gqa"]  # heads that do not broadcast: no grouped-query attention


def test_sdpa_has_every_capability():
    values, lacks = probe(F.scaled_dot_product_attention)
    assert set(values.values()) == {"yes"} and lacks == {}


@pytest.mark.parametrize("fn, name, value, reason", [
    (no_mask, "mask", "no", "takes no mask argument"),
    (unbatched, "batch", "no", "2-D inputs only"),
    (crashes_on_batches, "batch", "raises", "ValueError: expected 2-D inputs"),
    (square_values, "dv-ne-dk", "no", "d_v must equal d_k"),
    (detached, "autograd", "no", "no autograd"),
    (float32_only, "float16", "no", "float16 kernels are not written yet"),
])
def test_each_missing_capability_is_found_with_its_reason(fn, name, value, reason):
    values, lacks = probe(fn)
    assert values[name] == value and reason in lacks[name]
    missing = {"scale", "is-causal", "gqa", name} | ({"float64", "bfloat16"} if fn is float32_only else set())
    assert {n for n, v in values.items() if v != "yes"} == missing  # nothing else is missing


def test_self_attention_only_modules_lack_cross():
    values, lacks = probe(SelfOnly(torch.nn.MultiheadAttention), convention="adapter")
    assert values["cross"] == "no" and "self-attention only" in lacks["cross"]
    assert values["gqa"] == "n/a" and values["batch"] == "yes"


def test_dtypes_left_out_are_unchecked():
    values, _ = probe(float32_only, dtypes=["float32"])
    assert values["float16"] == values["bfloat16"] == values["float64"] == "unchecked"


def test_report_shows_capabilities_and_why_some_are_missing():
    report = attn_spec.check(unbatched, only=["batch-independence"], dtypes=["float32"], **QUICK)
    (result,) = report.targets[0].properties
    assert report.conforms and result.status == "skip" and "2-D inputs only" in result.message
    text = str(report)
    assert "capabilities: mask, cross, dv-ne-dk, autograd;" in text
    assert ("lacks batch (no: attention(Q, K, V) raised NotImplementedError: 2-D inputs only); "
            "scale (no: the function convention takes no scale argument)") in text
    data = report.to_dict()["targets"][0]
    assert data["capabilities"]["batch"] == "no" and "2-D inputs only" in data["lacks"]["batch"]


def test_required_capabilities_fail_only_when_missing():
    report = attn_spec.check(unbatched, only=["scale-sqrt-dk"], dtypes=["float32"], require=["mask", "batch"], **QUICK)
    results = {p.id: p for p in report.targets[0].properties}
    assert not report.conforms
    assert results["capability:mask"].status == "pass"
    assert results["capability:batch"].status == "fail"
    assert results["capability:batch"].message.startswith("required capability batch, found no: ")


@pytest.fixture
def no_mask_file(tmp_path):
    path = tmp_path / "attn.py"
    path.write_text("import torch.nn.functional as F\n\n"
                    "def attention(Q, K, V):\n"
                    "    return F.scaled_dot_product_attention(Q, K, V)\n")
    return f"{path}:attention"


def _cli(target, *require):
    return main(["check", target, "--profile", "quick", "--seed", "1", "--only", "scale-sqrt-dk", "--format", "json",
                 "--dtypes", "float32", "--require", *require])


def test_cli_require_capability(no_mask_file, capsys):
    assert _cli(no_mask_file, "autograd", "batch") == 0
    capsys.readouterr()
    assert _cli(no_mask_file, "mask", "fully-masked=nan") == 1
    results = {p["id"]: p for p in json.loads(capsys.readouterr().out)["targets"][0]["properties"]}
    assert results["capability:mask"]["status"] == "fail"
    assert "the function takes no mask argument" in results["capability:mask"]["message"]
    assert results["convention:fully-masked"]["status"] == "fail"  # no mask: the convention does not arise (n/a)


def test_cli_unknown_capability_is_a_usage_error(no_mask_file, capsys):
    assert _cli(no_mask_file, "masks") == 2
    err = capsys.readouterr().err
    assert "require=['masks'] from the command line (--require): 'masks' is not a capability" in err and "mask, batch, cross" in err
