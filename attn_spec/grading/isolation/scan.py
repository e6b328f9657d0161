"""Static checks on a submission's source, made before any of it runs.

- Syntax: the source is parsed; the first syntax error is reported with its line.
- Forbidden names: an import or an attribute chain that resolves, through the file's import
  aliases, to a forbidden call (``import torch.nn.functional as F`` then
  ``F.scaled_dot_product_attention``) is reported with its line, even in code that never runs.
  A name the submission defines itself (its own ``scaled_dot_product_attention``) is not.

A forbidden entry is a dotted name (``torch.nn.functional.scaled_dot_product_attention``) or a
module followed by ``.*`` (``attn_spec.reference.*``: the module and everything in it).
The runtime tripwires (:mod:`attn_spec.grading.isolation.sandbox`) catch calls made in ways a static scan
cannot see (``getattr`` with a computed name).
"""
from __future__ import annotations

import ast

MAX_HITS = 20


def matches(dotted: str, pattern: str) -> bool:
    if pattern.endswith(".*"):
        base = pattern[:-2]
        return dotted == base or dotted.startswith(base + ".")
    return dotted == pattern


def _chain(node) -> list[str] | None:
    """['F', 'scaled_dot_product_attention'] for ``F.scaled_dot_product_attention``; None if not a name chain."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id] + parts[::-1]


def _aliases(tree) -> tuple[dict[str, str], list[str]]:
    """Local name -> dotted name it is bound to by an import; and the modules star-imported."""
    aliases, stars = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    aliases[alias.asname] = alias.name
                else:
                    top = alias.name.split(".")[0]
                    aliases[top] = top
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                if alias.name == "*":
                    stars.append(node.module)
                else:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases, stars


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        return [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def scan(source: bytes, filename: str, forbidden) -> dict:
    """{"syntax_error": {...}} or {"forbidden": [{"name": dotted, "line": n}, ...]}."""
    try:
        tree = ast.parse(source, filename)
    except SyntaxError as exc:
        return {"syntax_error": {"line": exc.lineno, "offset": exc.offset, "message": exc.msg,
                                 "text": (exc.text or "").rstrip()[:200]}}
    except (ValueError, RecursionError, MemoryError) as exc:  # null bytes, absurd nesting
        return {"syntax_error": {"line": None, "offset": None, "message": f"{type(exc).__name__}: {exc}"[:300],
                                 "text": ""}}
    aliases, stars = _aliases(tree)
    hits: dict[tuple[str, int], None] = {}

    def check(dotted: str, line: int) -> None:
        if len(hits) < MAX_HITS and any(matches(dotted, p) for p in forbidden):
            hits[(dotted, line)] = None

    for node in ast.walk(tree):
        for name in _imported(node):
            check(name, node.lineno)
        chain = _chain(node) if isinstance(node, (ast.Attribute, ast.Name)) else None
        if not chain:
            continue
        if chain[0] in aliases:
            check(".".join([aliases[chain[0]]] + chain[1:]), node.lineno)
        elif isinstance(node, ast.Name):
            for module in stars:
                check(f"{module}.{node.id}", node.lineno)
    return {"forbidden": [{"name": name, "line": line} for name, line in sorted(hits, key=lambda h: (h[1], h[0]))]}
