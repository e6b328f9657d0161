"""A target that hangs does not hang the kit (attn_spec.targets.deadline): a call past its deadline fails its
property and the check goes on; one that swallows the interrupt still ends; one that cannot be interrupted
ends the process with exit status 3 and says what hung; an import that never ends cannot be loaded. The
deadline scales with the case and comes from every source of settings; progress shows only on a terminal.

The hanging targets run in a subprocess (as a user runs the CLI), with a short --call-timeout."""
from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pytest

from attn_spec.checking.cases import Case
from attn_spec.cli import EXIT_HUNG, main
from attn_spec.settings import SETTINGS
from attn_spec.targets import deadline

TARGETS = (Path(__file__).resolve().parents[1] / "examples" / "seed_attention.py").read_text(encoding="utf-8") + '''

import signal
import threading
import time


def spins(Q, K, V, mask=None):
    while True:
        pass


def swallows(Q, K, V, mask=None):
    """Catches the kit's interrupt, whatever it is, and goes on looping."""
    while True:
        try:
            time.sleep(0.01)
        except BaseException:
            pass


def ignores_the_alarm(Q, K, V, mask=None):
    """No signal reaches it: as a call stuck in native code."""
    signal.signal(signal.SIGALRM, signal.SIG_IGN)
    while True:
        pass


def slow_on_long_cases(Q, K, V, mask=None):
    """1.5 s at 4096 keys, beyond a 0.5 s deadline for a small case but within its scaled one; instant below."""
    if K.size(-2) >= 4096:
        time.sleep(1.5)
    return attention(Q, K, V, mask)


class _SpinsBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        while True:
            pass


def spins_in_backward(Q, K, V, mask=None):
    return _SpinsBackward.apply(attention(Q, K, V, mask))


class SpinsWhenBuilt(torch.nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        while True:
            pass


_compiled = []


def compiled(Q, K, V, mask=None):
    """torch.compile'd on its first call: Dynamo's import and tracing take longer than a 1 s deadline here."""
    if not _compiled:
        _compiled.append(torch.compile(attention, backend="eager"))
    return _compiled[0](Q, K, V, mask)


def slow(Q, K, V, mask=None):
    """A check of it takes more than the 2 s after which progress shows."""
    time.sleep(0.1)
    return attention(Q, K, V, mask)


def in_a_thread():
    """attn_spec.check called outside the main thread: no signals there, the watchdog alone."""
    import attn_spec

    threading.Thread(target=lambda: attn_spec.check(spins, profile="quick", only=["rows-sum-to-one"],
                                                     call_timeout=0.3)).start()
'''


@pytest.fixture
def targets(tmp_path):
    (tmp_path / "targets.py").write_text(TARGETS)
    (tmp_path / "hangs_at_import.py").write_text("def attention(Q, K, V, mask=None):\n    return V\n\n\n"
                                                 "while True:\n    pass\n")
    return tmp_path


def cli(folder, *args, stderr=subprocess.PIPE, timeout=300):
    return subprocess.run([sys.executable, "-m", "attn_spec", "check", *args], cwd=folder, stdout=subprocess.PIPE,
                          stderr=stderr, text=True, timeout=timeout)


QUICK = ["--profile", "quick", "--seed", "1", "--call-timeout", "0.5"]


@pytest.mark.slow
def test_a_hanging_function_fails_its_properties_and_the_check_finishes_with_its_report(targets):
    run = cli(targets, "targets.py:spins", "targets.py:attention", "--only", "rows-sum-to-one", "matches-reference",
              *QUICK, "--format", "json")
    assert run.returncode == 1, run.stderr
    spins, correct = json.loads(run.stdout)["targets"]
    for p in spins["properties"]:
        assert p["status"] == "fail", p
        line = TARGETS.splitlines().index("def spins(Q, K, V, mask=None):") + 2  # its `while True:`
        assert f"did not return within 0.5 s (stopped at targets.py:{line} in spins)" in p["message"]
        assert p["counterexample"]["summary"].startswith("Q [") and "spins" in p["counterexample"]["traceback"]
    assert "did not return within 0.5 s" in spins["lacks"]["unmasked"]  # a header probe that hung moved on too
    assert correct["conforms"] and not spins["conforms"]  # the run went on to the next target


