"""The CI gate: JUnit XML, markdown, GitHub annotations, expectations files, dtype/device selection."""
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

import attn_spec.properties
from attn_spec.cli import main
from attn_spec.targets.conventions import ATTENTION_CONVENTIONS

ROOT = Path(__file__).resolve().parents[1]
BUGGY = str(ROOT / "examples" / "buggy_attention.py") + ":attention"
SEED = str(ROOT / "examples" / "seed_attention.py") + ":attention"
QUICK = ["--profile", "quick", "--seed", "5"]
ONLY = ["--only", "rows-sum-to-one", "scale-sqrt-dk", "matches-reference", "head-concat-equivalence"]


def test_junit_has_one_testcase_per_property(capsys):
    assert main(["check", BUGGY, *QUICK, *ONLY, "--format", "junit"]) == 1
    root = ET.fromstring(capsys.readouterr().out)
    assert root.tag == "testsuites"
    (suite,) = root.findall("testsuite")
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == {"rows-sum-to-one", "scale-sqrt-dk", "matches-reference", "head-concat-equivalence"}
    assert all(c.get("classname") and float(c.get("time")) >= 0 for c in cases.values())
    failure = cases["scale-sqrt-dk"].find("failure")
    assert failure is not None and "1/d_k" in failure.get("message") and "reproduce" in failure.text
    assert cases["head-concat-equivalence"].find("skipped") is not None
    assert cases["rows-sum-to-one"].find("failure") is None and cases["rows-sum-to-one"].find("skipped") is None
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped"), suite.get("errors")) == ("4", "2", "1", "0")


