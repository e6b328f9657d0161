"""A limit on the length is a capability only when the target declares it; the verdict names every declared limit.

A plain function that crashes past a hard-coded block of 16 keys fails long-sequences, one root stating where the
crash starts; nanoGPT's module, whose ``bias`` buffer holds ``block_size`` positions, conforms up to them, and the
verdict says so in every format (a gate reads that one line)."""
import json
import xml.etree.ElementTree as ET

import torch

import attn_spec
from attn_spec.targets.capabilities import probe_capabilities
from attn_spec.targets.conventions import make_target
from gallery.contracts import BlockSize1024

QUICK = dict(profile="quick", seed=1, dtypes=["float32"])


def block_of_16(Q, K, V, mask=None):
    """Keys read through a hard-coded block of 16 positions: IndexError from 17 keys on."""
    idx = torch.arange(16, device=K.device)[torch.arange(K.shape[-2], device=K.device)]  # IndexError past 16
    scores = Q @ K[..., idx, :].transpose(-2, -1) / Q.shape[-1] ** 0.5  # [..., Tq, Tk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1) @ V[..., idx, :]


def asserts_up_to_40(Q, K, V, mask=None):
    """Its own check, before any arithmetic: a deliberate limit."""
    assert K.shape[-2] <= 40, "sequences up to 40 positions"
    return torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask)


class TableOf48(torch.nn.Module):
    """A function-convention module with a position table of 48 rows it adds to the scores, crashing past it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("positions", torch.zeros(48, 48))

    def forward(self, Q, K, V, mask=None):
        n_q, n_kv = Q.shape[-2], K.shape[-2]
        bias = self.positions[:n_q, :n_kv] + self.positions[n_q - 1, n_kv - 1]  # IndexError past 48
        return torch.nn.functional.scaled_dot_product_attention(Q, K, V, attn_mask=mask if mask is None else
                                                               bias.masked_fill(~mask, float("-inf")))


def test_a_crash_at_a_length_is_a_limit_only_where_the_target_declares_it():
    target = make_target(block_of_16)
    values, lacks = probe_capabilities(target, dtypes=("float32",))
    assert values["length"] == "raises"
    assert lacks["length"].startswith("raises IndexError from 17 positions on; takes up to 16, and declares no limit")
    assert target.supported.max_length is None and target.supported.crash_length == 16
    for obj, n, where in ((asserts_up_to_40, 40, "its own check"), (TableOf48(), 48, "buffer positions [48, 48]")):
        target = make_target(obj, convention="function")
        values, lacks = probe_capabilities(target, dtypes=("float32",))
        assert values["length"] == str(n) and where in lacks["length"], lacks["length"]
        assert target.supported.max_length == n and target.supported.crash_length is None


def test_a_function_crashing_past_16_keys_fails_long_sequences_with_one_root_naming_where():
    report = attn_spec.check(block_of_16, only=["matches-reference", "long-sequences"], **QUICK)
    (t,) = report.targets
    results = {p.id: p.status for p in t.properties}
    assert results == {"matches-reference": "pass", "long-sequences": "fail"}, results  # drawn within 16, but there
    assert t.verdict.startswith("DOES NOT CONFORM") and t.envelope == []
    (root,) = t.diagnoses
    assert root.root == "long-sequences" and root.measured
    assert root.sentence == "the target raises IndexError from 17 positions on; takes up to 16, and declares no limit"
    assert "IndexError from 17 positions on" in t.properties[1].cause and "takes up to 16" in str(report)


def test_a_module_with_a_1024_position_buffer_conforms_up_to_1024_positions_in_every_format():
    report = attn_spec.check(BlockSize1024, only=["causal-mask", "long-sequences"], **QUICK)
    (t,) = report.targets
    assert t.conforms and t.capabilities["length"] == "1024" and "as it declares (block_size = 1024)" in t.lacks["length"]
    assert t.verdict == "CONFORMS up to 1024 positions, causal masks only, self-attention only"
    data = json.loads(report.to_json())["targets"][0]
    assert data["verdict"] == t.verdict
    assert [(e["capability"], e["phrase"]) for e in data["envelope"]] == [
        ("length", "up to 1024 positions"), ("mask", "causal masks only"), ("cross", "self-attention only")]
    assert data["envelope"][0]["why"] == t.lacks["length"]
    assert f": {t.verdict}" in str(report) and t.verdict in report.render("markdown")
    junit = ET.fromstring(report.render("junit"))
    assert junit.find(".//property[@name='verdict']").get("value") == t.verdict


def test_require_length_declares_a_limit_the_user_needs_no_more_than_and_fails_a_shorter_one():
    within = attn_spec.check(block_of_16, only=["long-sequences"], require=["length=16"], **QUICK).targets[0]
    assert within.conforms and within.verdict == "CONFORMS up to 16 positions", within.verdict
    beyond = attn_spec.check(block_of_16, only=["long-sequences"], require=["length=17"], **QUICK).targets[0]
    statuses = {p.id: p.status for p in beyond.properties}
    assert statuses == {"long-sequences": "fail", "capability:length": "fail"}, statuses
    assert next(p for p in beyond.properties if p.id == "capability:length").message.startswith(
        "required length=17, found length raises: raises IndexError from 17 positions on")


def test_a_plain_function_without_limits_has_an_empty_envelope_and_a_bare_verdict():
    report = attn_spec.check(lambda Q, K, V, mask=None: torch.nn.functional.scaled_dot_product_attention(
        Q, K, V, attn_mask=mask), only=["scale-sqrt-dk"], **QUICK)
    assert report.targets[0].verdict == "CONFORMS" and json.loads(report.to_json())["targets"][0]["envelope"] == []

