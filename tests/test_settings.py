"""Settings defined once (attn_spec.settings): layered command line > environment > pyproject.toml >
defaults, a bad value named with its source, `attn-spec config`, and the registry matching the kit."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import attn_spec
from attn_spec import settings
from attn_spec.cli import main
from attn_spec.errors import KitUsageError

REPO = Path(__file__).resolve().parents[1]
SEED = str(REPO / "examples" / "seed_attention.py")


@pytest.fixture
def project(tmp_path, monkeypatch):
    """An empty project folder with a pyproject.toml, as the current directory; no ATTN_SPEC_* variables."""
    for name in [k for k in list(__import__("os").environ) if k.startswith("ATTN_SPEC_")]:
        monkeypatch.delenv(name)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "p"\n\n[tool.attn-spec]\nprofile = "thorough"\n'
                                             'seed = 11\nonly = ["causal-mask"]\n')
    monkeypatch.chdir(tmp_path)
    return tmp_path


def config_json(capsys, *argv):
    assert main(["config", "--format", "json", *argv]) == 0
    return json.loads(capsys.readouterr().out)["settings"]


def test_the_registry_matches_the_kit():
    """The torch-free lists in attn_spec.settings are the kit's own (add a new one there too); the conventions'
    names are not copied: the vocabulary's BUILTIN are exactly the conventions the kit's Target classes register."""
    from attn_spec import vocabulary
    from attn_spec.checking.cases import DTYPES
    from attn_spec.checking.strategies import PROFILES
    from attn_spec.targets.behaviours import VALUES
    from attn_spec.targets.capabilities import CAPABILITIES
    from attn_spec.targets.conventions import CLASSES

    kits_own = [name for name, cls in CLASSES.items() if cls.__module__.startswith("attn_spec.")]
    assert sorted(kits_own) == sorted(vocabulary.BUILTIN)
    assert settings.SETTINGS["convention"].choices is vocabulary.names and settings.PROFILES == tuple(PROFILES)
    assert settings.DTYPES == tuple(DTYPES) and settings.CAPABILITIES == CAPABILITIES
    assert settings.BEHAVIOURS == tuple(VALUES)


def test_names_derive_from_one_entry():
    s = settings.SETTINGS["profile"]
    assert (s.cli_flags, s.env, s.pytest_flag, s.ini, s.dest) == (("--profile",), "ATTN_SPEC_PROFILE",
                                                                   "--attn-profile", "attn_profile", "profile")
    targets = settings.SETTINGS["targets"]
    assert (targets.pytest_flag, targets.ini, targets.env) == ("--attn-target", "attn_target", "ATTN_SPEC_TARGETS")
    assert settings.SETTINGS["devices"].cli_flags == ("--device", "--devices")  # --device stays


def test_precedence_command_line_over_environment_over_pyproject_over_defaults(project, capsys, monkeypatch):
    got = config_json(capsys)
    assert got["profile"] == {**got["profile"], "value": "thorough", "source": "pyproject.toml [tool.attn-spec]"}
    assert (got["convention"]["value"], got["convention"]["source"]) == (None, "default")
    monkeypatch.setenv("ATTN_SPEC_PROFILE", "quick")
    monkeypatch.setenv("ATTN_SPEC_SEED", "12")
    got = config_json(capsys)
    assert (got["profile"]["value"], got["profile"]["source"]) == ("quick", "environment ATTN_SPEC_PROFILE")
    assert (got["seed"]["value"], got["seed"]["source"]) == (12, "environment ATTN_SPEC_SEED")
    assert (got["only"]["value"], got["only"]["source"]) == (["causal-mask"], "pyproject.toml [tool.attn-spec]")
    got = config_json(capsys, "--profile", "default", "--only", "scale-sqrt-dk,rows-sum-to-one")
    assert (got["profile"]["value"], got["profile"]["source"]) == ("default", "the command line (--profile)")
    assert got["only"]["value"] == ["scale-sqrt-dk", "rows-sum-to-one"]
    assert (got["seed"]["value"], got["seed"]["source"]) == (12, "environment ATTN_SPEC_SEED")


def test_pyproject_is_found_from_a_subfolder_and_paths_are_its(project, capsys, monkeypatch):
    (project / "pyproject.toml").write_text('[tool.attn-spec]\ntargets = ["src/attn.py:attention", "pkg.mod:fn"]\n'
                                            'expect = "known.txt"\n')
    (project / "deep" / "er").mkdir(parents=True)
    monkeypatch.chdir(project / "deep" / "er")
    got = config_json(capsys)
    assert got["targets"]["value"] == ["../../src/attn.py:attention", "pkg.mod:fn"]  # modules are not paths
    assert got["expect"]["value"] == "../../known.txt"
    assert got["targets"]["source"] == "../../pyproject.toml [tool.attn-spec]"


def test_a_pyproject_without_the_table_is_passed_over(tmp_path, monkeypatch, capsys):
    (tmp_path / "pyproject.toml").write_text('[tool.attn-spec]\nprofile = "quick"\n')
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "pyproject.toml").write_text('[project]\nname = "inner"\n')  # no [tool.attn-spec]
    monkeypatch.chdir(tmp_path / "inner")
    assert settings.find_pyproject() == tmp_path / "pyproject.toml"


# A bad value from each source: (how to give it, the message)
BAD = {
    "command line": (lambda p, mp: ["--profile", "huge"],
                     "profile='huge' from the command line (--profile): must be one of quick, default, thorough"),
    "environment": (lambda p, mp: mp.setenv("ATTN_SPEC_PROFILE", "huge") or [],
                    "profile='huge' from environment ATTN_SPEC_PROFILE: must be one of quick, default, thorough"),
    "pyproject.toml": (lambda p, mp: (p / "pyproject.toml").write_text('[tool.attn-spec]\nprofile = "huge"\n') and [],
                       "profile='huge' from pyproject.toml [tool.attn-spec]: must be one of quick, default, thorough"),
    "pyproject.toml type": (lambda p, mp: (p / "pyproject.toml").write_text('[tool.attn-spec]\nseed = "x"\n') and [],
                            "seed='x' from pyproject.toml [tool.attn-spec]: must be an integer"),
    "environment list": (lambda p, mp: mp.setenv("ATTN_SPEC_DTYPES", "float32,float8") or [],
                         "dtypes='float32,float8' from environment ATTN_SPEC_DTYPES: 'float8' is not one of float64, "
                         "float32, float16, bfloat16"),
    "environment hf-module-attr": (lambda p, mp: mp.setenv("ATTN_SPEC_HF_MODULE_ATTR", "sinks") or [],
                                   "hf-module-attr='sinks' from environment ATTN_SPEC_HF_MODULE_ATTR: 'sinks' is not "
                                   "NAME=VALUE or config.NAME=VALUE"),
    "unknown key": (lambda p, mp: (p / "pyproject.toml").write_text('[tool.attn-spec]\nprofle = "quick"\n') and [],
                    "pyproject.toml [tool.attn-spec]: unknown key 'profle' (did you mean 'profile'?); known keys: "),
}


@pytest.mark.parametrize("command", ["check", "config"])
@pytest.mark.parametrize("source", BAD)
def test_a_bad_value_names_its_source(source, command, project, monkeypatch, capsys):
    give, message = BAD[source]
    argv = give(project, monkeypatch)
    assert main([command, SEED + ":attention", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"attn-spec {command}: error: {message}"), err
    assert err.endswith(f"run 'attn-spec {command} --help' for usage\n")


def test_a_setting_the_catalog_judges_names_its_source(project, capsys):
    (project / "pyproject.toml").write_text('[tool.attn-spec]\nrequire = ["masks"]\n')
    assert main(["check", SEED + ":attention"]) == 2
    assert ("require=['masks'] from pyproject.toml [tool.attn-spec]: 'masks' is not a capability"
            in capsys.readouterr().err)
    (project / "pyproject.toml").write_text('[tool.attn-spec]\nexpect = "missing.txt"\n')
    assert main(["check", SEED + ":attention"]) == 2
    assert ("expect='missing.txt' from pyproject.toml [tool.attn-spec]: cannot read missing.txt"
            in capsys.readouterr().err)


def test_a_bad_keyword_of_the_api_names_it():
    with pytest.raises(KitUsageError, match=r"profile='huge' from the keyword argument profile: must be one of"):
        attn_spec.check(lambda Q, K, V, mask=None: V, profile="huge")


def test_no_target_anywhere_is_a_usage_error(project, capsys):
    assert main(["check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attn-spec check: error: no TARGET given, and no targets in [tool.attn-spec]")


def test_a_feature_not_yet_in_this_version_is_refused_not_ignored(project, capsys):
    pending = [s for s in settings.SETTINGS.values() if s.pending]
    if not pending:
        pytest.skip("every setting of the table is wired")
    s = pending[0]
    value = {"bool": "true", "int": "1"}.get(s.kind, s.choices[0] if s.choices else "1,1,4,8")
    (project / "pyproject.toml").write_text(f'[tool.attn-spec]\n{s.name} = "{value}"\n')
    assert main(["config"]) == 2
    assert f"does not have it yet ({s.pending})" in capsys.readouterr().err


def test_api_reads_configuration_only_when_asked(project, monkeypatch):
    (project / "pyproject.toml").write_text(f'[tool.attn-spec]\ntargets = ["{SEED}:attention"]\nprofile = "quick"\n'
                                            'seed = 3\nonly = ["cross-attention-shapes"]\n')
    monkeypatch.setenv("ATTN_SPEC_SEED", "4")
    report = attn_spec.check(config=True, only=["rows-sum-to-one"])
    assert (report.profile, report.seed, [p.id for p in report.targets[0].properties]) == \
        ("quick", 4, ["rows-sum-to-one"])  # keyword > environment > pyproject.toml
    assert report.targets[0].target.endswith("seed_attention.py:attention") and report.conforms
    with pytest.raises(KitUsageError, match="no targets"):
        attn_spec.check()  # without config=True neither the file nor the environment is read


def test_config_command_and_help_import_no_torch(project):
    code = ("import sys; from attn_spec.cli import main; main(['config']); "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from attn_spec.cli import build_parser; build_parser(); assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=project, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines()]
    assert ["profile", "thorough", "pyproject.toml", "[tool.attn-spec]"] in rows


def test_settings_travel_to_xdist_workers_intact(project):
    loaded = settings.load(start=project)
    again = settings.Settings.from_wire(json.loads(json.dumps(loaded.to_wire())))
    assert again == loaded


@pytest.mark.parametrize("argv, usage", [
    (["explain", "a", "b"], "attn-spec explain"),
    (["check", "--bogus"], "attn-spec check"),
    (["list", "extra"], "attn-spec list"),
])
def test_a_subcommands_errors_speak_in_its_own_usage(argv, usage, capsys):
    """The one line that says what is wrong comes first, then a pointer to the command's own --help
    (argparse printed the whole usage block, 14 lines for check, before it)."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines() == [f"{usage}: error: unrecognized arguments: {argv[-1]}", f"run '{usage} --help' for usage"]


def test_a_missing_command_is_one_line_then_the_pointer(capsys):
    with pytest.raises(SystemExit) as exit_:
        main([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["attn-spec: error: the following arguments are required: COMMAND",
                                                    "run 'attn-spec --help' for usage"]


def test_unknown_property_in_explain_speaks_in_explains_usage(capsys):
    assert main(["explain", "no-such-property"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("attn-spec explain: error: unknown property id") and "usage:" not in err
