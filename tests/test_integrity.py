"""A target in the kit's own process cannot game ``attn-spec check`` (issue 33.3): each attack below is written
as a small target and must fail with a cause that names it; the same check of a correct target is unchanged.

Monkeypatching (attn_spec.targets.integrity): torch's functions and the kit's own objects replaced at import
or during a call are put back and fail the ``integrity:untouched`` row."""
from __future__ import annotations

import textwrap
import threading
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec.errors import Failure
from attn_spec.report.results import TargetReport
from attn_spec.targets.conventions import make_target
from attn_spec.targets.integrity import Snapshot
from gallery.core import seed_function

RUN = dict(profile="quick", seed=20261203, only=["matches-reference"], diagnose=False)

CORRECT = (Path(__file__).resolve().parents[1] / "examples" / "seed_attention.py").read_text(encoding="utf-8")
WRONG = '''
import torch

def attention(Q, K, V, mask=None):
    return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)  # wrong everywhere
'''


def _check(tmp_path, source: str, **options):
    path = tmp_path / "target.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return attn_spec.check(f"{path}:attention", **{**RUN, **options}).targets[0]


def _integrity(report: TargetReport):
    return next((p for p in report.properties if p.id == "integrity:untouched"), None)


PATCHES_AT_IMPORT = {  # what a target replaces at import -> the name the report gives it
    "torch.softmax = lambda x, dim=-1, **kw: torch.ones_like(x) / x.shape[dim]": "torch.softmax",
    "import torch.nn.functional as F\nF.scaled_dot_product_attention = lambda *a, **k: a[2]":
        "torch.nn.functional.scaled_dot_product_attention",
    "torch.Tensor.__matmul__ = lambda a, b: torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)":
        "torch.Tensor.__matmul__",
    "torch.allclose = lambda *a, **k: True": "torch.allclose",
    "torch.testing.assert_close = lambda *a, **k: None": "torch.testing.assert_close",
    "torch.matmul = lambda a, b: torch.zeros(a.shape[:-1] + b.shape[-1:], dtype=a.dtype)": "torch.matmul",
    "torch.exp = lambda x: x": "torch.exp",
    "import attn_spec.report.results as r\nr.TargetReport.conforms = property(lambda self: True)":
        "attn_spec.report.results.TargetReport.conforms",
    "import attn_spec.checking.tolerance as t\nt.budget = lambda *a, **k: float('inf')":
        "attn_spec.checking.tolerance.budget",
    "import attn_spec.reference as r\nr.attention = lambda q, k, v, *a, **kw: torch.zeros(1)": "attn_spec.reference.attention",
    "import attn_spec.properties as p\nobject.__setattr__(p.catalog()['matches-reference'], 'fn', lambda t, c: None)":
        "attn_spec.properties.catalog()['matches-reference'].fn",
}


@pytest.mark.parametrize("patch", list(PATCHES_AT_IMPORT))
def test_a_patch_at_import_is_undone_and_fails_naming_what_it_replaced(tmp_path, patch):
    """The wrong target patches what would make it pass; the kit undoes it before any property runs, so the
    target's own bug is found too, and the integrity row says what it replaced, at import."""
    before = Snapshot()
    report = _check(tmp_path, WRONG + "\n" + patch)
    assert not report.conforms and "DOES NOT CONFORM" in report.verdict
    row = _integrity(report)
    assert row is not None and row.status == "fail"
    assert f"replaced {PATCHES_AT_IMPORT[patch]}" in row.message and "at import" in row.message, row.message
    assert next(p for p in report.properties if p.id == "matches-reference").status == "fail"
    assert before.restore() == []  # everything is as it was before the target was loaded


def test_a_patch_made_during_a_call_fails_the_property_it_ran_in(tmp_path):
    """Replacing torch.allclose and torch.softmax on the first call (the kit's probe of the layout): the
    integrity row says when it happened; torch is whole again afterwards."""
    allclose = torch.allclose
    report = _check(tmp_path, '''
        import torch
        def attention(Q, K, V, mask=None):
            torch.allclose = lambda *a, **k: True
            torch.softmax = lambda x, dim=-1, **kw: torch.ones_like(x) / x.shape[dim]
            return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)
    ''')
    assert torch.allclose is allclose and not report.conforms
    row = _integrity(report)
    assert "replaced torch.allclose, torch.softmax during the layout probe" in row.message, row.message
    assert next(p for p in report.properties if p.id == "matches-reference").status == "fail"


def test_a_correct_target_has_no_integrity_row(tmp_path):
    report = _check(tmp_path, CORRECT)
    assert report.conforms and _integrity(report) is None


# ---------------------------------------------------------------- fresh storage, outputs

