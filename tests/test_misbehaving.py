"""Targets that misbehave towards the kit (tests/gallery/misbehaving.py): each gets a clear verdict,
and a correct target checked in the same run gets exactly the report it gets alone. Also: a bug of
the kit's own is an error row, a real Ctrl-C still stops the run, stdout formats stay parseable
whatever the target prints, and JSON is strict."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

import attn_spec
from attn_spec.checking import runner
from attn_spec.properties import catalog
from attn_spec.cli import main
from gallery import misbehaving as mb
from gallery.core import seed_function

RUN = dict(profile="quick", seed=20261129)


def _essence(target_report):
    """Everything about a target's report except timings."""
    data = target_report.to_dict()
    for p in data["properties"]:
        del p["seconds"]
    return data


@pytest.fixture(scope="module")
def together():
    """One multi-target run: every misbehaving target, then a correct one."""
    cwd, dtype = os.getcwd(), torch.get_default_dtype()
    report = attn_spec.check(*mb.MISBEHAVING, seed_function, **RUN)
    assert os.getcwd() == cwd and torch.get_default_dtype() == dtype and torch.is_grad_enabled()
    return {t.target.rsplit(":", 1)[-1]: t for t in report.targets}


@pytest.mark.slow
def test_a_correct_target_gets_the_same_report_alone_and_after_every_misbehaving_one(together):
    alone = attn_spec.check(seed_function, **RUN).targets[0]
    after = together["seed_function"]
    assert alone.conforms and after.conforms
    assert _essence(after) == _essence(alone)
    assert after.state_changes == [] and after.output == {} and all(p.output is None for p in after.properties)


def _failures(report):
    return {p.id: p for p in report.properties if p.status == "fail"}


@pytest.mark.slow
def test_an_exception_in_the_backward_is_the_targets_with_its_traceback(together):
    report = together["raises_in_backward"]
    (failed,) = _failures(report).values()
    assert failed.id == "gradients" and failed.status == "fail"
    assert "the backward of" in failed.message and "raised RuntimeError: backward kernel not built" in failed.message
    trace = failed.counterexample["traceback"]
    assert "misbehaving.py" in trace and "in backward" in trace and "attn_spec" not in trace
    assert report.capabilities["autograd"] == "raises"


@pytest.mark.parametrize("name, raised", [("raises_system_exit", "SystemExit: 3"),
                                          ("raises_base_exception", "Abort: stop everything"),
                                          ("raises_keyboard_interrupt", "KeyboardInterrupt"),
                                          ("raises_generator_exit", "GeneratorExit"),
                                          ("returns_generator", "the output: a generator, expected a torch.Tensor")])
def test_base_exceptions_and_generators_are_failures_of_the_target(together, name, raised):
    report = together[name]
    assert not report.conforms
    failed = _failures(report)
    assert failed and all(p.status != "error" for p in report.properties)
    assert all(raised in p.message for p in failed.values()), [p.message for p in failed.values()]
    assert report.capabilities["mask"] == "raises"


@pytest.mark.parametrize("name, state, change", [
    ("leaves_grad_mode_off", "grad mode", "left off"),
    ("changes_default_dtype", "default dtype", "set to torch.float64"),
    ("changes_everything", "global RNG seed", "reseeded (torch.manual_seed(1234))"),
    ("changes_everything", "float32 matmul precision", "set to medium"),
    ("changes_everything", "torch.backends.mkldnn.enabled", "turned off"),
    ("changes_everything", "default device", "set to meta"),
    ("changes_everything", "working directory", "set to"),
])
def test_global_state_is_restored_and_reported(together, name, state, change):
    report = together[name]
    assert report.conforms, str(report)
    changes = {c["state"]: c for c in report.state_changes}
    assert changes[state]["change"].startswith(change) and changes[state]["during"].startswith("attention(Q, K, V")
    assert f"{state} {change}" in "\n".join(attn_spec.report.text.header_lines(report))


