"""Rewrite the catalog table in README.md (between the catalog markers) from the registry.

    python benchmarks/update_readme_catalog.py
"""
from pathlib import Path

import attn_spec.properties  # noqa: F401 - fills the registry
from attn_spec.targets.conventions import ATTENTION_CONVENTIONS
from attn_spec.checking.catalog import REGISTRY

README = Path(__file__).resolve().parents[1] / "README.md"


def table() -> str:
    rows = ["| id | family | statement | conventions |", "|---|---|---|---|"]
    for p in REGISTRY.values():
        conventions = "all" if set(p.conventions) == set(ATTENTION_CONVENTIONS) else ", ".join(p.conventions)
        rows.append(f"| `{p.id}` | {p.family} | {p.statement} | {conventions} |")
    return "\n".join(rows)


if __name__ == "__main__":
    text = README.read_text(encoding="utf-8")
    head, rest = text.split("<!-- catalog -->", 1)
    _, tail = rest.split("<!-- /catalog -->", 1)
    README.write_text(f"{head}<!-- catalog -->\n{table()}\n<!-- /catalog -->{tail}", encoding="utf-8")