CACHES = {  # a result kept between calls, found by ...
    "pointer": "key = (Q.data_ptr(), K.data_ptr(), V.data_ptr(), tuple(Q.shape), Q.dtype)",
    "shape": "key = (tuple(Q.shape), tuple(K.shape), tuple(V.shape), Q.dtype, mask is None)",
}


@pytest.mark.parametrize("by", list(CACHES))
def test_a_result_cached_by_address_or_shape_fails_at_the_default_profile(tmp_path, by):
    """determinism's middle call gets the first call's own tensors with V changed in place: the cached result
    comes back, and the cause names the cache."""
    report = _check(tmp_path, CORRECT + f'''
_cache = {{}}
_correct = attention

def attention(Q, K, V, mask=None):
    {CACHES[by]}
    if key not in _cache:
        _cache[key] = _correct(Q, K, V, mask)
    return _cache[key].clone()
''', profile="default", only=["determinism"])
    failed = next(p for p in report.properties if p.id == "determinism")
    assert failed.status == "fail"
    # a cache by shape ignores its inputs altogether: the informative check says so before the stale result
    assert ("a cache keyed by the inputs' data pointer or shape" if by == "pointer"
            else "the output does not depend on Q and K and V") in failed.cause, failed


OUTPUTS = {  # a target whose output is wrong as an object -> words of its failure
    "returns Q, overwritten": ("out = _correct(Q, K, V, mask)\n"
                               "    return Q.copy_(out) if out.shape == Q.shape and out.dtype == Q.dtype else out",
                               "shares its storage with Q"),
    "one buffer every call": ("global _buffer\n    out = _correct(Q, K, V, mask)\n"
                              "    if _buffer is None or _buffer.shape != out.shape or _buffer.dtype != out.dtype:\n"
                              "        _buffer = torch.empty_like(out)\n"
                              "    return _buffer.copy_(out)",
                              "the same buffer as the output of an earlier call"),
}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_an_output_that_is_an_input_or_an_earlier_output_fails(tmp_path, name):
    body, words = OUTPUTS[name]
    report = _check(tmp_path, CORRECT + f'''
_correct = attention
_buffer = None

def attention(Q, K, V, mask=None):
    {body}
''', only=["matches-reference", "determinism"])
    assert not report.conforms
    assert any(words in p.message for p in report.properties if p.status == "fail"), report.properties


@pytest.mark.parametrize("name, words", [("lying_subclass", "a torch.Tensor subclass AlwaysRight"),
                                         ("returns_meta", "a tensor on the meta device"),
                                         ("returns_complex", "a complex tensor (torch.complex64)")])
def test_check_refuses_the_outputs_grading_refuses(name, words):
    """The grader's bad outputs (tests/submissions, test_grade.py) fail ``check`` too, in its own process."""
    path = Path(__file__).parent / "submissions" / f"{name}.py"
    report = attn_spec.check(f"{path}:attention", **RUN).targets[0]
    failed = next(p for p in report.properties if p.id == "matches-reference")
    assert failed.status == "fail" and words in failed.message and "plain dense torch.Tensor" in failed.message


def test_an_output_filled_in_after_the_call_returns_fails_when_the_next_call_returns():
    """A background thread writes the result after the call returned (here: when released, deterministically):
    the values read when it returned are compared again when the next call returns."""
    release, threads = threading.Event(), []

    def attention(Q, K, V, mask=None):
        out = torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)

        def fill():
            release.wait(5)
            out.copy_(seed_function(Q, K, V, mask))
        threads.append(threading.Thread(target=fill))
        threads[-1].start()
        return out

    target = make_target(attention, "lazy", layout="bhsd")  # no layout probe: the first call is the one below
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64) for _ in range(3))
    target.attend(q, k, v)
    release.set()
    threads[0].join()
    with pytest.raises(Failure) as caught:
        target.attend(q.clone(), k.clone(), v.clone())
    assert "values changed after it was returned" in caught.value.message
    assert "background thread" in caught.value.cause


def test_a_lazy_result_fails_the_check():
    """The same target in a check: not conforming, the cause says the output changed after it was returned."""
    def attention(Q, K, V, mask=None):
        out = torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)
        done = seed_function(Q, K, V, mask)  # computed now, written after the call returns
        threading.Timer(0.002, lambda: out.copy_(done)).start()
        return out

    report = attn_spec.check(attention, **RUN).targets[0]
    assert not report.conforms


# ---------------------------------------------------------------- shapes and rows, at the default profile

DEFAULT = dict(RUN, profile="default")