def test_prints_are_captured_and_summarised(together):
    report = together["prints_megabytes"]
    assert report.conforms
    stdout = [p.output["stdout"] for p in report.properties if p.output]
    assert sum(found["chars"] for found in stdout) > 2_000_000  # megabytes, none of it printed
    assert all(found["first"].startswith("chatty attention: ...") and "all" not in found for found in stdout)
    assert report.output["header probes"]["stderr"]["first"] == "and on stderr"


def test_warnings_and_log_records_are_counted_per_property(together):
    report = together["warns_every_call"]
    assert report.conforms
    ref = next(p for p in report.properties if p.id == "matches-reference")
    assert ref.output["warnings"]["count"] == ref.examples  # one call per example, one warning per call
    assert ref.output["warnings"]["first"].startswith("UserWarning: attention: falling back to the slow path (")
    # the first record is the first example's: the heads case [2, 3, 3, 2] runs first (the most bugs caught first)
    assert ref.output["logging"] == {"count": ref.examples,
                                     "first": "WARNING chatty.attention: slow path for shape (2, 3, 3, 2)"}


def test_verbose_keeps_all_of_it_and_the_text_report_shows_it():
    report = attn_spec.check(mb.warns_every_call, only=["matches-reference"], verbose=True, **RUN)
    found = report.targets[0].properties[0].output["warnings"]
    assert found["all"] == [{"text": found["first"], "count": found["count"]}]
    text = str(report)
    assert "output of the target (captured):" in text and f"(x{found['count']})" in text
    quiet = str(attn_spec.check(mb.warns_every_call, only=["matches-reference"], **RUN))
    assert "warnings: " in quiet and "first, in layout probe: 'UserWarning: attention: falling back" in quiet


def test_a_bug_of_the_kits_own_is_an_error_row_and_the_rest_still_run(monkeypatch):
    def broken(target, case):
        return {}["kit bug"]

    monkeypatch.setitem(catalog(), "rows-sum-to-one", dataclasses.replace(catalog()["rows-sum-to-one"], fn=broken))
    monkeypatch.setattr(runner, "probe_behaviours", lambda *a: 1 / 0)
    report = attn_spec.check(seed_function, only=["rows-sum-to-one", "scale-sqrt-dk"], **RUN).targets[0]
    rows = {p.id: p for p in report.properties}
    assert rows["rows-sum-to-one"].status == "error" and "KeyError: 'kit bug'" in rows["rows-sum-to-one"].message
    assert "Traceback" in rows["rows-sum-to-one"].message
    assert rows["scale-sqrt-dk"].status == "pass"
    assert rows["probe:behaviours"].status == "error" and "ZeroDivisionError" in rows["probe:behaviours"].message
    assert report.capabilities["mask"] == "yes"  # the other probe still ran


def test_the_users_ctrl_c_still_stops_the_run():
    def presses_ctrl_c(Q, K, V, mask=None):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)  # the signal arrives long before
        return seed_function(Q, K, V, mask)

    with pytest.raises(KeyboardInterrupt):
        attn_spec.check(presses_ctrl_c, only=["matches-reference"], **RUN)


def test_the_backward_of_a_reentrant_checkpoint_is_differentiated():
    from gallery.robustness import reentrant_checkpoint

    report = attn_spec.check(reentrant_checkpoint, only=["gradients"], **RUN).targets[0]
    assert report.conforms and report.properties[0].examples > 1


# -- the command line: stdout formats stay parseable ------------------------------------------------

CHATTY_FILE = '''\
import logging, math, sys, warnings
import torch

logging.basicConfig(level=logging.INFO)  # a handler on the real stderr
for i in range(2000):
    print(f"loading {i}", "#" * 500)


def attention(Q, K, V, mask=None):
    print("called with", tuple(Q.shape), "#" * 20000)
    print("to stderr too", file=sys.stderr)
    warnings.warn("slow path")
    logging.getLogger("chatty").info("info record")
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V


def returns_nan(Q, K, V, mask=None):
    return torch.full(Q.shape[:-1] + V.shape[-1:], float("nan"), dtype=Q.dtype)


from attn_spec.module_adapters import ModuleAdapter


class BrokenAdapter(ModuleAdapter):
    def __init__(self):
        raise SystemExit("no weights file")
'''


