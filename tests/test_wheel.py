"""The kit works installed from a wheel, not only from an editable checkout (issue 21.5).

An editable install maps ``attn_spec`` onto the source tree, which hides a package the wheel leaves out
(``attn_spec.diagnosis`` once). This test builds the wheel from a clean copy of the tree, installs it into a
folder of its own, and runs README's first check from a folder outside the repository, with a Python whose
only view of the kit is that folder: no editable finder, no source tree on ``sys.path``.
"""
from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# What a clean checkout does not have: build outputs, virtual environments, caches.
UNTRACKED = (".git", ".venv", "venv", ".tox", ".hypothesis", ".pytest_cache", "__pycache__", "build", "dist",
             "*.egg-info")


def _readme_first_check() -> list[str]:
    """README's set-up command, from its ``attn-spec check`` on: the first thing a new user runs."""
    block = (ROOT / "README.md").read_text(encoding="utf-8").split("## Set-up", 1)[1].split("```bash", 1)[1]
    first = block.strip().splitlines()[0]
    words = shlex.split(first.split("&&")[-1])
    assert words[0].endswith("attn-spec") and words[1] == "check", first
    return words[1:]


def _declared(wheel: Path) -> set[str]:
    """The distributions a venv with only the wheel has: its Requires-Dist and theirs, as installed here
    (markers evaluated, extras left out), by normalised name."""
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    with zipfile.ZipFile(wheel) as archive:
        text = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    todo = [Requirement(line.split(":", 1)[1]) for line in text.splitlines() if line.startswith("Requires-Dist:")]
    found: set[str] = set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in found or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        found.add(name)
        todo += [Requirement(r) for r in metadata.distribution(name).requires or ()]
    return found


def _only(names: set[str], folder: Path) -> Path:
    """``folder`` holding links to the installed files of the distributions ``names`` and nothing else."""
    from importlib import metadata

    from packaging.utils import canonicalize_name

    folder.mkdir()
    for dist in metadata.distributions():
        if canonicalize_name(dist.metadata["Name"]) in names:
            site = Path(dist.locate_file(""))
            for top in {Path(f).parts[0] for f in dist.files or () if not str(f).startswith("..")}:
                if (site / top).exists() and not (folder / top).exists():
                    (folder / top).symlink_to(site / top)
    return folder


def _bare_python(where: Path, deps: Path | None = None) -> Path:
    """A virtual environment with no kit in it: the test venv's dependencies (torch, ...), or the folder ``deps``,
    through a .pth that names it as a plain path, so that folder's own .pth files (the editable finder) never run."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(f"{deps or sysconfig.get_paths()['purelib']}\n", encoding="utf-8")
    return python


@pytest.mark.slow
def test_a_wheel_built_from_a_clean_tree_installs_and_checks_readmes_first_target(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(*UNTRACKED))
    wheels = tmp_path / "wheels"
    # Offline, with the environment's own setuptools (Python 3.11's venv has one); else pip fetches it, as for -e.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation,
                    "--disable-pip-version-check", "-w", str(wheels), str(tree)], check=True)
    (wheel,) = wheels.glob("attn_spec-*.whl")

    shipped = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(ROOT) for top in ("attn_spec", "properties") for p in (ROOT / top).rglob("*")
               if p.is_file() and "__pycache__" not in p.parts]
    expected = {str(Path("attn_spec", "properties", *p.parts[1:]) if p.parts[0] == "properties" else p) for p in sources}
    assert expected - shipped == set(), f"the wheel leaves out {sorted(expected - shipped)}"
    assert not any(name.startswith("properties/") for name in shipped), "the catalog installs as attn_spec.properties"
    entry_points = next(n for n in shipped if n.endswith(".dist-info/entry_points.txt"))
    assert "attn-spec = attn_spec.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                    "--target", str(target), str(wheel)], check=True)
    python = _bare_python(tmp_path, _only(_declared(wheel), tmp_path / "deps"))  # what the wheel declares, no more
    env = {**os.environ, "PYTHONPATH": str(target)}
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = subprocess.run([python, "-c", "import attn_spec, attn_spec.diagnosis, attn_spec.properties as p; "
                            "print(attn_spec.__file__); print(p.__file__)"],
                           cwd=outside, env=env, check=True, capture_output=True, text=True).stdout.split()
    assert all(Path(f).is_relative_to(target) for f in where), where

    shutil.copytree(ROOT / "examples", outside / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    run = subprocess.run([python, "-m", "attn_spec", *_readme_first_check()[:2]],
                         cwd=outside, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "examples/seed_attention.py:attention (function convention): CONFORMS" in run.stdout
    # torch without numpy warns "Failed to initialize NumPy" at every import, the kit's and a reproduce snippet's:
    # the wheel declares numpy (issue 38.5), so the venv above has it
    run = subprocess.run([python, "-m", "attn_spec", "check", "attn_spec.reference:reference_attention", "--profile",
                          "quick"], cwd=outside, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "CONFORMS" in run.stdout, run.stdout + run.stderr
    snippet = subprocess.run([python, "-c", "import torch; from attn_spec import reproduce"], cwd=outside, env=env,
                             capture_output=True, text=True, timeout=600)
    for stderr in (run.stderr, snippet.stderr):
        assert "NumPy" not in stderr, stderr


def _on_disk() -> set[str]:
    """The packages of the source tree: every folder with an ``__init__.py`` under attn_spec/, and properties/'s
    as attn_spec.properties."""
    found = set()
    for init in [*(ROOT / "attn_spec").rglob("__init__.py"), *(ROOT / "properties").rglob("__init__.py")]:
        parts = init.parent.relative_to(ROOT).parts
        found.add(".".join(("attn_spec", "properties", *parts[1:]) if parts[0] == "properties" else parts))
    return found


def _listed() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def test_pyproject_lists_every_package_on_disk():
    """pyproject.toml lists the wheel's packages (there is no setup.py): a subpackage added on disk but not to the
    list would be left out of the wheel and work only in an editable install."""
    table = _listed()
    assert sorted(table["packages"]) == sorted(_on_disk())
    assert table["package-dir"] == {"attn_spec.properties": "properties"}
    assert not (ROOT / "setup.py").exists()


def test_the_package_check_sees_a_package_left_out(tmp_path, monkeypatch):
    """The check above can fail: a new subpackage on disk is one the list does not name."""
    listed = _listed()["packages"]
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    for folder in ("attn_spec", "attn_spec/new", "properties", "properties/serving"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("", encoding="utf-8")
    assert _on_disk() == {"attn_spec", "attn_spec.new", "attn_spec.properties", "attn_spec.properties.serving"}
    assert _on_disk() - set(listed) == {"attn_spec.new"}
