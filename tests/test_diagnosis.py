"""Differential diagnosis (``attn_spec.diagnosis``): the catalog of mistake models, the replay engine
that names the model reproducing a failure's calls, and what the CLI shows of them.

The gallery's own entries are diagnosed in ``test_gallery.py``; here the models are checked on
targets written independently of the gallery (other code for the same bugs), on correct code (no
model may be named), and on failures no model reproduces (a guess, marked as such)."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from attn_spec.checking.cases import Case
from attn_spec.properties import catalog
from attn_spec.cli import main
from attn_spec.diagnosis import MISTAKES
from attn_spec.diagnosis.evidence import gather
from attn_spec.checking.probes import name_scale
from attn_spec.diagnosis.numbers import masked_share, weight_factor
from attn_spec.diagnosis.replay import Evidence, fits
from attn_spec.targets.record import Recorder
from attn_spec.mistake_lessons import mistake_sections
from attn_spec.targets.conventions import make_target
from gallery import BUGGY
from test_gallery import UNDIAGNOSED


def test_the_catalog_is_data_with_a_sentence_and_a_fix():
    assert len(MISTAKES) >= 40
    for m in MISTAKES.values():
        assert m.id == m.id.lower() and " " not in m.id
        assert m.describe() and m.fix_for() and m.family and m.code.startswith("def ")
        assert "undefined" not in m.describe() and "no standard form" not in m.describe()
        assert set(m.caught_by) <= set(catalog()), m.id


def test_serving_kernels_models_are_entries_of_the_one_catalog():
    """One record type, one registry: a serving kernel's model is a Mistake of level decode, merge or varlen (paged
    ones flagged), listed and explained with the rest, and never replayed on an attention's calls."""
    from attn_spec.diagnosis.predict import predict
    from attn_spec.targets.record import Call

    serving = [m for m in MISTAKES.values() if m.serving]
    assert {m.level for m in serving} == {"decode", "merge", "varlen"} and any(m.paged for m in serving)
    assert all(m.family == "serving" for m in serving) and not any(m.paged for m in MISTAKES.values() if not m.serving)
    q = torch.randn(2, 3, 4, dtype=torch.float64)
    assert all(predict(m, Call("attend", {"q": q, "k": q, "v": q, "mask": None})) is None for m in serving)


def test_every_gallery_bug_declares_a_mistake_of_the_catalog():
    """Every buggy entry declares its mistake, or is listed in test_gallery's UNDIAGNOSED with a reason. A
    FlexAttention mod makes no attention calls to replay: its entry declares instead the words every
    failure's cause must contain (test_gallery checks them)."""
    from attn_spec.targets.conventions import MOD_CONVENTIONS

    declared = {e.name: e.mistake for e in BUGGY if e.convention not in MOD_CONVENTIONS}
    assert all(m or name in UNDIAGNOSED for name, m in declared.items()), \
        [name for name, m in declared.items() if not m and name not in UNDIAGNOSED]
    assert set(filter(None, declared.values())) <= set(MISTAKES)  # serving kernels' models included
    mods = [e for e in BUGGY if e.convention in MOD_CONVENTIONS]
    assert mods and all(e.diagnosis and not e.mistake for e in mods), [e.name for e in mods]
    assert not [e.name for e in BUGGY if e.diagnosis and e.convention not in MOD_CONVENTIONS]


