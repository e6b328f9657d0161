"""Rewrite the generated parts of README.md and docs/*.md, so that no count, figure or transcript they quote
goes stale by hand:

- the catalog table, between ``<!-- catalog -->`` and ``<!-- /catalog -->`` (docs/catalog.md), from the registry;
- each ``<!-- generated:NAME -->...<!-- /generated -->`` region, by NAME:
  - a count of the code (``counts()``: the properties, the mistake models, the gallery as the suite counts it);
  - ``bench:MEASURE``: the figure of that row of the last saved benchmark run (benchmarks/results.md);
  - ``transcript:ENTRY``: what ``attn-spec check`` prints on gallery entry ENTRY (profile quick, seed 1, the CPU);
  - ``run:COMMAND``: what COMMAND prints, an ``attn-spec`` command line run from the repository root, optionally
    piped through ``grep [-v] [-e] PATTERN ...`` or ``head -n N`` (so a reader can run the same line), after
    ``$ COMMAND``; its standard error too where the command ends with ``2>&1``. Transcripts and runs take seconds each: they are rewritten only with ``--transcripts``;
- outside those regions, "N of M properties fail" and "K not run" with M the number of properties a check
  reports on a target of the convention the verdict names.

    python benchmarks/bench.py --markdown > benchmarks/results.md   # measure (long: every section)
    python benchmarks/update_docs.py                                # then rewrite README.md and docs/
    python benchmarks/update_docs.py --transcripts                  # also run the transcripts' commands again

tests/test_readme.py fails when a file differs from what this script writes (the transcripts up to their time
column, in tests marked slow).
"""
from __future__ import annotations

import ast
import contextlib
import functools
import importlib
import io
import os
import pkgutil
import re
import shlex
import sys
from pathlib import Path

from attn_spec.properties import catalog
from attn_spec.targets.conventions import ATTENTION_CONVENTIONS, CONVENTIONS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results.md"
# "NAME (CONV convention): DOES NOT CONFORM (N of M properties fail)", or the count alone (M: checked_on(CONV))
VERDICT = re.compile(r"(?P<head>\((?P<convention>[a-z-]+) convention\): DOES NOT CONFORM \()?(?P<failed>\d+) of \d+"
                     r"(?P<space>\s+)properties fail")
REGION = re.compile(r"<!-- generated:(?P<name>[^\n]+?) -->(?P<text>.*?)<!-- /generated -->", re.S)
SLOW = ("transcript:", "run:")  # regions rewritten only with --transcripts


def documents() -> list[Path]:
    """README.md and the manual, docs/*.md: every file with generated parts."""
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def table() -> str:
    rows = ["| id | family | statement | conventions |", "|---|---|---|---|"]
    for p in catalog().values():
        conventions = "all" if not p.only_for else ", ".join(p.only_for)
        rows.append(f"| `{p.id}` | {p.family} | {p.statement} | {conventions} |")
    return "\n".join(rows)


def attention_properties() -> int:
    """The properties a check reports on an attention target (the FlexAttention mods' and serving kernels' own
    left out: runner.applicable)."""
    return sum(bool(set(p.conventions) & set(ATTENTION_CONVENTIONS)) for p in catalog().values())


def checked_on(convention: str | None) -> int:
    """The properties a check reports on a target of ``convention`` (runner.applicable): an attention's (also
    where the verdict names no convention), or only those naming a mod's or serving kernel's convention."""
    if convention is None or convention in ATTENTION_CONVENTIONS:
        return attention_properties()
    return sum(convention in p.conventions for p in catalog().values())


