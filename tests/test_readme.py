"""README.md and the manual (docs/*.md) stay true: the set-up commands, the generated counts, figures, catalog and
transcripts, the examples they quote, the settings and layout tables, and every link."""
import re
from pathlib import Path

import pytest
from attn_spec.properties import catalog

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _doc(name: str) -> str:
    return (ROOT / "docs" / name).read_text(encoding="utf-8")


def _update():
    import importlib.util

    spec = importlib.util.spec_from_file_location("update_docs", ROOT / "benchmarks" / "update_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _documents() -> dict[str, str]:
    """README.md and docs/*.md, by path relative to the repository root."""
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return {str(p.relative_to(ROOT)): p.read_text(encoding="utf-8") for p in paths}


def _setup_commands():
    block = README.split("## Set-up", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [line.strip() for line in block.strip().splitlines()]


def test_two_setup_commands_and_ci_runs_the_test_one():
    install_and_check, run_tests = _setup_commands()
    assert "pip install" in install_and_check and "attn-spec check" in install_and_check
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert run_tests in ci.splitlines(), f".ci/run must run README's test command {run_tests!r}"


def _prose(text: str) -> list[str]:
    """The lines of ``text`` outside code blocks and tables (transcripts print what the kit prints)."""
    lines, fenced = [], False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and not line.startswith("```"):
            lines.append(line)
    return lines


def test_readme_is_a_front_door():
    """Issue 34: README under 250 lines, none of its own over 160 characters (a transcript's lines are the kit's)."""
    assert len(README.splitlines()) < 250
    long = [line for line in _prose(README) if len(line) > 160 and not line.startswith("<!-- generated:")]
    assert not long, long


def test_generated_counts_and_figures_are_current():
    """Every count README and docs/ quote is the code's (the properties, the mistake models, the gallery as the
    suite's summary counts it), every benchmark figure the last saved run's (benchmarks/results.md), in marked
    regions that benchmarks/update_docs.py rewrites: run it when this fails. (README used to say "5 of 22
    properties fail" with 24, a gallery of 66, 87 and 90 bugs, 128/129 where the suite printed 131/131.)"""
    update = _update()
    documents = _documents()
    names = {m["name"] for text in documents.values() for m in update.REGION.finditer(text)}
    assert {"properties", "mistakes", "gallery-buggy", "gallery-named", "gallery-correct",
            "bench:target calls to the first failure", "bench:self-test (python -m pytest)"} <= names, names
    for path, text in documents.items():
        assert update.render(text) == text, f"{path}'s generated parts are stale: python benchmarks/update_docs.py"
    # each verdict in prose counts the properties its target is checked on: an attention's, or a serving kernel's
    verdicts = [(m["convention"], m.group(0)) for text in documents.values() for m in update.VERDICT.finditer(text)]
    assert verdicts and all(f" of {update.checked_on(convention)}" in text for convention, text in verdicts), verdicts


def test_the_gallery_count_is_the_suites():
    """The gallery figure is what the suite's closing summary counts (tests/conftest.py): each buggy entry and each
    trivial output once by name, however often a module registers them."""
    update = _update()
    gallery = update._gallery()
    counted = {e.name for e in gallery.BUGGY} | {e.name for e in gallery.TRIVIAL if e not in gallery.BUGGY}
    assert update.counts()["gallery-buggy"] == len(counted) > update.counts()["gallery-diagnosable"]


def test_a_stale_count_fails_the_check():
    """The check above can fail: a README that says 22 properties or a gallery of 66 is rewritten."""
    update = _update()
    stale = re.sub(r"(<!-- generated:gallery-buggy -->)\d+<", r"\g<1>66<", README, count=1)
    stale = re.sub(r"(<!-- generated:properties -->)\d+<", r"\g<1>22<", stale, count=1)
    assert stale != README and update.render(stale) == README
    failures = _doc("pytest-and-ci.md")
    stale = re.sub(r"(\d+) of \d+(\s+)properties fail", r"\1 of 22\2properties fail", failures, count=1)
    assert stale != failures and update.render(stale) == failures


def _untimed(text: str) -> str:
    """A transcript without what varies from run to run: the time column (and the padding it sets)."""
    text = re.sub(r"-{2,}", "--", re.sub(r"\b\d+\.\d\ds\b", "_s", text))
    return re.sub(r"[ \t]+", " ", text).strip()


def _transcripts():
    update = _update()
    return [pytest.param(path, m["name"], m["text"], id=f"{path}:{m['name'][:60]}")
            for path, text in _documents().items() for m in update.REGION.finditer(text) if m["name"].startswith(update.SLOW)]


@pytest.mark.slow
@pytest.mark.parametrize("path, name, text", _transcripts())
def test_transcripts_are_the_commands_real_output(path, name, text):
    """Each transcript:ENTRY and run:COMMAND region is what that check or command prints today, at the seed it names,
    up to its time column (python benchmarks/update_docs.py --transcripts writes them). README's failure transcript
    once showed another counterexample than the command printed."""
    assert _untimed(text) == _untimed(_update().slow(name)), \
        f"{path}'s {name} is stale: python benchmarks/update_docs.py --transcripts"


def test_transcripts_are_marked_and_the_readme_has_one():
    regions = [name for _, name, _ in (p.values for p in _transcripts())]
    assert sum(1 for name in regions if name.startswith("run:attn-spec check examples/buggy_attention.py")) == 1
    # a check's cases are its seed's: each transcript names it (a usage error draws none)
    assert all("--seed" in name or name.endswith("2>&1") for name in regions if name.startswith("run:attn-spec check"))


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_readme_and_docs_resolves():
    """A relative link names a file that exists, and its #anchor a heading of that file."""
    for path, text in _documents().items():
        for target in _LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (ROOT / path).parent / file if file else ROOT / path
            assert linked.exists(), f"{path} links to {target}: no such file"
            if anchor:
                headings = re.findall(r"^#+ (.*)$", linked.read_text(encoding="utf-8"), flags=re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{path} links to {target}: no such heading"


def test_every_property_is_in_the_catalog_table():
    listed = set(re.findall(r"^\| `([a-z0-9-]+)` \|", _doc("catalog.md"), flags=re.M))
    assert set(catalog()) <= listed, f"missing from docs/catalog.md: {sorted(set(catalog()) - listed)}"


def test_adapter_example_is_the_shipped_file():
    shipped = (ROOT / "examples" / "hf_vit_adapter.py").read_text(encoding="utf-8")
    code = shipped[shipped.index("import torch"):].strip()
    assert code in _doc("conventions.md"), "docs/conventions.md's ModuleAdapter example differs from the shipped file"


def _layout_rows():
    table = _doc("architecture.md").split("## Repository layout", 1)[1]
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


def _ci_section() -> str:
    return _doc("pytest-and-ci.md").split("## Gate CI on conformance", 1)[1].split("\n## ", 1)[0]


def test_the_ci_gate_section_shows_the_sample_projects_table_first():
    first_block = _ci_section().split("```", 2)[1]
    assert first_block.startswith("toml\n[tool.attn-spec]")
    sample = (ROOT / "examples" / "ci-gate" / "pyproject.toml").read_text(encoding="utf-8")
    table = sample.split("[tool.attn-spec]", 1)[1].split("\n[", 1)[0].strip()
    assert first_block.split("[tool.attn-spec]", 1)[1].strip() == table, "docs/pytest-and-ci.md differs from examples/ci-gate"


def test_the_settings_table_names_every_setting():
    from attn_spec.settings import offered

    rows = [line for line in _ci_section().splitlines() if line.startswith("| `")]
    for s in offered():
        row = next((r for r in rows if f"`{s.name}`" in r.split("|")[1]), None)
        assert row is not None, f"docs/pytest-and-ci.md's settings table lacks {s.name}"
        assert s.env in row and s.pytest_flag in row and s.ini in row, row


def test_attention_interface_example_is_the_shipped_file():
    shipped = (ROOT / "examples" / "hf_attention.py").read_text(encoding="utf-8")
    code = shipped[shipped.index("import torch"):].strip()
    assert code in _doc("conventions.md"), "docs/conventions.md's AttentionInterface example differs from the shipped file"


def test_conventions_table_lists_every_convention_with_the_command_that_checks_it(monkeypatch):
    """Each README row's command loads its target and the kit detects the row's convention from it (flags included);
    docs/conventions.md gives each convention's contract."""
    import importlib.util
    import shlex

    from attn_spec.targets.conventions import CONVENTIONS, make_target
    from attn_spec.targets.loading import load_target

    rows = re.findall(r"^\| `([a-z-]+)`(?:, layout `(\w+)`)? \| .* \| `(attn-spec check [^`]+)` \|$", README, flags=re.M)
    assert {row[0] for row in rows} == set(CONVENTIONS), "one row per convention, each with its command"
    assert set(re.findall(r"^\| `([a-z-]+)`", _doc("conventions.md"), flags=re.M)) >= set(CONVENTIONS)
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
def test_the_marker_example_runs_in_a_project_with_the_pythonpath_line_the_docs_name(tmp_path):
    """docs/pytest-and-ci.md's marker example, in a project with ``mypkg/`` beside ``tests/``: pytest finds ``mypkg``
    only with the ``pythonpath = ["."]`` line the docs say to add (a newcomer's run failed on the import without it)."""
    import subprocess
    import sys

    section = _doc("pytest-and-ci.md").split("From inside a test module, a marker", 1)[1]
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


def test_one_rung_of_the_scale_profile_is_the_shapes_the_docs_give():
    """docs/scale.md's way to run one rung of ``--profile scale`` (its shapes, through ``--shapes``) plans exactly
    the scale profile's checks at that length."""
    from attn_spec import api, settings as config
    from attn_spec.checking.shapes import ladder

    section = _doc("scale.md").split("The `scale` profile is a ladder", 1)[1]
    command = section.split("```bash\n", 1)[1].split("```", 1)[0].split()
    shapes = command[command.index("--shapes") + 1:]
    target = command[command.index("check") + 1]

    def planned(**given):
        return api.plan(config.load(config.keywords({"targets": [target], **given}, "{key}"), start=ROOT,
                                    environ={})).rungs

    scale = [r for r in planned(profile="scale") if r.shape.n_q == 4096]
    assert len(scale) == 3 and planned(shapes=shapes) == scale
    assert {str(s) for s in ladder("cpu") if s.n_q == 4096} == set(shapes)
