"""``attn-spec check`` end to end: exit codes, load errors, report formats, the JSON contract, a clean
working directory, and the Python API (``attn_spec.check``, ``attn_spec.reproduce``)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import attn_spec
from attn_spec.targets.conventions import ATTENTION_CONVENTIONS, CONVENTIONS
from attn_spec.cli import main
from attn_spec.errors import Failure, TargetLoadError

REPO = Path(__file__).resolve().parents[1]
SEED = str(REPO / "examples" / "seed_attention.py")
BUGGY = str(REPO / "examples" / "buggy_attention.py")
QUICK = ["--profile", "quick", "--seed", "5"]
USAGE_POINTER = "\nrun 'attn-spec check --help' for usage\n"

USER_FILE = Path(SEED).read_text(encoding="utf-8") + '''

THRESHOLD = 3


class AttentionAsClass:
    """A class whose constructor computes attention: detected as a module unless forced."""

    def __new__(cls, Q, K, V, mask=None):
        return attention(Q, K, V, mask)
'''

RAISING_FILE = '''\
import torch


def load_config():
    raise RuntimeError("config.yaml not found")


CONFIG = load_config()
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty current directory holding the user's files."""
    (tmp_path / "my_attention.py").write_text(USER_FILE)
    (tmp_path / "raises.py").write_text(RAISING_FILE)
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "broken.py").write_text(RAISING_FILE)
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    sys.modules.pop("userpkg", None)  # imported from this test's directory only


