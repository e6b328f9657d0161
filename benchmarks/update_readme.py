"""Rewrite README.md's generated parts, so that no figure or count it quotes goes stale by hand:

- the catalog table, between ``<!-- catalog -->`` and ``<!-- /catalog -->``, from the registry;
- each ``<!-- generated:NAME -->...<!-- /generated -->`` region: NAME is a count of the code (COUNTS: the
  properties, the gallery), or ``bench:MEASURE`` (the figure of that row of the last saved benchmark run,
  benchmarks/results.md), ``bench-table`` (its whole table) or ``bench-measured`` (when and where it ran);
- in the transcripts (code blocks, where a marker would show), "N of M properties fail" and "K not run" with M
  the number of properties a check reports on an attention;
- with ``--transcripts``, each ``<!-- generated:transcript:NAME -->`` region: the real ``attn-spec check`` output
  on gallery entry NAME (profile quick, seed 1, cpu), in a text block. Without it those regions are kept as they
  are (their time column varies run to run); tests/test_readme.py checks the rest of each against a fresh run.

    python benchmarks/bench.py --markdown > benchmarks/results.md   # measure (long: every section)
    python benchmarks/update_readme.py                              # then rewrite README.md
    python benchmarks/update_readme.py --transcripts                # also run the transcripts' checks again

tests/test_readme.py fails when README.md differs from what this script writes.
"""
from __future__ import annotations

import importlib
import pkgutil
import re
import sys
from pathlib import Path
from attn_spec.properties import catalog
from attn_spec.targets.conventions import ATTENTION_CONVENTIONS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results.md"
# "NAME (CONV convention): DOES NOT CONFORM (N of M properties fail)", or the count alone (M: checked_on(CONV))
VERDICT = re.compile(r"(?P<head>\((?P<convention>[a-z-]+) convention\): DOES NOT CONFORM \()?(?P<failed>\d+) of \d+"
                     r"(?P<space>\s+)properties fail")
REGION = re.compile(r"<!-- generated:(?P<name>[^>]+?) -->(?P<text>.*?)<!-- /generated -->", re.S)


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


def counts() -> dict[str, int]:
    gallery = _gallery()
    def distinct(entries) -> int:  # by name: a gallery module run twice in one process registers twice (seen in a long xdist worker)
        return len({entry.name for entry in entries})
    return {"properties": len(catalog()), "attention-properties": attention_properties(),
            "gallery-buggy": distinct(gallery.BUGGY), "gallery-correct": distinct(gallery.CORRECT),
            "gallery-trivial": distinct(gallery.TRIVIAL)}


def bench(path: Path = RESULTS) -> tuple[str, str, dict[str, str]]:
    """(the line saying when and where it ran, the table, measure -> figure) of a saved ``bench.py --markdown``."""
    measured, _, rest = path.read_text(encoding="utf-8").strip().partition("\n\n")
    rows = {}
    for line in rest.splitlines()[2:]:  # after the header and the |---| line
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1]
    return measured.strip(), rest.strip(), rows


def value(name: str, found: dict, saved: tuple) -> str:
    measured, bench_table, figures = saved
    if name == "bench-table":
        return f"\n{bench_table}\n"
    if name == "bench-measured":
        return measured
    if name.startswith("bench:"):
        if name[6:] not in figures:
            raise KeyError(f"README quotes {name!r}, but {RESULTS.name} has no such row")
        return figures[name[6:]]
    if name not in found:
        raise KeyError(f"README has a generated region {name!r} that no count names (known: {', '.join(found)})")
    return str(found[name])


def transcript(name: str) -> str:
    """The text block of ``attn-spec check`` on gallery entry ``name`` (quick profile, seed 1, the CPU)."""
    import attn_spec

    entry = next(e for e in _gallery().BUGGY + _gallery().CORRECT if e.name == name)
    report = attn_spec.check(entry.obj, name=name, convention=entry.convention, profile="quick", seed=1,
                             devices=["cpu"], **entry.options)
    return f"\n```text\n{str(report).strip()}\n```\n"


def render(text: str, transcripts: bool = False) -> str:
    """README's text with every generated part rewritten (the transcripts too, with ``transcripts``)."""
    head, rest = text.split("<!-- catalog -->", 1)
    _, tail = rest.split("<!-- /catalog -->", 1)
    text = f"{head}<!-- catalog -->\n{table()}\n<!-- /catalog -->{tail}"
    found, saved = counts(), bench()
    def region(m) -> str:
        name = m["name"]
        if name.startswith("transcript:"):
            return f"<!-- generated:{name} -->{transcript(name[11:]) if transcripts else m['text']}<!-- /generated -->"
        return f"<!-- generated:{name} -->{value(name, found, saved)}<!-- /generated -->"
    text = REGION.sub(region, text)
    n = found["attention-properties"]
    text = re.sub(VERDICT, lambda m: f"{m['head'] or ''}{m['failed']} of {checked_on(m['convention'])}{m['space']}"
                                     f"properties fail", text)
    return re.sub(r"`\d+ not run: stopped at the", f"`{n - 1} not run: stopped at the", text)


if __name__ == "__main__":
    README.write_text(render(README.read_text(encoding="utf-8"), "--transcripts" in sys.argv), encoding="utf-8")
