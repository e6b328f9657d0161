"""Conventions are probed and reported, and fail a check only when a user requires them."""
import json
import math
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec import reference
from attn_spec.targets.conventions import make_target
from attn_spec.cli import main
from attn_spec.targets.behaviours import VALUES, probe_behaviours

NEG_INF = float("-inf")
ROOT = Path(__file__).resolve().parents[1]


def _scores(Q, K):
    return Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))  # [..., Tq, Tk]


def nan_rows(Q, K, V, mask=None):
    """The seed: a row with no allowed key is softmax of all -inf, hence NaN."""
    s = _scores(Q, K)
    return torch.softmax(s if mask is None else s.masked_fill(~mask, NEG_INF), dim=-1) @ V


def zero_rows(Q, K, V, mask=None):
    """Rows with no allowed key get zero weights; masked K/V are zeroed before use, so NaN there is ignored."""
    if mask is None:
        return nan_rows(Q, K, V)
    keys = mask.any(dim=-2).unsqueeze(-1)  # [..., Tk, 1] keys some query may attend
    K, V = torch.where(keys, K, 0.0), torch.where(keys, V, 0.0)
    return torch.nan_to_num(nan_rows(Q, K, V, mask), nan=0.0)


def uniform_rows(Q, K, V, mask=None):
    """The Hugging Face bias: finfo.min absorbs every score of a fully masked row, so its weights are uniform."""
    s = _scores(Q, K)
    if mask is not None:
        s = s + torch.zeros_like(s).masked_fill(~mask, torch.finfo(Q.dtype).min)
    return torch.softmax(s, dim=-1) @ V


def unmasked_fallback(Q, K, V, mask=None):
    """A fully masked row falls back to no mask at all: neither NaN, zeros nor uniform."""
    if mask is not None:
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    return nan_rows(Q, K, V, mask)


def true_ignores(Q, K, V, mask=None):
    """nn.MultiheadAttention's polarity: True = ignore."""
    s = _scores(Q, K)
    return torch.softmax(s if mask is None else s.masked_fill(mask, NEG_INF), dim=-1) @ V


def ignores_mask(Q, K, V, mask=None):
    return nan_rows(Q, K, V)


def rejects_masks(Q, K, V, mask=None):
    """Its own refusal before any arithmetic: a declaration (attn_spec.targets.envelope), so the probe is n/a."""
    if mask is not None:
        raise ValueError("masks are not supported")
    return nan_rows(Q, K, V)


def crashes_on_masks(Q, K, V, mask=None):
    """A crash inside the computation on a mask (a size mismatch from torch): the probe raises."""
    if mask is not None:
        Q = mask.to(Q.dtype) @ Q  # [Tq, Tk] x [Tq, D]: Tk != Tq in every probe
    return nan_rows(Q, K, V)


def returns_a_tuple(Q, K, V, mask=None):
    return nan_rows(Q, K, V, mask), None


def takes_no_mask(Q, K, V):
    return nan_rows(Q, K, V)


def bottom_right_causal(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """The sdpa convention with FlashAttention's causal alignment for n_q != n_kv."""
    out, _ = reference.attention(query, key, value, attn_mask, causal=is_causal, causal_alignment="bottom-right")
    return out.to(query.dtype)


def _probe(fn, convention=None):
    return probe_behaviours(make_target(fn, convention=convention))


@pytest.mark.parametrize("fn, expected", [(nan_rows, "nan"), (zero_rows, "zeros"), (uniform_rows, "uniform"),
                                          (unmasked_fallback, "other"), (rejects_masks, "n/a"),
                                          (crashes_on_masks, "raises"),
                                          (returns_a_tuple, "other"), (takes_no_mask, "n/a")])
def test_fully_masked_row(fn, expected):
    assert _probe(fn)["fully-masked"] == expected


def test_fully_masked_row_of_a_kernel_without_masks_is_read_through_is_causal():
    """A [B, S, H, D] kernel with no mask argument: 3 queries over 2 keys, bottom-right, leave query 0 without keys;
    top-left (SDPA's is_causal alone) never does."""
    from gallery.contracts import flash_empty_rows_nan, flash_empty_rows_zeros

    assert _probe(flash_empty_rows_nan, "sdpa")["fully-masked"] == "nan"
    assert _probe(flash_empty_rows_zeros, "sdpa")["fully-masked"] == "zeros"

    def top_left_only(query, key, value, is_causal=False):
        return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=is_causal)
    assert _probe(top_left_only, "sdpa")["fully-masked"] == "n/a"


@pytest.mark.parametrize("fn, expected", [(nan_rows, "true-attends"), (true_ignores, "true-ignores"),
                                          (ignores_mask, "other"), (rejects_masks, "n/a"),
                                          (crashes_on_masks, "raises")])
def test_mask_polarity(fn, expected):
    assert _probe(fn)["mask-polarity"] == expected