def test_a_max_subtraction_skipped_above_some_length_fails_at_the_default_profile(tmp_path):
    """The default profile's long example (1531 keys, scores far beyond exp's float32 range) reaches the fast path."""
    report = _check(tmp_path, CORRECT + '''
_correct = attention

def attention(Q, K, V, mask=None):
    if K.shape[-2] <= 1024:
        return _correct(Q, K, V, mask)
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    e = scores.exp()  # no max subtraction: inf / inf
    return (e / e.sum(-1, keepdim=True)) @ V
''', **DEFAULT)
    failed = report.properties[0]
    assert failed.id == "matches-reference" and failed.status == "fail" and "NaN or inf" in failed.message


@pytest.mark.slow
def test_rows_exact_only_where_the_row_sampler_looks_fail_at_the_default_profile(tmp_path):
    """The kernel asks the kit's own row chooser which rows will be judged and computes only those exactly (the
    rest in bfloat16): the kit draws its random rows afresh after the call, and judges every row too."""
    report = _check(tmp_path, CORRECT + '''
from attn_spec.checking import rows
_correct = attention

def attention(Q, K, V, mask=None):
    exact = _correct(Q, K, V, mask)
    if Q.shape[-2] < 1024:
        return exact
    rough = _correct(Q.bfloat16(), K.bfloat16(), V.bfloat16(), mask).to(Q.dtype)
    looked_at = torch.tensor(list(rows.choose(Q.shape[-2], K.shape[-2])))
    rough[..., looked_at, :] = exact[..., looked_at, :]
    return rough
''', **DEFAULT)
    failed = report.properties[0]
    assert failed.status == "fail" and ("drawn at random" in failed.message or "not one of the" in failed.message), \
        failed.message


def test_branches_right_only_at_benchmark_shapes_fail():
    """Right only where every length and width is a power of two or a multiple of 16 (a benchmark's shapes):
    the profile's examples and draws are not all such shapes."""
    def attention(Q, K, V, mask=None):
        sizes = (Q.shape[-2], K.shape[-2], Q.shape[-1], V.shape[-1])
        if all(n & (n - 1) == 0 or n % 16 == 0 for n in sizes):
            return seed_function(Q, K, V, mask)
        return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)

    report = attn_spec.check(attention, **DEFAULT).targets[0]
    assert report.properties[0].status == "fail"


RECORDS = '''
import torch
import recorder
{reseed}

def attention(Q, K, V, mask=None):
    recorder.{name}.append(repr((tuple(Q.shape), tuple(K.shape), Q.dtype, float(Q.double().sum()), float(V.double().sum()))))
    {reseed}
    scores = Q @ K.transpose(-2, -1) / Q.shape[-1] ** 0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
'''


def test_a_target_that_reseeds_torch_draws_the_same_cases(tmp_path, monkeypatch):
    """torch.manual_seed(0) at import and in every call: the kit draws from its own generators (Hypothesis', each
    case's seeded torch.Generator, the row chooser's), and the guard restores torch's global RNG after each call,
    so the cases are the very same as a target that leaves the RNG alone gets."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "recorder.py").write_text("plain, reseeds = [], []\n", encoding="utf-8")
    for name, reseed in (("plain", ""), ("reseeds", "torch.manual_seed(0)")):
        (tmp_path / f"{name}.py").write_text(RECORDS.format(name=name, reseed=reseed), encoding="utf-8")
    seen = {}
    for name in ("plain", "reseeds"):
        before = torch.get_rng_state()
        report = attn_spec.check(f"{tmp_path / name}.py:attention", **dict(RUN, only=["matches-reference",
                                                                                     "permutation-equivariance"]))
        assert report.conforms and torch.equal(torch.get_rng_state(), before)
        seen[name] = getattr(__import__("recorder"), name)
    assert seen["plain"] and seen["plain"] == seen["reseeds"]
    reseeded = report.targets[0].state_changes
    assert any(c["state"] == "global RNG seed" for c in reseeded)


def test_torch_rewrapping_its_own_function_at_an_import_is_no_patch(tmp_path):
    """Importing torch._dynamo (torch.compile, FlexAttention) replaces torch.manual_seed by torch's own wrapper
    around it: a correct target that imports it conforms with no integrity row (it failed every property before)."""
    report = _check(tmp_path, "import torch._dynamo\n" + CORRECT)
    assert report.conforms and _integrity(report) is None, report.verdict


def test_a_wrapper_of_the_targets_own_around_the_original_is_a_patch(tmp_path):
    """The same shape of replacement made by the target's code (a wrapper whose __wrapped__ is the original) is a
    patch: only torch's own code may rewrap."""
    report = _check(tmp_path, WRONG + '''
import functools
_original = torch.softmax

@functools.wraps(_original)
def softmax(x, *args, **kwargs):
    return _original(x, *args, **kwargs)

torch.softmax = softmax
''')
    row = _integrity(report)
    assert row is not None and row.status == "fail" and "torch.softmax" in row.message, row
