"""The pytest plugin configured once: ini keys in every pytest config file, [tool.attn-spec], the
environment, the same precedence and error messages as `attn-spec check`, and the marker.

Each scenario is a fresh pytest (``pytester``) run in this process (``runpytest_inprocess``: a new config and
plugin manager, the plugin loaded through its entry point), sparing a subprocess's torch import each (about 3 s
of CPU); test_plugin runs those about the process itself (xdist, tox, the plugin's import cost) in a subprocess.
"""
import pytest

from test_plugin import BUGGY, CORRECT

pytest_plugins = ["pytester"]

ONLY = "rows-sum-to-one,scale-sqrt-dk"


@pytest.fixture
def attn_project(pytester, monkeypatch):
    for name in [k for k in __import__("os").environ if k.startswith("ATTN_SPEC_")]:
        monkeypatch.delenv(name)
    pytester.makepyfile(attn_ok=CORRECT, attn_bad=BUGGY)
    return pytester


INI_FILES = {  # file name -> (content with the keys, the section the message names)
    "pytest.ini": ("[pytest]\n{keys}\n", "[pytest]"),
    "tox.ini": ("[pytest]\n{keys}\n", "[pytest]"),
    "setup.cfg": ("[tool:pytest]\n{keys}\n", "[tool:pytest]"),
    "pyproject.toml": ("[tool.pytest.ini_options]\n{toml}\n", "[tool.pytest.ini_options]"),
}


@pytest.mark.parametrize("filename", INI_FILES)
def test_ini_keys_configure_the_plugin_from_every_pytest_config_file(attn_project, filename):
    content, section = INI_FILES[filename]
    keys = f"attn_target = attn_ok.py:attention\nattn_profile = quick\nattn_only = {ONLY}\nattn_seed = 5"
    toml = f'attn_target = ["attn_ok.py:attention"]\nattn_profile = "quick"\nattn_only = ["{ONLY}"]\nattn_seed = "5"'
    (attn_project.path / filename).write_text(content.format(keys=keys, toml=toml))
    result = attn_project.runpytest_inprocess("--collect-only")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["attn-spec *: profile quick, --attn-seed=5, *",
                                 "<TargetCollector attn-spec[[]attn_ok.py:attention[]]>",
                                 "  <PropertyItem rows-sum-to-one>", "  <PropertyItem scale-sqrt-dk>",
                                 "*2 tests collected*"])
    assert f"attn-spec settings: targets, profile, seed, only from {filename} {section}\n" in result.stdout.str()


@pytest.mark.parametrize("filename", ["tox.ini", "pyproject.toml"])
def test_a_bad_ini_value_names_the_file_and_key(attn_project, filename):
    content, section = INI_FILES[filename]
    (attn_project.path / filename).write_text(content.format(keys="attn_target = attn_ok.py:attention\n"
                                                                  "attn_profile = huge",
                                                             toml='attn_target = ["attn_ok.py:attention"]\n'
                                                                  'attn_profile = "huge"'))
    result = attn_project.runpytest_inprocess("--collect-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: attn-spec: profile='huge' from {filename} {section} attn_profile: "
                                 "must be one of quick, default, thorough, scale"])


def test_precedence_flag_over_environment_over_ini_over_tool_attn_spec(attn_project, monkeypatch):
    (attn_project.path / "pyproject.toml").write_text(
        '[tool.attn-spec]\ntargets = ["attn_ok.py:attention"]\nprofile = "thorough"\nseed = 1\nonly = ["causal-mask"]\n'
        '\n[tool.pytest.ini_options]\nattn_profile = "default"\nattn_seed = "2"\n')
    monkeypatch.setenv("ATTN_SPEC_SEED", "3")

    def header():
        result = attn_project.runpytest_inprocess("--collect-only", *flags)
        assert result.ret == 0, result.stderr.str()
        return next(line for line in result.outlines if line.startswith("attn-spec 0"))

    flags = []
    assert "profile default, --attn-seed=3," in header()  # ini key over the table; environment over the ini key
    flags = ["--attn-profile", "quick", "--attn-seed", "4"]
    assert "profile quick, --attn-seed=4," in header()
    monkeypatch.setenv("ATTN_SPEC_PROFILE", "huge")
    result = attn_project.runpytest_inprocess("--collect-only")
    result.stderr.fnmatch_lines(["ERROR: attn-spec: profile='huge' from environment ATTN_SPEC_PROFILE: must be one of*"])


def test_configured_targets_run_with_the_whole_suite_not_with_a_named_file(attn_project):
    (attn_project.path / "pyproject.toml").write_text(
        '[tool.attn-spec]\ntargets = ["attn_ok.py:attention"]\nprofile = "quick"\nonly = ["rows-sum-to-one"]\n')
    attn_project.makepyfile(test_unit="def test_unit():\n    pass\n")
    whole = attn_project.runpytest_inprocess()
    whole.assert_outcomes(passed=2)  # the unit test and the configured target's one property
    named = attn_project.runpytest_inprocess("test_unit.py")
    named.assert_outcomes(passed=1)
    flagged = attn_project.runpytest_inprocess("test_unit.py", "--attn-target", "attn_ok.py:attention")
    flagged.assert_outcomes(passed=2)  # a target on the command line is always checked


