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


def _bare_python(where: Path) -> Path:
    """A virtual environment with no kit in it: the test venv's dependencies (torch, ...) through a .pth that
    names its site-packages as a plain path, so that folder's own .pth files (the editable finder) never run."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n", encoding="utf-8")
    return python


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
    python = _bare_python(tmp_path)
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
