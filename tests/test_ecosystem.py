"""The ecosystem's attention as is: Hugging Face attention functions (hf), [B, S, H, D] kernels (--layout),
FlexAttention (flex) and its mask_mods and score_mods (--expect-mask, --expect-score)."""
import re
import importlib.util
import json
import os
import textwrap
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec.cli import main
from attn_spec.errors import KitUsageError
from attn_spec.targets.conventions import make_target

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
QUICK = ["--profile", "quick", "--seed", "3"]
needs_transformers = pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                        reason="transformers (the test extra) is not installed")


def check(capsys, *argv):
    code = main(["check", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.slow
@needs_transformers
@pytest.mark.parametrize("spec, form", [
    ("transformers.integrations.sdpa_attention:sdpa_attention_forward", "attention_mask: bool (registered as 'sdpa'"),
    ("transformers.models.llama.modeling_llama:eager_attention_forward", "attention_mask: float (not registered")],
    ids=["sdpa", "eager"])
def test_hugging_face_attention_functions_conform_with_no_flags(capsys, spec, form):
    code, out, err = check(capsys, spec, *QUICK)
    assert code == 0, out + err
    assert "(hf convention): CONFORMS" in out and form in out
    for pid in ("mask-semantics", "gqa-equivalence", "is-causal", "sliding-window"):  # really checked
        assert f"skipped {pid}" not in out
    assert "skipped softcap" in out and "declares no softcap parameter" in out  # neither takes softcap=


@needs_transformers
def test_hugging_face_eager_in_float64_is_named_for_what_it_is(capsys):
    """float64 is left out by default (HF's eager softmax runs in float32); asked for, the loss is diagnosed:
    the hf convention records its calls, so the diagnosis replays them and names the mistake model."""
    code, out, _ = check(capsys, "transformers.models.llama.modeling_llama:eager_attention_forward", *QUICK,
                         "--dtypes", "float64", "--only", "matches-reference")
    assert code == 1 and "float64 inputs are computed at float32 precision" in out and "[computes-in-float32]" in out


@pytest.mark.slow
@needs_transformers
def test_a_function_registered_with_attention_interface_conforms(capsys):
    code, out, err = check(capsys, f"{EXAMPLES / 'hf_attention.py'}:my_attention", *QUICK)
    assert code == 0, out + err
    assert "(hf convention): CONFORMS" in out and "registered as 'my_attention', whose mask function is sdpa_mask" in out


@needs_transformers
def test_registered_without_a_mask_function_gets_no_mask(tmp_path, capsys):
    """HF passes attention_mask=None to such an implementation: the kit does too, and checks causality via is_causal."""
    source = tmp_path / "plain.py"
    source.write_text(textwrap.dedent("""
        import torch
        import torch.nn.functional as F
        from transformers import AttentionInterface

        def plain(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            n_q, n_kv = query.shape[2], key.shape[2]  # causal: the queries are the last n_q positions
            causal = torch.ones(n_q, n_kv, dtype=torch.bool).tril(n_kv - n_q) if module.is_causal else None
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=causal, scale=scaling, enable_gqa=True)
            return out.transpose(1, 2), None

        AttentionInterface.register("plain_no_mask", plain)
    """))
    code, out, err = check(capsys, f"{source}:plain", *QUICK, "--only", "mask-semantics", "is-causal",
                           "matches-reference")
    assert code == 0, out + err
    assert "attention_mask: none (registered as 'plain_no_mask'" in out
    assert "skipped mask-semantics: not checked:" in out and "Hugging Face passes no attention_mask" in out and "skipped is-causal" not in out


@pytest.mark.slow
def test_flex_attention_conforms_with_no_flags(capsys):
    code, out, err = check(capsys, "torch.nn.attention.flex_attention:flex_attention", *QUICK)
    assert code == 0, out + err
    assert "(flex convention): CONFORMS" in out
    for pid in ("mask-semantics", "gqa-equivalence", "sliding-window", "softcap", "is-causal"):
        assert f"skipped {pid}" not in out
    assert "skipped gradients" in out and "backward on CPU" in out  # a capability it lacks on the CPU


@pytest.mark.slow
def test_a_bshd_kernel_conforms_with_no_flags(capsys):
    code, out, err = check(capsys, f"{EXAMPLES / 'flash_kernel.py'}:attention", *QUICK)
    assert code == 0, out + err
    assert "(sdpa convention): CONFORMS" in out and "layout: bshd (detected from flash-attn's parameter names" in out
    for pid in ("sliding-window", "softcap", "is-causal", "gqa-equivalence", "scale-argument"):
        assert f"skipped {pid}" not in out


def _bshd(q, k, v):
    """[B, S, H, D] with no telling parameter names: only a probe can tell its layout."""
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)


def test_layout_is_probed_when_the_names_do_not_tell():
    target = make_target(_bshd)
    assert (target.convention, target.layout) == ("function", "bshd") and "runs only as [B, S, H, D]" in target.layout_why
    seed = make_target(attn_spec.reference.reference_attention)
    assert seed.layout == "bhsd"
    report = attn_spec.check(_bshd, profile="quick", seed=3, only=["matches-reference", "batch-independence"])
    assert report.conforms, str(report)
    forced = attn_spec.check(_bshd, layout="bhsd", profile="quick", seed=3, only=["matches-reference"])
    assert not forced.conforms  # read the other way round, the same kernel is wrong


def _triton_style(q, k, v, causal=False, sm_scale=None):
    """A Triton kernel's host signature (the Triton tutorial's, FlagAttention's): [B, H, S, D], `causal` and
    `sm_scale`, head dims it asserts."""
    assert q.shape[-1] in (16, 32, 64, 128), "head dims 16-128"
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=sm_scale)


