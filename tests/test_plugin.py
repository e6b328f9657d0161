"""The pytest plugin (``--attn-target``) and properties called from a user's own tests.

Each scenario is a fresh pytest (``pytester``), with the plugin loaded through its ``pytest11`` entry point and
``--attn-profile quick`` to stay fast. It runs in this process (``runpytest_inprocess``: a new config and plugin
manager, sparing each a subprocess's torch import, about 3 s of CPU) unless the scenario is about the process
itself: the plugin's own import cost (no torch), pytest-xdist's workers, tox's command line.
"""
import importlib.util
import re
from pathlib import Path

import pytest

from attn_spec import properties
from attn_spec.targets.conventions import ATTENTION_CONVENTIONS

pytest_plugins = ["pytester"]

CORRECT = (Path(__file__).resolve().parents[1] / "examples" / "seed_attention.py").read_text(encoding="utf-8")
BUGGY = CORRECT.replace("/ math.sqrt(Q.size(-1))", "/ Q.size(-1)")  # the classic 1/d_k mistake
assert BUGGY != CORRECT


@pytest.fixture
def attn_files(pytester):
    pytester.makepyfile(attn_ok=CORRECT, attn_bad=BUGGY)
    return pytester


def header_seed(result) -> int:
    return int(re.search(r"--attn-seed=(\d+)", result.stdout.str()).group(1))


@pytest.mark.slow
def test_correct_target_passes_with_one_item_per_property(attn_files):
    result = attn_files.runpytest_inprocess("--attn-target", "attn_ok.py:attention", "--attn-profile", "quick",
                                             "--attn-seed", "7", "-v", "-rs")
    outcomes = result.parseoutcomes()
    assert result.ret == 0
    # the properties `attn-spec check` reports on an attention: the mods' and serving kernels' own are left out, not skipped
    attention = [pid for pid, p in properties.catalog().items() if set(p.conventions) & set(ATTENTION_CONVENTIONS)]
    assert outcomes.get("passed", 0) + outcomes.get("skipped", 0) == len(attention) < len(properties.catalog())
    result.stdout.fnmatch_lines([
        "attn-spec *: profile quick, --attn-seed=7, torch *, devices cpu*",
        "attn-spec target: attn_ok.py:attention (function convention)",
        f"*collected {len(attention)} items",
        *[f"attn-spec[[]attn_ok.py:attention[]]::{pid} [PS][AK]*" for pid in attention],
        "*SKIPPED*head-concat-equivalence: does not apply to the function convention*",
    ])
    assert "mask-mod-statement" not in result.stdout.str()


def test_buggy_target_fails_with_the_property_id_and_the_lesson(attn_files):
    """Two targets, each with the properties --attn-only names (repeatable, comma-separated) less --attn-skip."""
    result = attn_files.runpytest_inprocess("--attn-target", "attn_bad.py:attention", "--attn-target",
                                             "attn_ok.py:attention", "--attn-only", "scale-sqrt-dk,matches-reference",
                                             "--attn-only", "rows-sum-to-one,causal-mask", "--attn-skip", "causal-mask",
                                             "--attn-profile", "quick", "--attn-seed", "3")
    result.assert_outcomes(passed=4, failed=2)
    assert result.ret == 1
    statement = properties.catalog()["scale-sqrt-dk"].statement
    result.stdout.fnmatch_lines([
        "*attn-spec[[]attn_bad.py:attention[]]::scale-sqrt-dk*",
        f"✗ scale-sqrt-dk: {statement}",
        "  what happened: *1/d_k*",
        "  likely cause: *1/d_k instead of 1/sqrt(d_k)*",
        "  counterexample (*",
        "  reproduce:",
        "*attn_spec.reproduce('scale-sqrt-dk', 'attn_bad.py:attention', case, convention='function')",
        "rerun: pytest --attn-target=attn_bad.py:attention --attn-only=scale-sqrt-dk --attn-profile=quick "
        "--attn-seed=3",
        "*attn-spec[[]attn_bad.py:attention[]]::matches-reference*",
        "✗ matches-reference: *",
        "note: scale-sqrt-dk already failed on this target*",
        "FAILED attn-spec[[]attn_bad.py:attention[]]::scale-sqrt-dk - ✗*",
        "FAILED attn-spec[[]attn_bad.py:attention[]]::matches-reference - ✗*",
    ])


