"""README.md stays true: its set-up commands, its catalog table and generated figures, its examples."""
import re
from pathlib import Path

import pytest
from attn_spec.properties import catalog

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _setup_commands():
    block = README.split("## Set-up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_two_setup_commands_and_ci_runs_the_test_one():
    install_and_check, run_tests = _setup_commands()
    assert "pip install" in install_and_check and "attn-spec check" in install_and_check
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert run_tests in ci.splitlines(), f".ci/run must run README's test command {run_tests!r}"


def _update_readme():
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_readme", ROOT / "benchmarks" / "update_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readmes_generated_figures_are_current():
    """Every count README quotes is the code's (the properties, the gallery), every benchmark figure the last saved
    run's (benchmarks/results.md), in marked regions that benchmarks/update_readme.py rewrites: run it when this
    fails. (It used to say "5 of 22 properties fail" with 24, a gallery of 66, 87 and 90 bugs, and a median call
    count of "2nd or 3rd" beside the table's 8.)"""
    update = _update_readme()
    names = {m["name"] for m in update.REGION.finditer(README)}
    assert {"bench-table", "bench-measured", "gallery-buggy", "gallery-correct",
            "bench:target calls to the first failure", "bench:self-test (python -m pytest)"} <= names, names
    assert update.render(README) == README, "README's generated parts are stale: python benchmarks/update_readme.py"
    # each verdict counts the properties its target is checked on: an attention's, or a serving kernel's own
    verdicts = [(m["convention"], m.group(0)) for m in update.VERDICT.finditer(README)]
    assert verdicts and all(f" of {update.checked_on(convention)}" in text for convention, text in verdicts), verdicts
    assert {update.checked_on(c) for c, _ in verdicts} >= {update.counts()["attention-properties"],
                                                           update.checked_on("decode")}
    measured, table, figures = update.bench()
    assert measured.startswith("measured 20") and len(figures) > 20 and f"\n{table}\n" in README


def _untimed(text: str) -> str:
    """A transcript without what varies from run to run: the time column (and the padding it sets)."""
    text = re.sub(r"-{2,}", "--", re.sub(r"\b\d+\.\d\ds\b", "_s", text))
    return re.sub(r"[ \t]+", " ", text).strip()


def test_readmes_transcripts_are_the_checks_real_output():
    """Each generated:transcript:NAME region is what attn-spec check prints on gallery entry NAME today, up to its
    time column (python benchmarks/update_readme.py --transcripts writes them)."""
    update = _update_readme()
    regions = [m for m in update.REGION.finditer(README) if m["name"].startswith("transcript:")]
    assert regions
    for m in regions:
        assert _untimed(m["text"]) == _untimed(update.transcript(m["name"][11:])), \
            f"README's {m['name']} is stale: python benchmarks/update_readme.py --transcripts"


def test_a_stale_count_fails_the_check():
    """The check above can fail: a README that says 22 properties or a gallery of 66 is rewritten."""
    update = _update_readme()
    stale = re.sub(r"(<!-- generated:gallery-buggy -->)\d+<", r"\g<1>66<", README, count=1)
    stale = re.sub(r"(\d+) of \d+ properties fail", r"\1 of 22 properties fail", stale, count=1)
    assert stale != README and update.render(stale) == README


def test_every_property_is_in_the_catalog_table():
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", README, flags=re.M))
    assert set(catalog()) <= listed, f"missing from README's catalog: {sorted(set(catalog()) - listed)}"


def test_adapter_example_is_the_shipped_file():
    shipped = (ROOT / "examples" / "hf_vit_adapter.py").read_text(encoding="utf-8")
    code = shipped[shipped.index("import torch"):].strip()
    assert code in README, "README's ModuleAdapter example differs from examples/hf_vit_adapter.py"


def _layout_rows():
    table = README.split("## Repository layout", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    return {m.group(1).rstrip("/"): m.group(2) for m in re.finditer(r"^\| `([^`]+)` \| (.*) \|$", table, flags=re.M)}


@pytest.mark.slow
def test_layout_table_lists_every_folder_of_the_tree():
    rows = _layout_rows()
    assert all((ROOT / path).is_dir() for path in rows), f"the layout table lists missing folders: {rows}"
    ignored = {".git", ".venv", "venv", ".tox", ".hypothesis", ".pytest_cache", "__pycache__", "build", "dist"}
    folders = {str(d.relative_to(ROOT)) for d in ROOT.rglob("*") if d.is_dir()
               and not any(part in ignored or part.endswith(".egg-info") for part in d.relative_to(ROOT).parts)}
    for folder in sorted(folders):  # listed, or named in the row of a listed folder above it
        above = [str(p) for p in Path(folder).parents if str(p) in rows]
        assert folder in rows or any(Path(folder).name in rows[a] for a in above), f"add {folder}/ to the layout table"


def test_the_ci_gate_section_shows_the_sample_projects_table_first():
    section = README.split("## Gate CI on conformance", 1)[1].split("\n## ", 1)[0]
    first_block = section.split("```", 2)[1]
    assert first_block.startswith("toml\n[tool.attn-spec]")
    sample = (ROOT / "examples" / "ci-gate" / "pyproject.toml").read_text(encoding="utf-8")
    table = sample.split("[tool.attn-spec]", 1)[1].split("\n[", 1)[0].strip()
    assert first_block.split("[tool.attn-spec]", 1)[1].strip() == table, "README differs from examples/ci-gate"


def test_the_settings_table_names_every_setting():
    from attn_spec.settings import offered

    section = README.split("## Gate CI on conformance", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    for s in offered():
        row = next((r for r in rows if f"`{s.name}`" in r.split("|")[1]), None)
        assert row is not None, f"README's settings table lacks {s.name}"
        assert s.env in row and s.pytest_flag in row and s.ini in row, row


def test_attention_interface_example_is_the_shipped_file():
    shipped = (ROOT / "examples" / "hf_attention.py").read_text(encoding="utf-8")
    code = shipped[shipped.index("import torch"):].strip()
    assert code in README, "README's AttentionInterface example differs from examples/hf_attention.py"


def test_conventions_table_lists_every_convention_with_the_command_that_checks_it(monkeypatch):
    """Each row's command loads its target and the kit detects the row's convention from it (flags included)."""
    import importlib.util
    import shlex

    from attn_spec.targets.conventions import CONVENTIONS, make_target
    from attn_spec.targets.loading import load_target

    rows = re.findall(r"^\| `([a-z-]+)`(?:, layout `(\w+)`)? \| .* \| `(attn-spec check [^`]+)` \|$", README, flags=re.M)
    assert {row[0] for row in rows} == set(CONVENTIONS), "one row per convention, each with its command"
    monkeypatch.chdir(ROOT)
    for convention, layout, command in rows:
        argv = shlex.split(command)[2:]
        if argv[0].startswith("transformers") and importlib.util.find_spec("transformers") is None:
            continue
        flags = dict(zip(argv[1::2], argv[2::2]))
        target = make_target(load_target(argv[0]), argv[0], expect_mask=flags.get("--expect-mask"),
                             expect_score=flags.get("--expect-score"))
        assert target.convention == convention, command
        assert not layout or target.layout == layout, command


@pytest.mark.slow
def test_the_marker_example_runs_in_a_project_with_the_pythonpath_line_readme_names(tmp_path):
    """README's marker example, in a project with ``mypkg/`` beside ``tests/``: pytest finds ``mypkg`` only with the
    ``pythonpath = ["."]`` line README says to add (a newcomer's run failed on the import without it)."""
    import subprocess
    import sys

    section = README.split("From inside a test module, a marker", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    line = re.search(r'`(pythonpath = \["\."\])` to `\[tool\.pytest\.ini_options\]`', section).group(1)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "attn.py").write_text((ROOT / "examples" / "seed_attention.py").read_text(encoding="utf-8"))
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_attn.py").write_text(example)
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH" and not k.startswith("ATTN_SPEC_")}
    for pyproject, expected in (("", "No module named 'mypkg'"), (line, "2 tests collected")):
        (tmp_path / "pyproject.toml").write_text(f"[tool.pytest.ini_options]\n{pyproject}\n")
        # the pytest command, as a newcomer runs it: `python -m pytest` would put the current folder on sys.path
        done = subprocess.run([str(Path(sys.executable).parent / "pytest"), "--collect-only", "-q", "-p", "no:cacheprovider"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert expected in done.stdout, done.stdout + done.stderr


def test_one_rung_of_the_scale_profile_is_the_shapes_readme_gives():
    """README's way to run one rung of ``--profile scale`` (its shapes, through ``--shapes``) plans exactly the
    scale profile's checks at that length."""
    from attn_spec import api, settings as config
    from attn_spec.checking.shapes import ladder

    section = README.split("The `scale` profile is a ladder", 1)[1]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0].split()
    shapes = command[command.index("--shapes") + 1:]
    target = command[command.index("check") + 1]

    def planned(**given):
        return api.plan(config.load(config.keywords({"targets": [target], **given}, "{key}"), start=ROOT,
                                    environ={})).rungs

    scale = [r for r in planned(profile="scale") if r.shape.n_q == 4096]
    assert len(scale) == 3 and planned(shapes=shapes) == scale
    assert {str(s) for s in ladder("cpu") if s.n_q == 4096} == set(shapes)
