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
    """A crash inside the computation (torch.mm takes matrices only): no declaration."""
    weights = torch.softmax(torch.mm(Q, K.T) / Q.shape[-1] ** 0.5, dim=-1)
    return weights @ V


def refuses_batches(Q, K, V, mask=None):
    """Its own check before any arithmetic (a ValueError it raises): a declaration, as NotImplementedError is."""
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
    assert [name for name, value in values.items() if value != "yes"] == ["scale", "is-causal", "dropout", "gqa"]
    assert "takes no scale argument" in lacks["scale"]
    assert "RuntimeError" in lacks["gqa"]  # heads that do not broadcast: no grouped-query attention


def test_sdpa_has_every_capability():
    values, lacks = probe(F.scaled_dot_product_attention)
    assert set(values.values()) == {"yes"} and lacks == {}


@pytest.mark.parametrize("fn, name, value, reason", [
    (no_mask, "mask", "no", "takes no mask argument"),
    (unbatched, "batch", "no", "2-D inputs only"),
    (crashes_on_batches, "batch", "raises", "RuntimeError: self must be a matrix"),
    (refuses_batches, "batch", "no", "its own check: attention(Q, K, V) raised ValueError: expected 2-D inputs"),
    (square_values, "dv-ne-dk", "no", "d_v must equal d_k"),
    (detached, "autograd", "no", "no autograd"),
    (float32_only, "float16", "no", "float16 kernels are not written yet"),
])
def test_each_missing_capability_is_found_with_its_reason(fn, name, value, reason):
    values, lacks = probe(fn)
    assert values[name] == value and reason in lacks[name]
    missing = {"scale", "is-causal", "dropout", "gqa", name} | ({"float64", "bfloat16"} if fn is float32_only else set())
    assert {n for n, v in values.items() if v != "yes"} == missing  # nothing else is missing


def test_self_attention_only_modules_lack_cross():
    values, lacks = probe(SelfOnly(torch.nn.MultiheadAttention), convention="adapter")
    assert values["cross"] == "no" and "self-attention only" in lacks["cross"]
    assert values["gqa"] == "n/a" and values["batch"] == "n/a"  # one sequence at a time: batch-independence n/a


def test_dtypes_left_out_are_unchecked():
    values, _ = probe(float32_only, dtypes=["float32"])
    assert values["float16"] == values["bfloat16"] == values["float64"] == "unchecked"


def test_report_shows_capabilities_and_why_some_are_missing():
    report = attn_spec.check(unbatched, only=["batch-independence", "scale-sqrt-dk"], dtypes=["float32"], **QUICK)
    result = report.targets[0].properties[1]
    assert report.conforms and result.status == "skip" and "2-D inputs only" in result.message
    text = str(report)
    assert "capabilities: mask, unmasked, cross, dv-ne-dk, autograd;" in text
    assert ("lacks batch (no: attention(Q, K, V) raised NotImplementedError: 2-D inputs only); "
            "scale (no: the function convention takes no scale argument)") in text
    data = report.to_dict()["targets"][0]
    assert data["capabilities"]["batch"] == "no" and "2-D inputs only" in data["lacks"]["batch"]


def test_a_target_with_nothing_checked_does_not_conform():
    report = attn_spec.check(unbatched, only=["batch-independence"], dtypes=["float32"], **QUICK)
    (result,) = report.targets[0].properties
    assert result.status == "skip" and result.message.startswith("not checked: it needs leading batch/head dims")
    assert not report.conforms and not report.targets[0].checked
    assert "NOTHING CHECKED" in str(report) and report.to_dict()["targets"][0]["checked"] is False


def test_inputs_a_target_declines_are_not_drawn():
    report = attn_spec.check(unbatched, only=["matches-reference"], dtypes=["float32"], **QUICK)
    (result,) = report.targets[0].properties
    assert result.status == "pass" and result.examples >= 6  # every example checked, none rejected
    assert "not drawn: leading batch/head dims (attention(Q, K, V) raised NotImplementedError: 2-D inputs only)" \
        in result.message


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
    assert "require=['masks'] from the command line (--require): 'masks' is not a capability" in err and "mask, unmasked, batch, cross" in err