def _strict(text: str):
    def reject(token):
        raise AssertionError(f"non-RFC 8259 token {token}")
    return json.loads(text, parse_constant=reject)


@pytest.fixture
def chatty(tmp_path):
    (tmp_path / "chatty.py").write_text(CHATTY_FILE)
    return tmp_path


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["json", "junit", "markdown"])
def test_stdout_formats_stay_parseable_however_chatty_the_target(chatty, fmt):
    done = subprocess.run([sys.executable, "-m", "attn_spec", "check", "chatty.py:attention", "chatty.py:returns_nan",
                           "--profile", "quick", "--seed", "3", "--only", "matches-reference", "gradients",
                           "--format", fmt], cwd=chatty, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout.count("#" * 500) <= 1 and "loading 1 " not in done.stdout
    if fmt == "json":
        data = _strict(done.stdout)
        chatty_report, nan_report = data["targets"]
        assert chatty_report["conforms"] and chatty_report["output"]["import"]["stdout"]["count"] == 2000
        ref = chatty_report["properties"][0]
        assert ref["output"]["stdout"]["count"] == ref["examples"] and ref["output"]["warnings"]["count"] == ref["examples"]
        got = nan_report["properties"][0]["counterexample"]["got"]
        assert got[0][0] == "NaN"
    elif fmt == "junit":
        ET.fromstring(done.stdout)
    else:
        assert done.stdout.startswith("# Conformance report") and "stdout: " in done.stdout


def test_strict_json_writes_non_finite_numbers_as_strings():
    report = attn_spec.check(lambda Q, K, V, mask=None: Q[..., :1].expand(*Q.shape[:-1], V.shape[-1]) * float("inf"),
                             name="infinite", only=["matches-reference"], **RUN)
    text = report.to_json()
    data = _strict(text)
    values = {x for row in data["targets"][0]["properties"][0]["counterexample"]["got"] for x in row}
    assert values <= {"Infinity", "-Infinity", "NaN"} and values
    assert report.to_dict()["targets"][0]["properties"][0]["counterexample"]["got"][0][0] in (float("inf"), -float("inf"))


def test_a_target_that_cannot_be_loaded_does_not_stop_the_others(chatty, capsys, monkeypatch):
    monkeypatch.chdir(chatty)
    code = main(["check", "chatty.py:BrokenAdapter", "missing.py:attention", f"{Path(mb.__file__).parent / 'core.py'}:seed_function",
                 "--profile", "quick", "--seed", "3", "--only", "cross-attention-shapes",
                 "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 2
    data = _strict(out)
    assert [t["target"] for t in data["not_loaded"]] == ["chatty.py:BrokenAdapter", "missing.py:attention"]
    assert len(data["targets"]) == 1 and not data["conforms"]
    assert "Cannot use target 'chatty.py:BrokenAdapter'" in err and "raised SystemExit: no weights file" in err
    assert "no file 'missing.py'" in err


def test_inference_only_flag(chatty, capsys, monkeypatch):
    monkeypatch.chdir(chatty)
    (chatty / "detached.py").write_text("import torch.nn.functional as F\n\ndef attention(Q, K, V, mask=None):\n"
                                        "    return F.scaled_dot_product_attention(Q, K, V, mask).detach()\n")
    args = ["check", "detached.py:attention", "--profile", "quick", "--seed", "3", "--only", "gradients"]
    assert main(args) == 1
    assert "it leaves the autograd graph through .detach()" in capsys.readouterr().out
    assert main([*args, "--inference-only"]) == 1  # gradients alone, skipped: nothing was checked
    assert "NOTHING CHECKED" in capsys.readouterr().out
    assert main([*args, "rows-sum-to-one", "--inference-only"]) == 0
    out = capsys.readouterr().out
    assert "skipped gradients: not checked: declared an inference kernel" in out and "declared: an inference kernel" in out