@pytest.mark.parametrize("mid", list(MISTAKES))
def test_explain_every_mistake(mid, capsys):
    sections = mistake_sections(mid)
    assert sections["does"] and sections["fix"] and sections["code"]
    assert main(["explain", mid]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{mid}: a mistake model") and sections["does"][:40] in text.replace("\n  ", " ")
    assert main(["explain", mid, "--format", "markdown"]) == 0
    assert "```python\ndef " in capsys.readouterr().out


def test_list_mistakes(capsys):
    assert main(["list", "--mistakes", "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert all(f"| {mid} " in md for mid in MISTAKES) and f"{len(MISTAKES)} mistake models" in md


def test_a_worked_example_shows_the_mistake_beside_the_correct_formula():
    example = mistake_sections("scale-missing")["example"]
    assert "correct: out = " in example and "scale-missing: out = " in example
    assert "raises" in mistake_sections("queries-keys-swapped")["example"] or "queries-keys-swapped: out" in \
        mistake_sections("queries-keys-swapped")["example"]


# ---------------------------------------------------------------- the replay engine on code of its own


def _scores(q, k):
    return torch.einsum("...qd,...kd->...qk", q, k)  # [..., Tq, Tk], unscaled


def divides_by_width(q, k, v, mask=None):  # scale-one-over-dk, written differently from the gallery
    s = _scores(q, k) / k.size(-1)
    if mask is not None:
        s = torch.where(mask, s, torch.full_like(s, -math.inf))
    return torch.softmax(s, -1) @ v


def keeps_masked_where_true(q, k, v, mask=None):  # mask-inverted
    s = _scores(q, k) * k.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    w = torch.softmax(s, dim=-1)
    return torch.where(torch.isnan(w), torch.zeros_like(w), w) @ v


def precedence_scale(q, k, v, mask=None):  # scale-one-over-two-dk: `d_k ** 1/2`
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 1 / 2
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def casts_to_float(q, k, v, mask=None):  # computes-in-float32, through a float32 copy of everything
    out = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    return out.to(q.dtype)


def correct_einsum(q, k, v, mask=None):
    s = _scores(q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.einsum("...qk,...kd->...qd", s.softmax(-1), v)


def squared_weights(q, k, v, mask=None):  # no model of the catalog: weights = softmax(s)^2
    s = _scores(q, k) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1).pow(2) @ v


def _evidence(fn, prop_id, case):
    target = make_target(fn, fn.__name__, "function")
    return gather(prop_id, catalog()[prop_id].fn, target, case)


CASES = {"plain": Case(n_q=3, n_kv=4, d_k=4, d_v=2, values="normal", seed=3),
         "masked": Case(batch=(2,), n_q=3, n_kv=3, d_k=2, d_v=2, mask="random", seed=5)}


@pytest.mark.parametrize("fn, prop_id, case, mistake", [
    (divides_by_width, "matches-reference", "plain", "scale-one-over-dk"),
    (keeps_masked_where_true, "matches-reference", "masked", "mask-inverted"),
    (precedence_scale, "matches-reference", "plain", "scale-one-over-two-dk"),
    (casts_to_float, "matches-reference", "masked", "computes-in-float32"),
], ids=lambda x: getattr(x, "__name__", x) if callable(x) else x)
def test_code_of_its_own_is_named(fn, prop_id, case, mistake):
    evidence = _evidence(fn, prop_id, CASES[case])
    assert evidence.reproduced and not evidence.nondeterministic
    assert evidence.fits and evidence.fits[0].mistake.id == mistake, [f.mistake.id for f in evidence.fits]


def test_precision_is_one_root_not_a_formula_bug():
    """A float64 target computed in float32 fits the correct formula at float32: nothing else may be named."""
    evidence = _evidence(casts_to_float, "matches-reference", CASES["plain"])
    assert [f.mistake.id for f in evidence.fits] == ["computes-in-float32"]


def test_correct_code_fits_no_model():
    """Replayed on a correct target, no model differs from the correct formula and fits: nothing is named."""
    target = make_target(correct_einsum, "correct_einsum", "function")
    for prop_id in ("matches-reference", "mask-semantics", "rows-sum-to-one"):
        target.recorder = Recorder()
        case = catalog()[prop_id].examples[0]
        catalog()[prop_id].fn(target, case)
        calls, target.recorder = target.recorder.calls, None
        assert calls and fits(Evidence(calls)) == []


def test_when_no_model_fits_the_nearest_is_a_guess():
    evidence = _evidence(squared_weights, "matches-reference", CASES["plain"])
    assert evidence.fits == []
    assert evidence.guess is None or evidence.guess[1] <= evidence.guess[0].calls


def sqrt_of_scale(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    root = math.sqrt(scale if scale is not None else query.shape[-1] ** -0.5)  # ValueError for scale < 0
    return torch.nn.functional.scaled_dot_product_attention(query * root, key * root, value, attn_mask=attn_mask,
                                                            is_causal=is_causal, scale=1.0)


def test_a_crash_is_reproduced_by_the_model_that_raises_the_same_way():
    target = make_target(sqrt_of_scale, "sqrt_of_scale", "sdpa")
    evidence = gather("scale-argument", catalog()["scale-argument"].fn, target, Case(n_q=2, n_kv=3, d_k=4, d_v=2,
                                                                                     seed=1))
    assert evidence.crash and evidence.crash[0] == "ValueError" and "sqrt_of_scale" in evidence.traceback
    assert evidence.fits and evidence.fits[0].mistake.id == "scale-argument-sqrt-split"


# ---------------------------------------------------------------- causes read from the numbers


@pytest.mark.parametrize("found, n_heads, name", [
    ({4: 1 / 4, 16: 1 / 16}, 1, "1/d_k"),
    ({4: 1 / 8, 16: 1 / 32}, 1, "1/(2 d_k)"),
    ({4: 1.0, 16: 1.0}, 1, "1 (no scaling)"),
    ({4: 1 / 8, 16: 1 / 8}, 1, "a hard-coded d_k of 64"),
    ({4: 1 / math.sqrt(8), 16: 1 / math.sqrt(32)}, 2, "1/sqrt(d_model)"),
    ({4: 1 / 1.8, 16: 1 / 3.6}, 1, "a temperature of 0.9"),
    ({4: math.inf, 16: math.inf}, 1, "unreadable"),
])
def test_the_scale_law_is_named(found, n_heads, name):
    said = name_scale(found, n_heads)
    assert name in said and "undefined" not in said and "no standard form" not in said


def test_a_factor_on_every_weight_and_a_shared_masked_weight():
    ref = torch.tensor([[0.25, 0.75], [0.5, 0.5]], dtype=torch.float64)
    assert "every weight is ×0.984" in weight_factor(0.984 * ref, ref)
    assert "factor of its own" in weight_factor(ref * torch.tensor([[0.9], [0.8]], dtype=torch.float64), ref)
    assert weight_factor(ref.flip(-1), ref) == ""
    w = torch.tensor([[0.5, 0.1, 0.1, 0.3]], dtype=torch.float64)
    allowed = torch.tensor([[True, False, False, True]])
    assert "finite score" in masked_share(w, allowed)
    assert masked_share(torch.tensor([[0.5, 0.1, 0.2, 0.2]], dtype=torch.float64), allowed) == ""


# ---------------------------------------------------------------- flakiness and randomness, measured


def test_a_failure_that_does_not_come_back_is_not_called_randomness():
    """Hypothesis sees one input fail once and then pass: the kit re-runs it and says what it measured."""
    calls = [0]

    def wrong_on_the_sixth_call(q, k, v, mask=None):
        calls[0] += 1
        return correct_einsum(q, k, v, mask) + (1.0 if calls[0] == 6 else 0.0)  # a drawn case, not an example

    from attn_spec.checking.runner import run_property
    from attn_spec.targets.capabilities import supports
    target = make_target(wrong_on_the_sixth_call, "w", "function")
    supports(target, ["float64"], "cpu")  # the capabilities are probed first: count the property's own calls
    calls[0] = 0
    result = run_property(catalog()["matches-reference"], target, profile="quick", seed=1, dtypes=["float64"],
                          devices=["cpu"])
    assert result.status == "fail"
    assert "nondeterministic" not in result.cause and "depends on what ran before it" in result.message


def test_randomness_is_recognised_from_repeated_readings():
    def dropout_left_on(q, k, v, mask=None):
        s = _scores(q, k) / math.sqrt(q.shape[-1])
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return torch.nn.functional.dropout(s.softmax(-1), p=0.25) @ v

    from attn_spec.diagnosis.evidence import judge_randomness
    torch.manual_seed(0)
    m, params = judge_randomness(make_target(dropout_left_on, "d", "function"), list(MISTAKES.values()))
    assert m.id == "dropout-at-inference" and abs(params["p"] - 0.25) < 1e-6
    assert judge_randomness(make_target(correct_einsum, "c", "function"), list(MISTAKES.values())) is None


@pytest.mark.parametrize("mid", [m for m in MISTAKES if not (MISTAKES[m].recognised or MISTAKES[m].serving)])
def test_a_worked_example_differs_from_the_correct_output(mid):
    """Every model's worked example shows an output (or an input written into) that differs from the correct
    formula's: scale-d-v needs d_v != d_k, exp-without-max large float32 scores, is-causal-ignored a call with
    is_causal=True, kv-cache-left-on a second call on the same module; the lesson picks the first example input
    that tells them apart. A row the correct formula leaves to convention matches zeros or NaN."""
    from attn_spec.mistake_lessons import differs, example_call

    call, lines, good, bad = example_call(MISTAKES[mid])
    assert differs(call, good, bad), (mid, lines)
    if bad is not None and bad.changed:
        assert "written in place" in mistake_sections(mid)["example"]


def test_differs_is_not_fooled_by_rounding_or_a_convention():
    from attn_spec.diagnosis.predict import CORRECT, predict
    from attn_spec.targets.record import Call
    from attn_spec.mistake_lessons import differs

    q = torch.tensor([[1.0, 0.0], [0.0, 2.0]])  # float32
    call = Call("attend", {"q": q, "k": q, "v": q, "mask": torch.tensor([[True, False], [False, False]])})
    good = predict(CORRECT, call)
    in_float32 = predict(dataclasses.replace(CORRECT, exact=True), call)  # the same formula, rounded in float32
    assert in_float32.out.dtype == torch.float32 and not differs(call, good, in_float32)
    assert not differs(call, good, predict(MISTAKES["exp-without-max"], call))  # NaN where no key is allowed: free
    assert differs(call, good, predict(MISTAKES["mask-fill-finite"], call, {"fill": -1e9}))  # a uniform empty row