def test_a_target_on_the_command_line_adds_to_the_configured_ones(attn_project):
    """README: ``--attn-target`` always adds its target; it used to replace the targets of [tool.attn-spec]."""
    (attn_project.path / "pyproject.toml").write_text(
        '[tool.attn-spec]\ntargets = ["attn_ok.py:attention"]\nprofile = "quick"\nonly = ["rows-sum-to-one"]\n')
    both = attn_project.runpytest_inprocess("-v", "--attn-target", "attn_bad.py:attention", "--attn-target",
                                            "attn_ok.py:attention")
    both.assert_outcomes(passed=2)
    both.stdout.fnmatch_lines(["attn-spec target: attn_bad.py:attention *", "attn-spec target: attn_ok.py:attention *",
                               "*attn-spec?attn_bad.py:attention?::rows-sum-to-one PASSED*",
                               "*attn-spec?attn_ok.py:attention?::rows-sum-to-one PASSED*"])
    added = attn_project.runpytest_inprocess("-v", "--attn-target", "attn_bad.py:attention")
    added.assert_outcomes(passed=2)  # the configured one too, once
    attn_project.makepyfile(test_unit="def test_unit():\n    pass\n")
    named = attn_project.runpytest_inprocess("test_unit.py", "--attn-target", "attn_bad.py:attention")
    named.assert_outcomes(passed=2)
    named.stdout.fnmatch_lines(["attn-spec target: attn_bad.py:attention *"])
    assert "attn_ok.py" not in named.stdout.str()  # a named file: the configured targets wait for the whole suite


def test_expected_failures_are_xfails_and_requirements_are_items(attn_project):
    (attn_project.path / "known.txt").write_text("scale-sqrt-dk  # divides by d_k\n")
    (attn_project.path / "pyproject.toml").write_text(
        '[tool.attn-spec]\ntargets = ["attn_bad.py:attention"]\nprofile = "quick"\nseed = 3\n'
        f'only = ["{ONLY}"]\nexpect = "known.txt"\nrequire = ["autograd", "scale", "fully-masked=nan"]\n')
    result = attn_project.runpytest_inprocess("-rxs", "-v")
    result.assert_outcomes(passed=3, failed=1, xfailed=1)
    result.stdout.fnmatch_lines([
        "*::scale-sqrt-dk XFAIL*",
        "*::capability:scale FAILED*",
        "*XFAIL*scale-sqrt-dk: expected failure (listed in known.txt)*",
    ])
    assert "required capability scale, found no" in result.stdout.str()


def test_a_required_length_is_an_item(attn_project):
    (attn_project.path / "pyproject.toml").write_text(
        '[tool.attn-spec]\ntargets = ["attn_ok.py:attention"]\nprofile = "quick"\nseed = 3\n'
        'only = ["rows-sum-to-one"]\nrequire = ["length=64"]\n')
    result = attn_project.runpytest_inprocess("-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*::capability:length PASSED*"])


MARKED = """
import pytest

from attn_bad import attention as buggy


@pytest.mark.attn_spec(target=buggy, only=["scale-sqrt-dk", "rows-sum-to-one"], profile="quick", seed=4)
def test_buggy_conforms():
    raise AssertionError("the body of a marked test is not run")


@pytest.mark.attn_spec(target="attn_ok.py:attention", only="rows-sum-to-one", profile="quick")
def test_correct_conforms():
    pass


@pytest.mark.attn_spec(target="attn_ok.py:attention", profile="huge")
def test_bad_marker():
    pass


def test_plain():
    pass
"""


def test_marker_checks_a_target_from_a_test_module(attn_project):
    attn_project.makepyfile(test_marked=MARKED)
    result = attn_project.runpytest_inprocess("-v")
    result.assert_outcomes(passed=3, failed=2)
    result.stdout.fnmatch_lines(["*collected 5 items*"])  # the property items, not the 4 functions
    result.stdout.fnmatch_lines([
        "test_marked.py::test_buggy_conforms[[]rows-sum-to-one[]] PASSED*",
        "test_marked.py::test_buggy_conforms[[]scale-sqrt-dk[]] FAILED*",
        "test_marked.py::test_correct_conforms[[]rows-sum-to-one[]] PASSED*",
        "test_marked.py::test_bad_marker FAILED*",
        "test_marked.py::test_plain PASSED*",
    ])
    out = result.stdout.str()
    assert "✗ scale-sqrt-dk" in out and "likely cause: scores are scaled by 1/d_k" in out
    assert "rerun: pytest 'test_marked.py::test_buggy_conforms[scale-sqrt-dk]' --attn-seed=4" in out
    assert ("profile='huge' from @pytest.mark.attn_spec on test_bad_marker (profile=): must be one of quick, "
            "default, thorough") in out
    assert "the body of a marked test is not run" not in out