def test_causal_alone_is_not_flash_attns_layout_and_sm_scale_is_a_scale():
    """flash-attn's [B, S, H, D] is told by softmax_scale / window_size; a kernel taking only `causal` (and
    `sm_scale`) is probed, and where the probes cannot run it (its head dims) it is read as [B, H, S, D]."""
    target = make_target(_triton_style)
    assert (target.convention, target.layout) == ("sdpa", "bhsd"), target.layout_why
    assert target.names["scale"] == "sm_scale" and target.names["is_causal"] == "causal"
    report = attn_spec.check(_triton_style, profile="quick", seed=3, only=["matches-reference", "scale-argument"])
    assert report.conforms, str(report)
    assert "within head dims 16/32/64/128" in [e["phrase"] for e in report.targets[0].envelope]


def test_the_default_layout_reads_as_one_parenthesis():
    """Where neither probe tells (here: both raise), the header's line is not "bhsd (the default (...))"."""
    def refuses(q, k, v):
        raise NotImplementedError

    notes = make_target(refuses).notes()
    assert notes == ["layout: bhsd (the default; --layout bshd for [B, S, H, D] kernels)"]


def test_layout_applies_to_function_conventions_only():
    with pytest.raises(KitUsageError, match="--layout applies to the function and sdpa conventions"):
        make_target(attn_spec.reference.MultiHeadAttention, layout="bshd")


MODS = f"{EXAMPLES / 'flex_mods.py'}"


def test_a_mask_mod_against_its_statement(capsys):
    code, out, err = check(capsys, f"{MODS}:sliding_window_mask", "--expect-mask", "sliding-window:4", *QUICK)
    assert code == 0, out + err
    assert "(mask-mod convention): CONFORMS" in out and "█" in out and "·" in out  # the mask, drawn


def test_a_mask_mod_off_by_one_names_the_first_pair_and_the_window(capsys, tmp_path):
    html = tmp_path / "report.html"
    code, out, _ = check(capsys, f"{MODS}:off_by_one_window", "--expect-mask", "sliding-window:4", *QUICK)
    assert code == 1
    assert "mask_mod(b=0, h=0, q_idx=4, kv_idx=0), the first of 2 pairs" in out
    assert ": True, expected False under sliding-window:4" in out
    assert "the window keeps 5 keys, not 4" in out
    assert "--expect-mask sliding-window:4" in out and "expect_mask='sliding-window:4'" in out  # reproducible
    assert check(capsys, f"{MODS}:off_by_one_window", "--expect-mask", "sliding-window:4", *QUICK,
                 "--format", "html", "--output", str(html))[0] == 1
    page = html.read_text(encoding="utf-8")
    assert page.count('class="heat"') >= 3 and 'class="masked"' in page  # the picture, got and expected