DETACHED_AND_CHATTY = CORRECT.replace("    return scores.softmax(dim=-1) @ V  # [..., n_q, d_v]",
                                      "    print('called with', tuple(Q.shape))\n"
                                      "    return (scores.softmax(dim=-1) @ V).detach()")
assert DETACHED_AND_CHATTY != CORRECT


def test_inference_only_and_the_targets_output(pytester):
    """Detached: gradients fails, with the target's prints as a captured section; with
    --attn-inference-only it is a skip that says why."""
    pytester.makepyfile(attn_detached=DETACHED_AND_CHATTY)
    args = ["--attn-target", "attn_detached.py:attention", "--attn-only", "gradients,rows-sum-to-one",
            "--attn-profile", "quick", "--attn-seed", "3", "-rs"]
    result = pytester.runpytest_inprocess(*args)
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*what happened: no autograd: *it leaves the autograd graph through .detach()*",
                                 "*Captured stdout of the target call*", "called with (2, 2)*"])
    result = pytester.runpytest_inprocess(*args, "--attn-inference-only")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*gradients: not checked: declared an inference kernel*"])


@pytest.mark.parametrize("args, message", [
    (["--attn-target", "attn_ok.py:attention", "--attn-only", "rows-sum-to-one,no-such-property"],
     "ERROR: attn-spec: only=[[]'rows-sum-to-one,no-such-property'[]] from the command line (--attn-only): "
     "unknown property id(s): no-such-property; known: *rows-sum-to-one*"),
    (["--attn-target", "missing.py:attention"], "ERROR: attn-spec: Cannot load target: no file 'missing.py'*"),
    (["--attn-target", "attn_ok.py:attention", "--attn-masks", "bool,float"],
     "ERROR: attn-spec: masks=*from the command line (--attn-masks): 'float' is not one of bool, additive*"),
], ids=["unknown-id", "missing-file", "unknown-mask-form"])
def test_bad_ids_and_unloadable_targets_are_usage_errors(attn_files, args, message):
    result = attn_files.runpytest_inprocess(*args)  # refused before anything runs
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_declared_additive_masks_reach_the_target(attn_files):
    """attn_ok reads its mask as bool (~mask): right by default, a crash once additive masks are declared."""
    args = ["--attn-target", "attn_ok.py:attention", "--attn-only", "mask-semantics", "--attn-profile", "quick",
            "--attn-seed", "7"]
    assert attn_files.runpytest_inprocess(*args).ret == 0
    result = attn_files.runpytest_inprocess(*args, "--attn-masks", "bool,additive")
    assert result.ret == 1
    result.stdout.fnmatch_lines(["*rerun: pytest --attn-target=attn_ok.py:attention --attn-only=mask-semantics "
                                 "*--attn-masks=bool,additive*"])


@pytest.mark.slow
def test_inert_without_attn_target(pytester):
    """Loaded (it is in the plugins line) but silent: no items, no header, nothing printed."""
    pytester.makepyfile(test_plain="import sys\n\ndef test_plain():\n"
                                   "    assert 'torch' not in sys.modules  # the plugin costs no torch import\n")
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    mentions = [line for line in result.outlines if "attn-spec" in line or "attn_spec" in line]
    assert len(mentions) == 1 and mentions[0].startswith("plugins: ") and "attn-spec" in mentions[0]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_under_xdist_every_worker_runs_the_cases_the_controller_prints(attn_files):
    """Two workers share the items; each failure's rerun line carries the seed of the controller's header."""
    only = "rows-sum-to-one,scale-sqrt-dk,causal-mask,matches-reference"
    result = attn_files.runpytest_subprocess("-n", "2", "--attn-target", "attn_ok.py:attention", "--attn-target",
                                             "attn_bad.py:attention", "--attn-profile", "quick", "--attn-only", only)
    result.assert_outcomes(passed=6, failed=2)  # attn_bad: scale-sqrt-dk and matches-reference
    seed = header_seed(result)
    result.stdout.fnmatch_lines(["*created: 2/2 workers*"])
    reruns = set(re.findall(r"rerun: pytest .*--attn-seed=\d+", result.stdout.str()))  # CI=true repeats them
    assert len(reruns) == 2 and {line.rsplit("=", 1)[1] for line in reruns} == {str(seed)}
    result.stdout.fnmatch_lines(["FAILED *attn-spec[[]attn_bad.py:attention[]]::scale-sqrt-dk*"])