def test_markdown_is_a_step_summary(capsys):
    assert main(["check", BUGGY, *QUICK, *ONLY, "--format", "markdown"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("# Conformance report") and "| property" in out and "```python" in out


def test_github_annotations_only_under_actions(capsys, monkeypatch):
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    main(["check", BUGGY, *QUICK, *ONLY])
    assert "::error" not in capsys.readouterr().out
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    main(["check", BUGGY, *QUICK, *ONLY])
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("::error")]
    assert len(errors) == 2 and any("scale-sqrt-dk" in e for e in errors)
    assert all("\n" not in e for e in errors)


def test_expectations_file(tmp_path, capsys):
    expect = tmp_path / "known.txt"
    expect.write_text("# known failures of the buggy example\n"
                      "scale-sqrt-dk      # divides by d_k\n"
                      "matches-reference  # follows from it\n"
                      "rows-sum-to-one    # passes: a stale line\n"
                      "no-such-id         # a typo\n")
    code = main(["check", BUGGY, *QUICK, *ONLY, "--expect", str(expect), "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["conforms"] is True
    expected = {p["id"]: p["expected"] for p in report["targets"][0]["properties"]}
    assert expected["scale-sqrt-dk"] and expected["matches-reference"] and not expected["rows-sum-to-one"]
    assert any("'no-such-id' matches no property" in w for w in report["warnings"])
    assert any("rows-sum-to-one now passes" in w for w in report["warnings"])
    # without the file the same run fails
    assert main(["check", BUGGY, *QUICK, *ONLY]) == 1


def test_expected_failures_are_in_every_verdict(tmp_path, capsys, monkeypatch):
    """Never a bare CONFORMS when the expectations file hides failures: text, markdown, JUnit, annotations."""
    expect = tmp_path / "known.txt"
    expect.write_text("scale-sqrt-dk      # divides by d_k\nmatches-reference  # follows from it\n")
    verdict = "CONFORMS (2 expected failures: scale-sqrt-dk, matches-reference)"
    argv = ["check", BUGGY, *QUICK, *ONLY, "--expect", str(expect)]
    assert main(argv) == 0
    assert f"{BUGGY} (function convention): {verdict}" in capsys.readouterr().out
    assert main([*argv, "--format", "markdown"]) == 0
    assert f"## {BUGGY} (function convention): {verdict}" in capsys.readouterr().out
    assert main([*argv, "--format", "junit"]) == 0
    (suite,) = ET.fromstring(capsys.readouterr().out).findall("testsuite")
    assert {p.get("name"): p.get("value") for p in suite.iter("property")}["verdict"] == verdict
    skipped = [c.find("skipped").get("message") for c in suite.findall("testcase") if c.get("name") == "scale-sqrt-dk"]
    assert skipped[0].startswith(f"expected failure (listed in {expect}): ")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert main(argv) == 0
    assert f"::notice title=attn-spec: {BUGGY}::{verdict}" in capsys.readouterr().out.splitlines()


def test_exitfirst_reports_what_it_did_not_run_in_one_line(tmp_path, capsys):
    assert main(["check", BUGGY, *QUICK, "-x"]) == 1
    out = capsys.readouterr().out
    not_run = sum(bool(set(p.conventions) & set(ATTENTION_CONVENTIONS)) for p in attn_spec.properties.catalog().values()) - 1
    assert "DOES NOT CONFORM (1 of 1 properties fail)" in out
    assert f"  {not_run} not run: stopped at the first failure\n" in out
    assert "skipped" not in out and "rows-sum-to-one" not in out  # no row, no note for what did not run


def test_exitfirst_passes_over_expected_failures(tmp_path, capsys):
    expect = tmp_path / "known.txt"
    expect.write_text("matches-reference\n")
    assert main(["check", BUGGY, *QUICK, *ONLY, "-x", "--expect", str(expect), "--format", "json"]) == 1
    status = {p["id"]: p["status"] for p in json.loads(capsys.readouterr().out)["targets"][0]["properties"]}
    # matches-reference runs first and fails as expected; -x stops at the next failure, scale-sqrt-dk
    assert status == {"rows-sum-to-one": "pass", "scale-sqrt-dk": "fail", "matches-reference": "fail",
                      "head-concat-equivalence": "not-run"}


def test_a_multi_target_run_ends_with_its_summary(capsys):
    assert main(["check", BUGGY, SEED, *QUICK, *ONLY]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == ("2 targets: 1 conforms, 1 does not · 2 failures, 0 expected failures, "
                                             "2 skips · seed 5 (--seed 5 reruns these cases)")
    assert main(["check", SEED, *QUICK, *ONLY]) == 0
    assert "reruns these cases" not in capsys.readouterr().out  # one target: its verdict says it all


def test_missing_expectations_file_is_a_usage_error(tmp_path, capsys):
    assert main(["check", SEED, *QUICK, "--expect", str(tmp_path / "nope.txt")]) == 2
    assert f"expect='{tmp_path / 'nope.txt'}' from the command line (--expect): cannot read" in capsys.readouterr().err


def test_dtypes_and_device_restrict_the_run(capsys):
    code = main(["check", SEED, *QUICK, "--only", "matches-reference", "--dtypes", "float32", "--device", "cpu",
                 "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0 and report["dtypes"] == ["float32"] and report["devices"] == ["cpu"]
    ce_free = report["targets"][0]["properties"][0]
    assert ce_free["status"] == "pass"


def test_unavailable_device_is_a_usage_error(capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert main(["check", SEED, *QUICK, "--device", "cuda"]) == 2
    assert "only cpu" in capsys.readouterr().err


@pytest.mark.slow
def test_reports_command_still_runs(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "reports" / "generate.py"), "--profile", "quick",
                           "--out", str(tmp_path), "--only", "reference", "torch-sdpa", "buggy-scale"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    index = (tmp_path / "README.md").read_text()
    assert "reference" in index and "does not conform" in index  # the buggy example
    assert (tmp_path / "torch-sdpa.md").read_text().startswith("# Conformance report")


def test_terminal_colour_marks_only_the_differing_cells():
    import attn_spec
    from attn_spec.targets.loading import load_target
    from attn_spec.report import render
    from attn_spec.report.matrices import RED

    report = attn_spec.check(load_target(BUGGY), profile="quick", seed=5, only=["scale-sqrt-dk"])
    coloured, plain = render(report, "text", colour=True), render(report, "text")
    assert RED in coloured and RED not in plain and RED not in report.to_markdown()
    # the probe's two weights both differ from sigmoid(1): both cells of "got" are marked
    got_line = next(line for line in coloured.splitlines() if "0.2689" in line)  # expected: 1 - sigmoid(1)
    assert got_line.count(RED) == 4  # two cells of got, two of expected
    assert plain.replace(" ", "") == coloured.replace(RED, "").replace("\033[0m", "").replace(" ", "")


SAMPLE = ROOT / "examples" / "ci-gate"


@pytest.fixture
def sample(tmp_path):
    """A copy of the sample project, so the runs leave nothing in the repository."""
    shutil.copytree(SAMPLE, tmp_path / "ci-gate")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATTN_SPEC_", "PYTEST_", "GITHUB_"))}
    return tmp_path / "ci-gate", env


@pytest.mark.slow
def test_the_sample_project_passes_at_the_profile_it_configures(sample):
    """`attn-spec check`, no arguments, as shipped: the two targets of its [tool.attn-spec], at its own profile
    and seed (issue 27: it must pass as CI runs it, not only at the quick profile)."""
    folder, env = sample
    configured = tomllib.loads((folder / "pyproject.toml").read_text())["tool"]["attn-spec"]
    check = subprocess.run([str(Path(sys.executable).with_name("attn-spec")), "check"], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=900)
    assert check.returncode == 0, check.stdout[-3000:] + check.stderr
    assert f"profile {configured['profile']} · seed {configured['seed']}" in check.stdout
    assert "mypkg.attention:attention (function convention): CONFORMS" in check.stdout
    assert "mypkg.attention:MultiHeadAttention (module convention): CONFORMS" in check.stdout
    assert check.stdout.rstrip().endswith("seed 2026 (--seed 2026 reruns these cases)")


@pytest.mark.slow
def test_the_sample_project_gates_under_pytest_from_pyproject_alone(sample):
    """`pytest`, no arguments: the same two targets through the plugin (at the quick profile, by the
    environment: the plugin reads the same [tool.attn-spec] table, so its profile is the one checked above)."""
    folder, env = sample
    tests = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly"],
                           cwd=folder, env={**env, "ATTN_SPEC_PROFILE": "quick"}, capture_output=True, text=True,
                           timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:] + tests.stderr
    assert "attn-spec target: mypkg.attention:attention (function convention)" in tests.stdout
    assert "attn-spec target: mypkg.attention:MultiHeadAttention (module convention)" in tests.stdout
    assert "profile quick, --attn-seed=2026" in tests.stdout
    # each property an attention is checked on (the mods' and serving kernels' own are left out, as the CLI leaves
    # them out), and the two require items
    per_target = sum(bool(set(p.conventions) & set(ATTENTION_CONVENTIONS))
                     for p in attn_spec.properties.catalog().values()) + 2
    outcomes = re.search(r"(\d+) passed, (\d+) skipped", tests.stdout)
    assert outcomes and int(outcomes[1]) + int(outcomes[2]) == 2 * per_target, tests.stdout[-2000:]