def test_an_unknown_statement_still_draws_the_mask_and_checks_its_rows(capsys, tmp_path):
    source = tmp_path / "mods.py"
    source.write_text("def strict(b, h, q_idx, kv_idx):\n    return kv_idx < q_idx\n")
    code, out, _ = check(capsys, f"{source}:strict", *QUICK, "--format", "json")
    target = json.loads(out)["targets"][0]
    assert code == 1 and target["convention"] == "mask-mod"  # detected from (b, h, q_idx, kv_idx)
    assert target["picture"]["matrix"][0] == [False] * 8 and target["picture"]["matrix"][1][0] is True
    results = {p["id"]: p for p in target["properties"]}
    assert results["mask-mod-statement"]["status"] == "skip"
    assert results["mask-mod-rows"]["status"] == "fail" and "rows [0] keep no key" in results["mask-mod-rows"]["message"]


@pytest.mark.parametrize("name, statement", [("tanh_softcap", "softcap:50"), ("alibi", "alibi")])
def test_score_mods_against_their_statements(capsys, name, statement):
    code, out, err = check(capsys, f"{MODS}:{name}", "--expect-score", statement, *QUICK)
    assert code == 0, out + err
    assert "(score-mod convention): CONFORMS" in out


def test_a_mismatched_statement_fails(capsys):
    code, out, _ = check(capsys, f"{MODS}:alibi", "--expect-score", "softcap:50", *QUICK)
    assert code == 1 and "under softcap:50" in out


@pytest.mark.parametrize("mod, argv", [("sliding_window_mask", ["--expect-mask", "causal+window:3"]),
                                       ("sliding_window_mask", ["--expect-mask", "sliding-window:0"]),
                                       ("tanh_softcap", ["--expect-score", "softcap:-1"]),
                                       ("tanh_softcap", ["--expect-score", "alibi:x"])])
def test_bad_statements_are_usage_errors(capsys, mod, argv):
    code, _, err = check(capsys, f"{MODS}:{mod}", *argv, *QUICK)
    assert code == 2 and "attn-spec:" in err and "--expect-" in err


def test_a_reproduction_snippet_rebuilds_the_statement():
    report = attn_spec.check(make_target(_strict, "strict", expect_mask="causal"), profile="quick", seed=3)
    failed = next(p for p in report.targets[0].properties if p.id == "mask-mod-statement")
    with pytest.raises(AssertionError, match="diagonal is masked"):
        attn_spec.reproduce("mask-mod-statement", _strict, attn_spec.checking.cases.Case(**failed.counterexample["case"]),
                            convention="mask-mod", expect_mask="causal")


def _strict(b, h, q_idx, kv_idx):
    return kv_idx < q_idx