@pytest.mark.slow
def test_the_backward_and_a_modules_construction_have_deadlines_too(targets):
    run = cli(targets, "targets.py:spins_in_backward", "targets.py:SpinsWhenBuilt", "--only", "gradients", *QUICK,
              "--format", "json")
    assert run.returncode == 1, run.stderr
    backward, module = (t["properties"][0] for t in json.loads(run.stdout)["targets"])
    assert backward["status"] == module["status"] == "fail"
    assert backward["message"].startswith("the backward of targets.py:spins_in_backward(Q, K, V")
    assert "did not return within 0.5 s (stopped at targets.py:" in backward["message"]
    assert module["message"].startswith("targets.py:SpinsWhenBuilt(") and "in __init__)" in module["message"]


@pytest.mark.slow
def test_a_target_that_swallows_the_interrupt_still_fails_and_the_check_ends(targets):
    run = cli(targets, "targets.py:swallows", "--only", "rows-sum-to-one", *QUICK)
    assert run.returncode == 1, run.stderr
    assert "rows-sum-to-one" in run.stdout and "did not return within 0.5 s (stopped at targets.py:" in run.stdout


def test_a_call_that_cannot_be_interrupted_ends_the_process_saying_what_hung(targets):
    run = cli(targets, "targets.py:ignores_the_alarm", "--only", "rows-sum-to-one", *QUICK)
    assert run.returncode == EXIT_HUNG == 3
    assert "attention(Q, K, V" in run.stderr and "did not return within 0.5 s" in run.stderr
    assert "could not be interrupted" in run.stderr and f"exit status {EXIT_HUNG}" in run.stderr


def test_outside_the_main_thread_the_watchdog_ends_a_hang(targets):
    run = subprocess.run([sys.executable, "-c", "import targets; targets.in_a_thread()"], cwd=targets, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=300)
    assert run.returncode == EXIT_HUNG
    assert "spins" in run.stderr or "attention(Q, K, V" in run.stderr
    assert "did not return within 0.3 s" in run.stderr


@pytest.mark.slow
def test_an_import_that_never_ends_is_a_target_that_cannot_be_loaded(targets):
    run = cli(targets, "hangs_at_import.py:attention", "targets.py:attention", "--only", "rows-sum-to-one", *QUICK)
    assert run.returncode == 2  # as any target that cannot be loaded; the other one is still checked
    assert "Cannot load target 'hangs_at_import.py:attention': importing it did not finish within 3 s" in run.stderr
    assert "hangs_at_import.py" in run.stderr and "while True" in run.stderr
    assert "targets.py:attention (function convention): CONFORMS" in run.stdout


def test_the_deadline_scales_with_the_case(targets):
    with deadline.timeout(0.5):
        assert deadline.seconds_now() == 0.5  # the header's probes: a small case
        with deadline.on_case(Case(batch=(2, 3), n_q=130, n_kv=130, d_k=256, d_v=256)):  # the default's largest
            assert deadline.seconds_now() == 0.5
        with deadline.on_case(Case(batch=(1, 1), n_q=4096, n_kv=4096, d_k=32, d_v=32)):
            assert deadline.seconds_now() == 0.5 * 4096 * 4096 * 64 / deadline.SMALL_WORK == 4.0
        with deadline.timeout(0):
            assert deadline.seconds_now() == 0
    assert f"an import {deadline.IMPORT_FACTOR} times as long" in SETTINGS["call-timeout"].help  # as the help says