USER_TESTS = """
import pytest

import attn_spec
from attn_spec import properties
from attn_spec.checking.cases import Case
from attn_bad import attention as buggy
from attn_ok import MultiHeadAttention, attention


def test_one_case_on_a_plain_function_and_class():
    properties.rows_sum_to_one(attention, Case(n_q=3, n_kv=2, d_k=2, d_v=2))
    properties.rows_sum_to_one(MultiHeadAttention, Case(n_q=3, n_kv=2, d_k=2, d_v=2))
    with pytest.raises(AssertionError, match="1/d_k"):
        properties.scale_sqrt_dk(buggy, Case(n_q=1, d_k=16, d_v=1))


def test_check_property_passes_and_skips():
    assert attn_spec.check_property("matches-reference", attention, profile="quick", seed=0).status == "pass"
    skipped = attn_spec.check_property("head-concat-equivalence", attention, profile="quick", seed=0)
    assert skipped.status == "skip"


def test_check_property_catches_the_bug():
    attn_spec.check_property("scale-sqrt-dk", buggy, profile="quick", seed=0)
"""


@pytest.mark.slow
def test_properties_in_a_users_own_tests(attn_files):
    attn_files.makepyfile(test_user=USER_TESTS)
    result = attn_files.runpytest_inprocess()
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*AssertionError: ✗ scale-sqrt-dk: *", "*likely cause: *1/d_k*",
                                 "*attn_spec.reproduce('scale-sqrt-dk', 'attn_bad:attention', case*",
                                 "FAILED test_user.py::test_check_property_catches_the_bug*"])


@pytest.mark.slow
def test_the_tox_thorough_env_runs_the_catalog_in_parallel():
    """tox.ini's [testenv:thorough] command as written, cut down to one property at the quick profile."""
    import configparser
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(root / "tox.ini")
    command = tox["testenv:thorough"]["commands"].replace("\\\n", " ").replace("{posargs}", "")
    args = shlex.split(command)
    assert args[:3] == ["python", "-m", "pytest"] and "-n" in args and "thorough" in args
    run = subprocess.run([sys.executable, *args[1:], "--attn-profile", "quick", "--attn-only", "rows-sum-to-one"],
                         cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "4 passed" in run.stdout and "created: " in run.stdout  # four targets, on xdist workers


def test_attn_shapes_checks_fixed_shapes_with_the_properties_that_apply(pytester):
    sdpa = "torch.nn.functional:scaled_dot_product_attention"
    result = pytester.runpytest_inprocess("--attn-target", sdpa, "--attn-shapes", "1,2,1,16,40,8 1,1,24,8",
                                           "--attn-only", "matches-reference,gqa-equivalence,mask-semantics",
                                           "--attn-seed", "4", "-v", "-rs")
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["attn-spec *devices cpu*, shapes 1,2,1,16,40,8 1,1,24,8",
                                 "*::matches-reference PASSED*", "*::mask-semantics SKIPPED*",
                                 "*::gqa-equivalence PASSED*", "*mask-semantics: it reads the weights*"])


LIMITED = CORRECT + '''

def limited(Q, K, V, mask=None):
    if K.shape[-2] > 40:
        raise NotImplementedError("sequences up to 40 positions")
    if Q.dtype == torch.float16:
        raise NotImplementedError("no float16")
    return attention(Q, K, V, mask)
'''


def test_the_summary_names_the_limits_a_target_declares(pytester):
    """pytest's own line says only how many passed: the plugin's summary says within what (a gate reads it)."""
    pytester.makepyfile(attn_limited=LIMITED)
    result = pytester.runpytest_inprocess("--attn-target", "attn_limited.py:limited", "--attn-target",
                                          "attn_limited.py:attention", "--attn-profile", "quick",
                                          "--attn-only", "scale-sqrt-dk", "--attn-seed", "3")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["attn-spec[[]attn_limited.py:limited[]]: checked up to 40 positions, float64, "
                                 "float32 and bfloat16 only (the limits it declares: nothing outside them was drawn)"])
    assert "attn-spec[attn_limited.py:attention]: checked" not in result.stdout.str()