@pytest.mark.parametrize("fn, expected", [(nan_rows, "propagates"), (zero_rows, "ignored"), (rejects_masks, "n/a"),
                                           (crashes_on_masks, "raises")])
def test_masked_nan(fn, expected):
    assert _probe(fn)["masked-nan"] == expected


@pytest.mark.parametrize("fn, expected", [(torch.nn.functional.scaled_dot_product_attention, "top-left"),
                                          (bottom_right_causal, "bottom-right"), (nan_rows, "n/a")])
def test_causal_alignment(fn, expected):
    assert _probe(fn)["causal-alignment"] == expected


def test_weights_returned():
    assert _probe(torch.nn.MultiheadAttention)["weights-returned"] == "yes"
    assert _probe(nan_rows)["weights-returned"] == "no"


def test_module_convention_and_fixed_keys():
    found = _probe(reference.MultiHeadAttention, "module")
    assert found == {"fully-masked": "zeros", "mask-polarity": "true-attends", "masked-nan": "propagates",
                     "causal-alignment": "n/a", "weights-returned": "no", "gqa-grouping": "n/a", "finite-fill": "exact"}
    assert set(found) == set(VALUES)


def test_inverted_polarity_is_named_by_mask_semantics():
    report = attn_spec.check(true_ignores, profile="quick", seed=1, only=["mask-semantics"], dtypes=["float64"])
    result = report.targets[0].properties[0]
    assert report.targets[0].behaviours["mask-polarity"] == "true-ignores"
    assert result.status == "fail" and "inverted polarity" in result.cause


def test_report_header_and_json_show_behaviours():
    report = attn_spec.check(zero_rows, profile="quick", seed=1, only=["scale-sqrt-dk"], dtypes=["float64"])
    assert report.conforms
    text = str(report)
    assert "behaviours: fully-masked=zeros, mask-polarity=true-attends, masked-nan=ignored" in text
    assert "behaviours: fully-masked=zeros" in report.to_markdown()
    assert report.to_dict()["targets"][0]["behaviours"]["fully-masked"] == "zeros"


def test_required_convention_fails_only_when_it_differs():
    report = attn_spec.check(nan_rows, profile="quick", seed=1, only=["scale-sqrt-dk"], dtypes=["float64"],
                             require=["fully-masked=zeros", "mask-polarity=true-attends"])
    results = {p.id: p for p in report.targets[0].properties}
    assert not report.conforms
    assert results["convention:fully-masked"].status == "fail"
    assert "required fully-masked=zeros, found fully-masked=nan" in results["convention:fully-masked"].message
    assert results["convention:mask-polarity"].status == "pass"


@pytest.fixture
def target_file(tmp_path):
    path = tmp_path / "attn.py"
    path.write_text((ROOT / "examples" / "seed_attention.py").read_text(encoding="utf-8"))
    return f"{path}:attention"


def _cli(target, *require):
    return main(["check", target, "--profile", "quick", "--seed", "1", "--only", "scale-sqrt-dk", "--format", "json",
                 "--require", *require])


def test_cli_require_passes(target_file, capsys):
    assert _cli(target_file, "fully-masked=nan", "masked-nan=propagates") == 0
    data = json.loads(capsys.readouterr().out)
    assert data["targets"][0]["behaviours"]["fully-masked"] == "nan"
    assert data["targets"][0]["conventions"] == data["targets"][0]["behaviours"]  # the deprecated alias


def test_cli_require_fails(target_file, capsys):
    assert _cli(target_file, "fully-masked=zeros") == 1
    statuses = {p["id"]: p["status"] for p in json.loads(capsys.readouterr().out)["targets"][0]["properties"]}
    assert statuses["convention:fully-masked"] == "fail"


@pytest.mark.parametrize("item, problem", [("fully-masked=zero", "unknown value 'zero'"),
                                           ("padding=left", "unknown behaviour 'padding'")])
def test_cli_require_usage_errors(target_file, capsys, item, problem):
    assert _cli(target_file, item) == 2
    err = capsys.readouterr().err
    assert problem in err
    assert "fully-masked=nan|zeros|uniform" in err and "mask-polarity=true-attends|true-ignores" in err


def test_explain_behaviours_says_what_every_probed_value_means(capsys):
    """The header's behaviours line is read as a list of mask bugs unless each value is explained (issue 23)."""
    from attn_spec.targets.behaviours import MEANINGS, PROBES

    assert set(MEANINGS) == set(VALUES) >= set(PROBES)
    for key, values in VALUES.items():
        assert set(values) <= set(MEANINGS[key][1]), key
    assert main(["explain", "behaviours"]) == 0
    shown = capsys.readouterr().out
    assert "never a failure" in shown and "--require KEY=VALUE" in shown
    for key, (question, values) in MEANINGS.items():
        assert f"{key}: {question}" in shown and all(meaning in shown for meaning in values.values())