@pytest.mark.slow
def test_a_target_slow_only_on_long_cases_is_not_failed_on_them(targets):
    run = cli(targets, "targets.py:slow_on_long_cases", "--shapes", "1,1,4096,32", "--only", "matches-reference",
              "--dtypes", "float32", "--seed", "1", "--call-timeout", "0.5")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "CONFORMS" in run.stdout


@pytest.mark.slow
def test_a_call_that_is_compiling_is_not_hanging(targets):
    run = cli(targets, "targets.py:compiled", "--only", "rows-sum-to-one", "--profile", "quick", "--seed", "1",
              "--call-timeout", "1")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "CONFORMS" in run.stdout


def _on_a_terminal(folder, *args) -> str:
    """What ``attn-spec check`` writes to stderr when stderr is a terminal (stdout a pipe)."""
    main_fd, terminal = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "attn_spec", "check", *args], cwd=folder, stdout=subprocess.PIPE,
                            stderr=terminal, text=True)
    os.close(terminal)
    seen = b""
    while True:
        if select.select([main_fd], [], [], 1)[0]:
            try:
                chunk = os.read(main_fd, 1 << 16)
            except OSError:  # the terminal closed: the process ended
                break
            if not chunk:
                break
            seen += chunk
        elif proc.poll() is not None:
            break
    proc.communicate(timeout=300)
    os.close(main_fd)
    return seen.decode("utf-8", "replace")


@pytest.mark.slow
def test_progress_shows_on_a_terminal_only_and_not_with_json(targets):
    args = ("targets.py:slow", "--only", "rows-sum-to-one", "--profile", "quick", "--seed", "1")
    shown = _on_a_terminal(targets, *args)
    assert "\r\x1b[Ktargets.py:slow: " in shown and ", case " in shown  # which target, property, case
    assert shown.endswith("\r\x1b[K")  # cleared at the end
    assert "\r" not in cli(targets, *args).stderr  # not a terminal: a CI log
    assert "\r" not in _on_a_terminal(targets, *args, "--format", "json")


def test_the_deadline_comes_from_every_source(targets, monkeypatch, capsys):
    monkeypatch.chdir(targets)
    for name in [k for k in os.environ if k.startswith("ATTN_SPEC_")]:
        monkeypatch.delenv(name)

    def setting(*argv):
        assert main(["config", "--format", "json", *argv]) == 0
        got = json.loads(capsys.readouterr().out)["settings"]["call-timeout"]
        return got["value"], got["source"]

    assert setting() == (10.0, "default")
    (targets / "pyproject.toml").write_text("[tool.attn-spec]\ncall-timeout = 30\n")
    assert setting() == (30.0, "pyproject.toml [tool.attn-spec]")
    monkeypatch.setenv("ATTN_SPEC_CALL_TIMEOUT", "none")
    assert setting() == (0.0, "environment ATTN_SPEC_CALL_TIMEOUT")
    assert setting("--call-timeout", "2.5") == (2.5, "the command line (--call-timeout)")
    assert main(["config", "--call-timeout", "soon"]) == 2
    assert "call-timeout='soon' from the command line (--call-timeout): must be a number of seconds" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_the_api_and_the_plugin_take_the_deadline(targets, monkeypatch):
    import attn_spec

    monkeypatch.syspath_prepend(str(targets))
    import targets as module

    report = attn_spec.check(module.spins, profile="quick", seed=1, only=["rows-sum-to-one"], call_timeout=0.3)
    (result,) = report.targets[0].properties
    assert result.status == "fail" and "did not return within 0.3 s" in result.message
    pytest_run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--attn-target",
                                 "targets.py:spins", "--attn-only", "rows-sum-to-one", "--attn-profile", "quick",
                                 "--attn-call-timeout", "0.3"], cwd=targets, text=True, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, timeout=300)
    assert pytest_run.returncode == 1, pytest_run.stdout
    assert "did not return within 0.3 s" in pytest_run.stdout