def cli(capsys, *argv):
    code = main(["check", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# -- exit codes ------------------------------------------------------------------------------------

def test_seed_function_and_module_conform_in_one_run(capsys):
    code, out, err = cli(capsys, f"{SEED}:attention", f"{SEED}:MultiHeadAttention", *QUICK,
                         "--only", "causal-mask", "head-concat-equivalence", "matches-reference")
    assert code == 0, out + err
    assert f"{SEED}:attention (function convention): CONFORMS" in out
    assert f"{SEED}:MultiHeadAttention (module convention): CONFORMS" in out


def test_buggy_attention_exits_1_naming_the_property(capsys):
    code, out, _ = cli(capsys, f"{BUGGY}:attention", *QUICK, "--only", "cross-attention-shapes", "scale-sqrt-dk")
    assert code == 1
    assert "DOES NOT CONFORM" in out and "✗ scale-sqrt-dk" in out and "1/d_k" in out
    assert "✗ cross-attention-shapes" not in out


def test_exitfirst_stops_at_the_first_failure_and_keeps_catalog_order(capsys):
    code, out, _ = cli(capsys, f"{BUGGY}:attention", *QUICK, "-x", "--format", "json")
    assert code == 1
    props = json.loads(out)["targets"][0]["properties"]
    attention = [i for i, p in attn_spec.properties.catalog().items() if set(p.conventions) & set(ATTENTION_CONVENTIONS)]
    assert [p["id"] for p in props] == attention  # catalog order (the mods' and serving kernels' properties left out)
    failed = [p for p in props if p["status"] == "fail"]
    not_run = [p for p in props if p["status"] == "not-run"]
    # matches-reference runs first: its first explicit example, one call, is the counterexample
    assert [p["id"] for p in failed] == ["matches-reference"] and failed[0]["found_after_calls"] == 1
    assert len(not_run) == len(props) - 1 and {p["message"] for p in not_run} == {"stopped at the first failure"}
    assert all(p["found_after_calls"] is None for p in not_run)


def test_found_after_calls_counts_from_the_start_of_the_check():
    report = attn_spec.check(attn_spec.targets.loading.load_target(f"{BUGGY}:attention"), profile="quick", seed=5,
                             only=["rows-sum-to-one", "scale-sqrt-dk", "matches-reference"])
    result = {p.id: p for p in report.targets[0].properties}
    assert result["rows-sum-to-one"].status == "pass" and result["rows-sum-to-one"].found_after_calls is None
    assert result["matches-reference"].found_after_calls == 1  # run first
    assert 1 < result["scale-sqrt-dk"].found_after_calls <= report.targets[0].calls


def test_found_after_calls_leaves_out_the_calls_that_word_the_cause():
    """cumulative_values fails on matches-reference's first example; no classic mistake explains it, so its cause
    probes whether the output follows Q, K and V (six more calls, once per target): not counted (it was 7)."""
    from gallery.core import cumulative_values

    report = attn_spec.check(cumulative_values, profile="quick", seed=1, only=["matches-reference"], diagnose=False)
    (result,) = report.targets[0].properties
    assert result.status == "fail" and result.found_after_calls == 1 and report.targets[0].calls > 7


# (TARGET and extra arguments, fragments the message must contain)
LOAD_ERRORS = {
    "missing file": (["nowhere.py:attention"], ["nowhere.py", "no file"]),
    "missing name": (["my_attention.py:attn"], ["'attn'", "my_attention.py", "AttentionAsClass, MultiHeadAttention, attention"]),
    "not callable": (["my_attention.py:THRESHOLD"], ["THRESHOLD", "not a function or class"]),
    "bad module path": (["no_such_pkg.attn:attention"], ["no_such_pkg"]),
    "no ':' in TARGET": (["my_attention.py"], ["'my_attention.py'", "path/to/file.py:name"]),
    "nothing after ':'": (["my_attention.py:"], ["'my_attention.py:'", "path/to/file.py:name"]),
}


@pytest.mark.parametrize("name", LOAD_ERRORS)
def test_usage_errors_exit_2_with_one_paragraph(name, workdir, capsys):
    argv, fragments = LOAD_ERRORS[name]
    code, out, err = cli(capsys, *argv, *QUICK)
    assert code == 2 and out == ""
    message = err.strip()
    assert message.startswith("attn-spec: ") and "\n\n" not in message and "Traceback" not in message, message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize("argv, message", [
    (["--only", "rows-sum-to-1"], "only=['rows-sum-to-1'] from the command line (--only): unknown property id(s): "
                                  "rows-sum-to-1 (did you mean 'rows-sum-to-one'?); known: rows-sum-to-one"),
    (["--only", "causal_mask", "xyzzy"], "only=['causal_mask', 'xyzzy'] from the command line (--only): "
                                         "unknown property id(s): causal_mask (did you mean 'causal-mask'?), xyzzy; "
                                         "known: "),
    (["--skip", "no-such-id"], "skip=['no-such-id'] from the command line (--skip): unknown property id(s): no-such-id"),
    (["--profile", "huge"], "profile='huge' from the command line (--profile): must be one of quick, default, thorough"),
    (["--seed", "x"], "seed='x' from the command line (--seed): must be an integer"),
], ids=["only", "only-two", "skip", "profile", "seed"])
def test_bad_settings_exit_2_in_checks_own_usage(argv, message, workdir, capsys):
    code, out, err = cli(capsys, "my_attention.py:attention", "--profile", "quick", *argv)
    assert code == 2 and out == ""
    assert err.startswith(f"attn-spec check: error: {message}") and USAGE_POINTER in err


def test_ambiguous_callable_exits_2(workdir, capsys):
    (workdir / "helpers.py").write_text("def scale(x):\n    return 2 * x\n")
    code, out, err = cli(capsys, "helpers.py:scale", *QUICK)
    assert code == 2 and out == ""
    assert "scale" in err and "--convention" in err and "Traceback" not in err


@pytest.mark.parametrize("target, user_file", [("raises.py:attention", "raises.py"),
                                               ("userpkg.broken:attention", os.path.join("userpkg", "broken.py"))])
def test_import_error_shows_the_users_traceback_only(target, user_file, workdir, capsys):
    code, out, err = cli(capsys, target, *QUICK)
    assert code == 2 and out == ""
    paragraph, _, trace = err.strip().partition("\n\n")
    assert "RuntimeError: config.yaml not found" in paragraph and target in paragraph
    path = str(workdir / user_file)
    assert f'File "{path}", line 5, in load_config' in trace  # the raise itself
    assert f'File "{path}", line 8, in <module>' in trace
    assert 'raise RuntimeError("config.yaml not found")' in trace
    frames = [line for line in trace.splitlines() if line.lstrip().startswith("File ")]
    assert frames and all(path in line for line in frames), trace  # none of the kit's or importlib's


# -- report formats and the JSON contract ----------------------------------------------------------

def _assert_contract(data: dict) -> None:
    """The public JSON shape CI scripts parse (extra keys are allowed)."""
    assert isinstance(data["kit_version"], str) and data["kit_version"] == attn_spec.__version__
    assert isinstance(data["targets"], list) and data["targets"]
    for target in data["targets"]:
        assert isinstance(target["target"], str)
        assert isinstance(target["convention"], str) and target["convention"] in CONVENTIONS
        assert isinstance(target["conforms"], bool)
        assert isinstance(target["properties"], list) and target["properties"]
        for p in target["properties"]:
            assert isinstance(p["id"], str)
            assert p["status"] in ("pass", "fail", "error", "skip", "not-run")
            assert isinstance(p["message"], str)
            assert p["counterexample"] is None or isinstance(p["counterexample"], dict)
            assert isinstance(p["examples"], int) and not isinstance(p["examples"], bool) and p["examples"] >= 0
            assert isinstance(p["seconds"], float) and p["seconds"] >= 0
        assert target["conforms"] == all(p["status"] in ("pass", "skip", "not-run") or p["expected"]
                                         for p in target["properties"])


def test_json_report_matches_the_public_contract(capsys):
    code, out, _ = cli(capsys, f"{BUGGY}:attention", f"{SEED}:MultiHeadAttention", *QUICK, "--format", "json",
                       "--only", "scale-sqrt-dk", "head-concat-equivalence")
    assert code == 1
    data = json.loads(out)
    _assert_contract(data)
    buggy, module = data["targets"]
    assert (buggy["target"], buggy["convention"], buggy["conforms"]) == (f"{BUGGY}:attention", "function", False)
    assert (module["convention"], module["conforms"]) == ("module", True)
    status = {p["id"]: p for p in buggy["properties"]}
    assert status["scale-sqrt-dk"]["status"] == "fail" and status["scale-sqrt-dk"]["counterexample"]
    assert status["head-concat-equivalence"]["status"] == "skip" and status["head-concat-equivalence"]["message"]
    assert {p["status"] for p in module["properties"]} == {"pass"}
    assert all(p["counterexample"] is None and p["examples"] > 0 for p in module["properties"])


def test_markdown_report(capsys):
    code, out, _ = cli(capsys, f"{BUGGY}:attention", *QUICK, "--format", "markdown", "--only", "scale-sqrt-dk")
    assert code == 1
    assert out.startswith("# Conformance report")
    assert "| property" in out and "|--" in out  # a GitHub table
    assert "### ✗ scale-sqrt-dk" in out and "```python\n" in out and "attn_spec.reproduce(" in out


def test_the_headers_reasons_are_printed_whole(capsys):
    """A capability's reason is a sentence: printed whole (issue 23.4), never cut with an ellipsis."""
    code, out, _ = cli(capsys, f"{BUGGY}:attention", *QUICK, "--only", "scale-sqrt-dk")
    line = next(x for x in out.splitlines() if x.startswith("capabilities: "))
    assert "gqa (no: attention(Q, K, V) raised RuntimeError: The size of tensor a (4) must match the size of tensor b " \
           "(2) at non-singleton dimension 0)" in line and "…" not in line


def test_list_conventions_says_that_a_serving_kernel_takes_no_mask(capsys):
    assert main(["list", "--conventions", "--format", "markdown"]) == 0
    rows = {row.split("|")[1].strip(): row for row in capsys.readouterr().out.splitlines() if row.startswith("| ")}
    assert all("no mask argument" in rows[name] for name in ("decode", "merge", "varlen"))
    assert "masks bool (declarable)" in rows["function"] and not any("masks ," in row for row in rows.values())


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_output_file_gets_the_report_and_stdout_stays_empty(fmt, tmp_path, capsys):
    path = tmp_path / "report.out"
    code, out, err = cli(capsys, f"{SEED}:attention", *QUICK, "--only", "cross-attention-shapes",
                         "--format", fmt, "--output", str(path))
    assert code == 0 and out == ""
    assert f"attn-spec: wrote the {fmt} report of 1 target(s) (conforms) to {path}" in err
    text = path.read_text()
    if fmt == "json":
        _assert_contract(json.loads(text))
    else:
        assert "CONFORMS" in text and "cross-attention-shapes" in text


@pytest.mark.parametrize("where, message", [
    ("missing/dir/r.json", "there is no folder"), (".", "is a folder; name a file in it")], ids=["missing", "folder"])
def test_an_output_that_cannot_be_written_is_a_usage_error_before_the_run(where, message, tmp_path, monkeypatch,
                                                                          capsys):
    """``--output /missing/dir/r.json`` used to crash with a FileNotFoundError after the whole run (exit 1)."""
    monkeypatch.setattr(attn_spec.api, "run", lambda *a, **k: pytest.fail("the run started"))
    code, out, err = cli(capsys, f"{SEED}:attention", *QUICK, "--output", str(tmp_path / where))
    assert code == 2 and out == "" and message in err and "Traceback" not in err, err
    assert err.startswith("attn-spec check: error: --output ") and USAGE_POINTER in err


def test_convention_can_be_forced(workdir, capsys):
    target = "my_attention.py:AttentionAsClass"
    code, out, err = cli(capsys, target, *QUICK, "--only", "cross-attention-shapes", "--format", "json")
    assert code == 2 and out == ""  # a class: detected as a module, which Cls(d_model, n_heads) cannot build
    assert "cannot follow the module convention" in err and "AttentionAsClass(Q, K, V, mask=None)" in err
    code, out, _ = cli(capsys, target, *QUICK, "--only", "cross-attention-shapes", "--format", "json",
                       "--convention", "function")
    result = json.loads(out)["targets"][0]
    assert code == 0 and (result["convention"], result["conforms"]) == ("function", True)
    code, out, err = cli(capsys, f"{SEED}:attention", *QUICK, "--only", "cross-attention-shapes",
                         "--convention", "module")  # a function of Q, K, V cannot be built as Cls(d_model, n_heads)
    assert code == 2 and out == "" and "calls Cls(d_model, n_heads); attention(Q, K, V, mask=None)" in err


TWO_PARAMETERS = "def attention(Q, K):\n    return Q\n\n\nclass Net:\n    def __init__(self, d_model, n_heads):\n" \
                 "        pass\n\n    def forward(self, x):\n        return x\n\n\ndef mod(b, h, q_idx):\n    return True\n"


@pytest.mark.parametrize("target, convention, shown, calls", [
    ("attention", "function", "attention(Q, K)", "attention(Q, K, V)"),
    ("attention", "sdpa", "attention(Q, K)", "fn(query, key, value"),
    ("attention", "hf", "attention(Q, K)", "fn(module, query, key, value, attention_mask"),
    ("attention", "score-mod", "attention(Q, K)", "score_mod(score, b, h, q_idx, kv_idx)"),
    ("mod", "mask-mod", "mod(b, h, q_idx)", "mask_mod(b, h, q_idx, kv_idx)"),
    ("Net", "module", "Net.forward(self, x)", "module(x_q, x_kv)"),
    ("mod", "torch-mha", "mod(b, h, q_idx)", "the factory as Cls(d_model, n_heads)"),
])
def test_a_signature_that_cannot_take_the_conventions_call_is_a_usage_error(target, convention, shown, calls,
                                                                            workdir, capsys):
    """``--convention function`` on a function of two parameters: exit 2 before any call, the signature and the
    convention's call side by side (it used to run every property and root a TypeError in the kit's frame)."""
    (workdir / "two.py").write_text(TWO_PARAMETERS)
    code, out, err = cli(capsys, f"two.py:{target}", "--convention", convention, *QUICK)
    assert code == 2 and out == "", out
    assert f"{convention} convention calls" in err and calls in err and shown in err, err
    assert "Traceback" not in err and "base.py" not in err


@pytest.mark.parametrize("command", [["check"], [], ["grade"], ["config"]], ids=["check", "top", "grade", "config"])
def test_help_has_examples_a_wheel_user_can_run(command, capsys):
    """A wheel has no examples/ folder: the examples name the user's own file or importable targets."""
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "Examples:" in out
    assert "examples/" not in out
    if command in (["check"], []):
        assert "attn_spec.reference:reference_attention" in out


def test_a_usage_error_says_what_is_wrong_first(workdir, capsys):
    code, out, err = cli(capsys, "my_attention.py:attention", "--profile", "huge")
    assert code == 2 and out == ""
    first, pointer = err.splitlines()
    assert first.startswith("attn-spec check: error: profile='huge' from the command line (--profile)")
    assert pointer == "run 'attn-spec check --help' for usage"


# -- real processes: python -m attn_spec and the console script ---------------------------------------

def _run_clean(command, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("HYPOTHESIS_STORAGE_DIRECTORY", "PYTHONDONTWRITEBYTECODE")}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("command, target", [
    ([sys.executable, "-m", "attn_spec"], "my_attention.py:attention"),
    ([str(Path(sys.executable).with_name("attn-spec"))], "my_attention:attention"),  # a module of the cwd
], ids=["python -m attn_spec", "attn-spec script"])
def test_command_leaves_no_files_behind(command, target, tmp_path):
    (tmp_path / "my_attention.py").write_text(USER_FILE)
    done = _run_clean(command + ["check", target, *QUICK, "--only", "rows-sum-to-one", "cross-attention-shapes"],
                      tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "CONFORMS" in done.stdout
    assert sorted(os.listdir(tmp_path)) == ["my_attention.py"]  # no .hypothesis/, no __pycache__/


# -- the Python API --------------------------------------------------------------------------------

def _load(path, name):
    from attn_spec.targets.loading import load_target

    return load_target(f"{path}:{name}")


def test_python_api_report():
    good = attn_spec.check(_load(SEED, "attention"), profile="quick", seed=5, only=["cross-attention-shapes"])
    assert good.conforms is True
    assert good.to_dict()["targets"][0]["properties"][0]["status"] == "pass"
    _assert_contract(good.to_dict())
    bad = attn_spec.check(_load(BUGGY, "attention"), profile="quick", seed=5, only=["scale-sqrt-dk"])
    assert bad.conforms is False
    text = str(bad)
    assert "attention (function convention): DOES NOT CONFORM" in text
    assert "✗ scale-sqrt-dk" in text and "likely cause:" in text and "reproduce:" in text


def test_reproduction_snippet_reproduces_the_failure(monkeypatch, capsys):
    monkeypatch.chdir(REPO)
    code, out, _ = cli(capsys, "examples/buggy_attention.py:attention", *QUICK, "--only", "scale-sqrt-dk",
                       "--format", "json")
    assert code == 1
    snippet = json.loads(out)["targets"][0]["properties"][0]["counterexample"]["reproduce"]
    with pytest.raises(Failure, match="scale-sqrt-dk"):
        exec(snippet, {})


def test_reproduction_snippet_from_the_python_api():
    report = attn_spec.check(_load(BUGGY, "attention"), profile="quick", seed=5, only=["scale-sqrt-dk"])
    snippet = report.targets[0].properties[0].counterexample["reproduce"]
    with pytest.raises(Failure, match="scale-sqrt-dk"):
        exec(snippet, {})


def test_reproduce_says_when_the_property_holds(capsys):
    from attn_spec.checking.cases import Case

    attn_spec.reproduce("scale-sqrt-dk", f"{SEED}:attention", Case(n_q=1, d_k=16, d_v=1))
    assert "scale-sqrt-dk holds on" in capsys.readouterr().out