@pytest.mark.slow
def test_layout_convention_and_statements_are_settings_like_any_other(tmp_path, monkeypatch, capsys):
    """--layout, --convention, --expect-mask and --expect-score come through attn_spec.settings: from
    [tool.attn-spec] in pyproject.toml and ATTN_SPEC_* variables too, the command line winning."""
    for name in [key for key in os.environ if key.startswith("ATTN_SPEC_")]:
        monkeypatch.delenv(name)
    (tmp_path / "pyproject.toml").write_text(f'[tool.attn-spec]\ntargets = ["{MODS}:sliding_window_mask"]\n'
                                             'expect-mask = "sliding-window:4"\nprofile = "quick"\nseed = 3\n')
    monkeypatch.chdir(tmp_path)
    code, out, err = check(capsys)
    assert code == 0 and "(mask-mod convention): CONFORMS" in out and "statement: sliding-window:4" in out, out + err
    monkeypatch.setenv("ATTN_SPEC_EXPECT_MASK", "causal")  # the environment over pyproject.toml
    code, out, _ = check(capsys)
    assert code == 1 and "statement: causal" in out
    assert check(capsys, "--expect-mask", "sliding-window:4")[0] == 0  # the command line over the environment
    monkeypatch.delenv("ATTN_SPEC_EXPECT_MASK")
    (tmp_path / "pyproject.toml").write_text('[tool.attn-spec]\nprofile = "quick"\nseed = 3\n')
    monkeypatch.setenv("ATTN_SPEC_CONVENTION", "score-mod")
    monkeypatch.setenv("ATTN_SPEC_EXPECT_SCORE", "softcap:50")
    code, out, _ = check(capsys, f"{MODS}:tanh_softcap", "--only", "score-mod-statement")
    assert code == 0 and "(score-mod convention): CONFORMS" in out
    for name in ("ATTN_SPEC_CONVENTION", "ATTN_SPEC_EXPECT_SCORE"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("ATTN_SPEC_LAYOUT", "bhsd")  # the flash-style kernel read the other way round
    code, out, _ = check(capsys, f"{EXAMPLES / 'flash_kernel.py'}:attention", "--only", "matches-reference")
    assert code == 1 and "layout: bhsd (given)" in out


def test_window_and_softcap_skip_where_a_target_takes_neither():
    report = attn_spec.check(attn_spec.reference.reference_attention, profile="quick", seed=3,
                             only=["sliding-window", "softcap"])
    for result in report.targets[0].properties:
        assert result.status == "skip" and "takes no" in result.message


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_hand_picked_examples_run_where_float64_is_not_checked(seed):
    """An hf target is checked in float32, float16 and bfloat16; the catalog's examples are written in float64.
    They run in a checked dtype, so softcap's causal example with cap 1 catches the cap applied after the mask
    at every seed (when they were dropped, the drawn cases missed it at seed 1)."""
    from gallery.ecosystem import softcap_after_mask

    target = attn_spec.check(softcap_after_mask, convention="hf", profile="quick", seed=seed, only=["softcap"]).targets[0]
    (result,) = target.properties
    assert result.status == "fail" and result.case.dtype != "float64", (result.status, result.message)
    assert "after the mask" in result.cause


@pytest.mark.slow
def test_an_hf_function_reading_a_module_attribute_the_kit_lacks_is_a_limitation_stated_once(tmp_path, capsys):
    """Not 21 failures of the target: the header names the attribute and how to supply it; supplied, it conforms."""
    source = tmp_path / "reads_theta.py"
    source.write_text(textwrap.dedent("""
        import torch

        def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
            scale = scaling * module.config.logit_scale * module.temperature  # attributes the stand-in lacks
            key, value = (t.repeat_interleave(module.num_key_value_groups, dim=1) for t in (key, value))
            scores = query @ key.transpose(2, 3) * scale
            if attention_mask is not None:
                scores = scores + attention_mask
            weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
            return (weights @ value).transpose(1, 2).contiguous(), weights
    """))
    code, out, _ = check(capsys, f"{source}:attention", *QUICK)
    assert code == 1 and "NOTHING CHECKED" in out and "DOES NOT CONFORM" not in out
    assert out.count("kit limitation:") == 1 and "--hf-module-attr logit_scale=VALUE" in out.replace("config.", "")
    code, out, err = check(capsys, f"{source}:attention", *QUICK, "--hf-module-attr", "config.logit_scale=1.0",
                           "temperature=1")
    assert code == 0, out + err
    assert "kit limitation" not in out
    with pytest.raises(KitUsageError, match="applies to the hf convention"):
        make_target(attn_spec.reference.reference_attention, hf_module_attr=["x=1"])
    with pytest.raises(KitUsageError, match="not a Python literal"):
        make_target(_hf_blocked, hf_module_attr=["x=torch.ones(2)"])


def _hf_blocked(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                           enable_gqa=True)
    return out.transpose(1, 2), None


def test_a_config_with_fewer_kv_heads_makes_gqa_a_requirement(tmp_path):
    """MHA-only (raises on H_kv != H): conforms, lacking gqa; the same function for a GQA model's config fails."""
    from gallery.ecosystem import GQA_CONFIG, mha_only_eager

    plain = attn_spec.check(mha_only_eager, profile="quick", seed=3, only=["gqa-equivalence", "matches-reference"])
    assert plain.conforms and re.search(r"lacks .*\bgqa \(", str(plain)) and "skipped gqa-equivalence: not checked" in str(plain)
    grouped = attn_spec.check(mha_only_eager, profile="quick", seed=3, only=["gqa-equivalence"], hf_config=GQA_CONFIG)
    assert not grouped.conforms and "num_key_value_heads=8 < num_attention_heads=32" in str(grouped)
    assert [d.mistake for d in grouped.targets[0].diagnoses] == ["gqa-kv-not-repeated"]
    blocked = attn_spec.check(_hf_blocked, profile="quick", seed=3, only=["gqa-equivalence"], hf_config=GQA_CONFIG)
    assert blocked.conforms, str(blocked)