def _gallery():
    """tests/gallery with every module imported (each registers its entries)."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import gallery

        for module in pkgutil.iter_modules(gallery.__path__):
            importlib.import_module(f"gallery.{module.name}")
    finally:
        sys.path.remove(str(ROOT / "tests"))
    return gallery


def _undiagnosed() -> set[str]:
    """tests/test_gallery.py's UNDIAGNOSED: the bugs whose one root does not (yet) name their own mistake."""
    tree = ast.parse((ROOT / "tests" / "test_gallery.py").read_text(encoding="utf-8"))
    return next(ast.literal_eval(node.value) for node in tree.body
                if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", "") == "UNDIAGNOSED")


@functools.lru_cache(maxsize=1)
def counts() -> dict[str, int]:
    """The counts the docs quote, as the code has them. The gallery's are the test suite's closing summary
    (tests/conftest.py): its mutation score counts the buggy entries and the trivial outputs no model names,
    each once by name (a gallery module run twice in one process registers twice); tests/test_gallery.py
    asserts every one caught, and a root naming its own mistake for each buggy entry but its UNDIAGNOSED."""
    from attn_spec.diagnosis import MISTAKES

    gallery = _gallery()
    buggy = {entry.name for entry in gallery.BUGGY}
    return {"properties": len(catalog()), "attention-properties": attention_properties(),
            "conventions": len(CONVENTIONS), "mistakes": len(MISTAKES),
            "gallery-buggy": len(buggy | {entry.name for entry in gallery.TRIVIAL}),
            "gallery-diagnosable": len(buggy), "gallery-named": len(buggy - _undiagnosed()),
            "gallery-correct": len({entry.name for entry in gallery.CORRECT}),
            "gallery-trivial": len({entry.name for entry in gallery.TRIVIAL})}


def bench(path: Path = RESULTS) -> tuple[str, str, dict[str, str]]:
    """(the line saying when and where it ran, the table, measure -> figure) of a saved ``bench.py --markdown``
    (what follows the table after a blank line is left out)."""
    measured, _, rest = path.read_text(encoding="utf-8").strip().partition("\n\n")
    rest = rest.partition("\n\n")[0]  # the table; sections below it (bench_startup.py's figures) are not quoted
    rows = {}
    for line in rest.splitlines()[2:]:  # after the header and the |---| line
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return measured.strip(), rest.strip(), rows


def value(name: str, found: dict, figures: dict) -> str:
    if name.startswith("bench:"):
        if name[6:] not in figures:
            raise KeyError(f"the docs quote {name!r}, but {RESULTS.name} has no such row")
        return figures[name[6:]]
    if name.startswith("rows-judged:"):  # the rows a long case is judged on exactly (checking/rows.py)
        from attn_spec.checking.rows import choose

        return str(len(choose(int(name[12:]), int(name[12:]))))
    if name not in found:
        raise KeyError(f"a generated region {name!r} that no count names (known: {', '.join(found)})")
    return str(found[name])


def transcript(name: str) -> str:
    """The text block of ``attn-spec check`` on gallery entry ``name`` (quick profile, seed 1, the CPU)."""
    import attn_spec

    gallery = _gallery()
    entry = next(e for e in gallery.BUGGY + gallery.CORRECT if e.name == name)
    report = attn_spec.check(entry.obj, name=name, convention=entry.convention, profile="quick", seed=1,
                             devices=["cpu"], **entry.options)
    return f"\n```text\n{str(report).strip()}\n```\n"


def _grep(lines: list[str], argv: list[str]) -> list[str]:
    invert = "-v" in argv
    patterns = [a for i, a in enumerate(argv) if not a.startswith("-") or (i and argv[i - 1] == "-e")]
    patterns = [p for p in patterns if p not in ("-e",)]
    return [line for line in lines if any(re.search(p, line) for p in patterns) != invert]


def _head(lines: list[str], argv: list[str]) -> list[str]:
    return lines[:int(argv[-1].lstrip("-"))]


FILTERS = {"grep": _grep, "head": _head}


def run(command: str) -> str:
    """The text block of what ``command`` prints (``attn-spec ...``, piped through FILTERS), run in this process
    from the repository root, headed by the command line."""
    from attn_spec.cli import main

    first, *filters = [shlex.split(stage) for stage in command.split(" | ")]
    if first[0] != "attn-spec" or any(f[0] not in FILTERS for f in filters):
        raise ValueError(f"run:{command}: an attn-spec command, piped through {' or '.join(FILTERS)} only")
    errors = first[-1] == "2>&1"
    printed, here = io.StringIO(), os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed if errors else io.StringIO()):
            main(first[1:len(first) - errors])
    except SystemExit:  # a usage error: its message is the transcript
        pass
    finally:
        os.chdir(here)
    lines = printed.getvalue().rstrip().splitlines()
    for f in filters:
        lines = FILTERS[f[0]](lines, f[1:])
    return "\n```text\n$ {}\n{}\n```\n".format(command, "\n".join(lines))


def slow(name: str) -> str:
    """A transcript's or a run's fresh text."""
    return transcript(name[11:]) if name.startswith("transcript:") else run(name[4:])


def _verdicts(text: str) -> str:
    """Prose (no generated region): each "N of M properties fail" with M the count of its convention's check."""
    n = attention_properties()
    text = re.sub(VERDICT, lambda m: f"{m['head'] or ''}{m['failed']} of {checked_on(m['convention'])}{m['space']}"
                                     f"properties fail", text)
    return re.sub(r"`\d+ not run: stopped at the", f"`{n - 1} not run: stopped at the", text)


def render(text: str, transcripts: bool = False) -> str:
    """``text`` (README's or a docs file's) with every generated part rewritten (transcripts and runs too, with
    ``transcripts``)."""
    if "<!-- catalog -->" in text:
        head, rest = text.split("<!-- catalog -->", 1)
        _, tail = rest.split("<!-- /catalog -->", 1)
        text = f"{head}<!-- catalog -->\n{table()}\n<!-- /catalog -->{tail}"
    found, figures = counts(), bench()[2]

    def region(m) -> str:
        name = m["name"]
        if name.startswith(SLOW):
            body = slow(name) if transcripts else m["text"]
        else:
            body = value(name, found, figures)
        return f"<!-- generated:{name} -->{body}<!-- /generated -->"

    parts, last = [], 0
    for m in REGION.finditer(text):
        parts += [_verdicts(text[last:m.start()]), region(m)]
        last = m.end()
    return "".join(parts + [_verdicts(text[last:])])


if __name__ == "__main__":
    for path in documents():
        path.write_text(render(path.read_text(encoding="utf-8"), "--transcripts" in sys.argv), encoding="utf-8")