def _calls_by_property(target):
    """Record what each successful call into ``target`` exercised, under the property running it (the
    check's progress callback names it): capability names, "non-causal mask", and dtype names."""
    from attn_spec.targets.layouts import _grouped
    from attn_spec.reference import causal_mask

    used, current = {}, [None]

    def features(q, k, v, mask, **kwargs):
        found = {str(q.dtype).replace("torch.", "")}
        if mask is None:
            found.add("unmasked")
        else:
            found.add("mask")
            causal = causal_mask(q.shape[-2], k.shape[-2], device=mask.device)  # [Tq, Tk]
            if mask.shape[-2:] != causal.shape or not torch.equal(mask, causal.expand(mask.shape)):
                found.add("non-causal mask")
        found.update(name for name, on in (("batch", q.dim() > 2),
                                           ("cross", q.shape[-2] != k.shape[-2]),
                                           ("dv-ne-dk", v.shape[-1] != k.shape[-1]),
                                           ("scale", kwargs.get("scale") is not None),
                                           ("is-causal", kwargs.get("is_causal")),
                                           ("gqa", _grouped(q, k))) if on)
        return found

    def wrap(method, extra=(), multihead=False):
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            if current[0] is not None:
                if multihead:
                    x_q, x_kv, _, _, *rest = args
                    mask = rest[0] if rest else kwargs.get("mask")
                    found = features(x_q, x_kv, x_kv, mask)
                else:
                    found = features(*args[:3], args[3] if len(args) > 3 else kwargs.get("mask"), **kwargs)
                used.setdefault(current[0], set()).update(found | set(extra))
            return out
        return call

    target.attend = wrap(target.attend)
    target.vjp = wrap(target.vjp, ("autograd",))
    target.multihead = wrap(target.multihead, multihead=True)
    return used, lambda text: current.__setitem__(0, text.rsplit(" ", 1)[-1])


@pytest.mark.parametrize("obj, convention", [
    (seed_attention, None), (F.scaled_dot_product_attention, None), (unbatched, None),
    (torch.nn.MultiheadAttention, None), ("SeedMultiHead", "module"), ("NanoGPTAdapter", "adapter")])
def test_the_header_never_contradicts_the_table(obj, convention):
    """No capability the header says the target lacks was exercised by a property that passed."""
    from gallery import core, libraries

    obj = {"SeedMultiHead": core.SeedMultiHead, "NanoGPTAdapter": libraries.NanoGPTAdapter}.get(obj, obj)
    target = make_target(obj, convention=convention)
    used, progress = _calls_by_property(target)
    report = attn_spec.check(target, progress=progress, **QUICK).targets[0]
    passed = {p.id for p in report.properties if p.status == "pass"}
    assert passed, str(report)
    for name, value in report.capabilities.items():
        lacking = {"no": {name}, "raises": {name}, "causal-only": {"non-causal mask"}}.get(value, set())
        for prop in passed:
            assert not lacking & used.get(prop, set()), (
                f"the header says {name}={value} ({report.lacks.get(name)}), but {prop} exercised it and passed")


def positions_up_to_300(Q, K, V, mask=None):
    """A fixed position buffer of 300 added to the scores: beyond it, torch's size check fails (as nanoGPT's tril),
    but a plain function declares no size: the crash is a bug (tests/test_lengths.py)."""
    bias = torch.zeros(300, 300, dtype=Q.dtype, device=Q.device)
    scores = Q @ K.transpose(-2, -1) + bias[:Q.shape[-2], :K.shape[-2]] * 0  # RuntimeError beyond 300 when n_q != n_kv
    if max(Q.shape[-2], K.shape[-2]) > 300:
        scores = scores + bias  # the size of tensor a must match the size of tensor b
    return seed_attention(Q, K, V, mask)


def refuses_beyond_100(Q, K, V, mask=None):
    if max(Q.shape[-2], K.shape[-2]) > 100:
        raise NotImplementedError("sequences up to 100 positions")
    return seed_attention(Q, K, V, mask)


def test_max_length_is_found_by_bisection_on_a_refusal_or_a_shape_crash():
    target = make_target(refuses_beyond_100)
    values, lacks = probe_capabilities(target)
    assert values["length"] == "100" and "at 101" in lacks["length"] and "up to 100 positions" in lacks["length"]
    assert target.supported.max_length == 100  # what the properties draw up to
    values, lacks = probe(positions_up_to_300)  # a crash no declaration explains: bisected all the same
    assert values["length"] == "raises" and lacks["length"].startswith("raises RuntimeError from 301 positions on; "
                                                                       "takes up to 300")
    assert probe(seed_attention)[0]["length"] == "yes"


def test_max_length_shows_in_the_header_bounds_the_draws_and_can_be_required():
    report = attn_spec.check(refuses_beyond_100, only=["long-sequences"], dtypes=["float32"], **QUICK)
    (result,) = report.targets[0].properties
    assert report.conforms and result.status == "pass" and "unsupported" not in (result.message or "")
    assert "autograd, max length 100" in str(report) and report.to_dict()["targets"][0]["capabilities"]["length"] == "100"
    assert "max length" not in str(attn_spec.check(seed_attention, only=["scale-sqrt-dk"], dtypes=["float32"], **QUICK))
    results = {}
    for need in (100, 101):
        r = attn_spec.check(refuses_beyond_100, only=["scale-sqrt-dk"], dtypes=["float32"], require=[f"length={need}"],
                            **QUICK)
        results[need] = next(p for p in r.targets[0].properties if p.id == "capability:length")
    assert results[100].status == "pass"
    assert results[101].status == "fail" and results[101].message.startswith("required length=101, found max length 100")


def test_cli_require_length_usage_error(no_mask_file, capsys):
    assert _cli(no_mask_file, "length=many") == 2
    assert "expected a positive number of positions" in capsys.readouterr().err
