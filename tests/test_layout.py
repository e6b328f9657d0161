"""The package's shape: no import circle in attn_spec/ and properties/, floors with no arrow back up (the catalog
below the engine that words and runs it), and a catalog that imports cheaply."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for attn_spec/ and properties/ (installed as attn_spec.properties)."""
    mods = {}
    for path in sorted((ROOT / "attn_spec").rglob("*.py")) + sorted((ROOT / "properties").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[0] == "properties":
            parts = ["attn_spec", "properties", *parts[1:]]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(name: str, path: Path, mods: dict) -> set[str]:
    """Every module of the package that ``name`` imports, at module level or lazily (not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in mods}
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in mods:
                    out.add(full)
                elif node.module in mods:
                    out.add(node.module)
    out.discard(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    mods = _modules()
    graph = {name: _imports(name, path, mods) for name, path in mods.items()}
    assert graph["attn_spec.properties"] and graph["attn_spec.checking.runner"], "the import graph came out empty"
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.slow
def test_importing_the_catalog_imports_neither_pytest_nor_sympy():
    code = ("import sys, attn_spec.properties as p; assert len(p.catalog()) > 20; "
            "print(sorted(m for m in ('pytest', 'sympy', '_pytest') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


MATRIX_FORMATTER = "attn_spec.report.matrices"
RENDERED = ("got_text", "expected_text", "inputs_text")  # a counterexample's matrices as text: written by report/ only


def _formats_a_matrix(source: str) -> list[str]:
    """What in ``source`` formats a matrix: an import of the matrix formatter (the module, or any name it defines,
    through ``attn_spec.report`` too), or a counterexample's rendered matrix field named in code (the text a
    runner once pre-rendered). Empty when it formats none."""
    names = {n.name for n in ast.parse((ROOT / "attn_spec/report/matrices.py").read_text(encoding="utf-8")).body
             if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == MATRIX_FORMATTER]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == MATRIX_FORMATTER:
                found.append(node.module)
            elif node.module.startswith("attn_spec.report"):
                found += [f"{node.module}.{a.name}" for a in node.names if a.name in names or a.name == "matrices"]
        elif isinstance(node, ast.Constant) and node.value in RENDERED:
            found.append(repr(node.value))
    return found


@pytest.mark.slow
def test_nothing_outside_report_formats_a_matrix():
    """Matrix formatting lives with the renderers: the runner, the properties, the grader, the plugin and the CLI
    hand over data (a Counterexample) and ask report/ to write it."""
    offenders = {name: found for name, path in _modules().items() if not name.startswith("attn_spec.report")
                 for found in [_formats_a_matrix(path.read_text(encoding="utf-8"))] if found}
    assert offenders == {}


def test_the_matrix_check_catches_a_formatter_used_elsewhere():
    assert _formats_a_matrix("from attn_spec.report.matrices import format_matrix") == [MATRIX_FORMATTER]
    assert _formats_a_matrix("from attn_spec.report.text import format_matrix") == ["attn_spec.report.text.format_matrix"]
    assert _formats_a_matrix("ce = {'got_text': text}") == ["'got_text'"]
    assert _formats_a_matrix("from attn_spec.report import render\nrender(result, 'text')") == []


def _in_its_family(module: str, family: str) -> bool:
    """``module`` is the family's module (properties/<family>.py) or one of its package (properties/<family>/)."""
    place = f"attn_spec.properties.{family.replace('-', '_')}"
    return module == place or module.startswith(place + ".")


def test_each_property_lives_in_the_module_of_its_family():
    from attn_spec import properties

    assert {p.id: p.fn.__module__ for p in properties.catalog().values()
            if not _in_its_family(p.fn.__module__, p.family)} == {}


def test_the_family_check_tells_a_module_out_of_its_family():
    assert _in_its_family("attn_spec.properties.serving.decode", "serving")
    assert _in_its_family("attn_spec.properties.multi_head", "multi-head")
    assert not _in_its_family("attn_spec.properties.decode", "serving")
    assert not _in_its_family("attn_spec.properties.servingx", "serving")


def test_the_catalog_is_in_its_explicit_order_loaded_once_and_each_check_is_exported():
    from attn_spec import properties

    assert list(properties.catalog()) == list(properties.ORDER)
    assert properties.catalog() is properties.catalog()
    assert [getattr(properties, p.fn.__name__).property_id for p in properties.catalog().values()] == \
        list(properties.ORDER)


@pytest.mark.slow
def test_importing_the_catalog_package_imports_no_family_until_asked():
    """No side-effect import: ``import attn_spec.properties`` loads no family; catalog() loads them all, once."""
    code = ("import sys, attn_spec.properties as p; print(sum(m.startswith('attn_spec.properties.') for m in "
            "sys.modules)); p.catalog(); print(sum(m.startswith('attn_spec.properties.') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert before == 0 and after > 20


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def test_a_lazy_import_is_an_edge_of_the_graph(tmp_path):
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    from attn_spec import reference\n    return reference\n", encoding="utf-8")
    assert _imports("lazy", lazy, _modules()) == {"attn_spec.reference"}


ABOVE_TARGETS = ("attn_spec.checking", "attn_spec.diagnosis", "attn_spec.properties", "attn_spec.report",
                 "attn_spec.grading", "attn_spec.commands", "attn_spec.api", "attn_spec.run")


def _below(floor: str, above) -> list[str]:
    """The imports (lazy ones too) of ``floor``'s modules that climb to a floor in ``above``."""
    return sorted(f"{name} -> {dep}" for name, deps in _graph().items() if name.startswith(floor + ".")
                  for dep in deps if any(dep == a or dep.startswith(a + ".") for a in above))


def test_no_module_of_targets_imports_checking_or_anything_above_it():
    assert _below("attn_spec.targets", ABOVE_TARGETS) == []


def test_checking_runs_properties_and_the_diagnosis_comes_after_it():
    """checking/ runs properties into verdicts; the diagnosis, above it, reads them (attn_spec.run.Run)."""
    assert _below("attn_spec.checking", ("attn_spec.diagnosis", "attn_spec.properties", "attn_spec.api",
                                         "attn_spec.run", "attn_spec.grading", "attn_spec.commands")) == []


@pytest.mark.slow
def test_the_plugin_runs_through_the_run_object_and_imports_nothing_private():
    """The pytest plugin, like attn_spec.check, check_property and reproduce, runs and diagnoses through
    attn_spec.run.Run: it imports no private name of the kit, nothing of the diagnosis, and of the runner only
    which properties a target gets."""
    mods = _modules()
    tree = ast.parse(mods["attn_spec.pytest_plugin"].read_text(encoding="utf-8"))
    private = [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and (n.module or "").startswith("attn_spec") for a in n.names
               if a.name.startswith("_") and not a.name.endswith("__")]
    assert private == []
    assert not [d for d in _graph()["attn_spec.pytest_plugin"] if d.startswith("attn_spec.diagnosis")]
    from_runner = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                   and n.module == "attn_spec.checking.runner" for a in n.names}
    assert from_runner <= {"applicable"}  # which properties a target gets; running them is Run's
    users = sorted(name for name, deps in _graph().items() if "attn_spec.run" in deps)
    assert users == ["attn_spec.api"]


# The floors, lowest first: a module imports (lazily too) only its own floor and those below. The catalog stands
# below the engine that words its causes (diagnosis) and runs it (run, api, grading); report/ is the result model
# and its writers, below the checking that fills it. A name is a module or a package (with everything in it).
FLOORS = (
    ("foundation", ("attn_spec.errors", "attn_spec.exit_codes", "attn_spec.failures", "attn_spec.version",
                    "attn_spec.vocabulary", "attn_spec.dtypes", "attn_spec.settings")),
    ("reference", ("attn_spec.reference", "attn_spec.serving_reference", "attn_spec.symbolic", "attn_spec.exact")),
    ("report", ("attn_spec.report",)),
    ("targets", ("attn_spec.targets", "attn_spec.module_adapters")),
    ("checking", ("attn_spec.checking", "attn_spec.cases")),
    ("properties", ("attn_spec.properties",)),
    ("diagnosis", ("attn_spec.diagnosis",)),
    ("run", ("attn_spec.run", "attn_spec.api", "attn_spec.grading", "attn_spec.lessons", "attn_spec.mistake_lessons")),
    ("commands", ("attn_spec.commands", "attn_spec.cli", "attn_spec.__main__", "attn_spec.pytest_plugin",
                  "attn_spec")),  # the package's root: its lazy attributes (check, check_property) are the API's
)


def _floor(module: str, floors=FLOORS) -> int | None:
    """The index of ``module``'s floor (the longest name that holds it), or None when no floor names it."""
    best = None
    for i, (_, names) in enumerate(floors):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (i, name)
    return best[0] if best else None


def _arrows_up(graph: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Each import (lazy ones too) from a module to one on a higher floor, and each module no floor names."""
    unplaced = sorted(f"{name}: on no floor" for name in graph if _floor(name, floors) is None)
    return unplaced + sorted(f"{name} -> {dep}" for name, deps in graph.items() for dep in deps
                             if _floor(name, floors) is not None and (_floor(dep, floors) or 0) > _floor(name, floors))


def test_no_arrow_back_up_anywhere():
    assert _arrows_up(_graph()) == []


def test_the_floor_check_catches_an_arrow_up_and_a_module_on_no_floor():
    floors = (("low", ("pkg.low",)), ("high", ("pkg.high", "pkg")))
    assert _arrows_up({"pkg.high.a": {"pkg.low.b"}, "pkg.low.b": set()}, floors) == []
    assert _arrows_up({"pkg.low.b": {"pkg.high.a"}, "pkg.high.a": set()}, floors) == ["pkg.low.b -> pkg.high.a"]
    assert _arrows_up({"pkg.low.b": {"pkg"}, "pkg": set()}, floors) == ["pkg.low.b -> pkg"]
    assert _arrows_up({"other.c": set()}, floors) == ["other.c: on no floor"]


ABOVE_CHECKING = ("attn_spec.properties", "attn_spec.diagnosis", "attn_spec.run", "attn_spec.api", "attn_spec.report",
                  "attn_spec.grading", "attn_spec.commands", "attn_spec.cli", "attn_spec.lessons",
                  "attn_spec.mistake_lessons", "attn_spec.pytest_plugin")


def _above_checking(module: str, deps) -> list[str]:
    """The imports of a module of the catalog that reach above checking/ (its own package is the catalog)."""
    return sorted(f"{module} -> {dep}" for dep in deps if not dep.startswith("attn_spec.properties")
                  and (dep == "attn_spec" or any(dep == a or dep.startswith(a + ".") for a in ABOVE_CHECKING)))


def test_the_catalog_imports_nothing_above_checking():
    """properties/ states behaviours with checking/'s tools; it neither runs (run, api), renders (report) nor
    words causes (diagnosis)."""
    assert [edge for name, deps in _graph().items() if name.startswith("attn_spec.properties")
            for edge in _above_checking(name, deps)] == []


def test_the_catalog_check_catches_a_property_that_imports_the_diagnosis(tmp_path):
    snippet = tmp_path / "prop.py"
    snippet.write_text("from attn_spec.checking.catalog import prop\nfrom attn_spec.properties.inputs import near\n"
                       "def f():\n    from attn_spec.diagnosis import MISTAKES\n", encoding="utf-8")
    deps = _imports("attn_spec.properties.prop", snippet, _modules())
    assert _above_checking("attn_spec.properties.prop", deps) == [
        "attn_spec.properties.prop -> attn_spec.diagnosis"]


def _causes_named(source: str) -> set[str]:
    """The cause keys ``source`` names: the first argument of each ``because("key", ...)``."""
    return {node.args[0].value for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
            and getattr(node.func, "id", None) == "because" and node.args and isinstance(node.args[0], ast.Constant)}


def test_every_cause_the_catalog_names_is_worded_by_the_diagnosis_and_no_wording_is_dead():
    """A property names a cause by key (attn_spec.failures.because); attn_spec.diagnosis.causes words each one."""
    from attn_spec.diagnosis.causes import WORDS

    named = set()
    for path in (ROOT / "properties").rglob("*.py"):
        named |= _causes_named(path.read_text(encoding="utf-8"))
    assert len(named) > 30, "no cause keys found: the scan is broken"
    assert sorted(named - set(WORDS)) == [] and sorted(set(WORDS) - named) == []


def test_the_cause_scan_reads_a_key():
    assert _causes_named('fail("x", cause=because("causal-off-by-one"))\nbecause(name)') == {"causal-off-by-one"}


# Each rule of attention is written once (attn_spec/reference.py, the budget in checking/tolerance.py) and called
# everywhere else. Code that models a wrong rule on purpose (a function named for a mistake, or registered by a
# ``mistake`` decorator) is left out: it must spell the rule it gets wrong.
RULES = {  # rule -> (the pattern that spells it in code, the one file allowed to)
    "K/V grouping (h // g)": (r"\.repeat_interleave\(", "attn_spec/reference.py"),
    "the causal offset": (r"\b(n_kv|n_k|Tk)\s*-\s*(n_q|Tq)\b|shape\[-2\]\s*-\s*n_q\b|\(L - S\)",
                          "attn_spec/reference.py"),
    "which keys a query sees": (r"\bj\s*(<=|>)\s*i\b|\[None, :\]\s*(<=|>)|\.tril\(", "attn_spec/reference.py"),
    "the earned budget": (r"\bFLOOR_ULPS\b", "attn_spec/checking/tolerance.py"),
}


def _restated(source: str, pattern: str) -> list[int]:
    """The lines whose code (strings and comments left out) matches ``pattern``, outside mistake models."""
    import io
    import re
    import tokenize

    exempt = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and (
                "mistake" in node.name or any("mistake" in ast.unparse(d) for d in node.decorator_list)):
            exempt |= set(range(node.lineno, node.end_lineno + 1))
    lines = [list(line) for line in source.splitlines()]
    words = {tokenize.STRING, tokenize.COMMENT, getattr(tokenize, "FSTRING_MIDDLE", tokenize.STRING)}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in words:  # blanked where it stands, so the code around it keeps its columns
            for row in range(tok.start[0], tok.end[0] + 1):
                line = lines[row - 1]
                start, end = tok.start[1] if row == tok.start[0] else 0, tok.end[1] if row == tok.end[0] else len(line)
                line[start:end] = " " * (end - start)
    return [n for n, line in enumerate(map("".join, lines), 1) if n not in exempt and re.search(pattern, line)]


def test_each_rule_of_attention_is_written_once():
    found = []
    for path in sorted((ROOT / "attn_spec").rglob("*.py")) + sorted((ROOT / "properties").rglob("*.py")):
        where = path.relative_to(ROOT).as_posix()
        source = path.read_text(encoding="utf-8")
        found += [f"{rule}: {where}:{n}" for rule, (pattern, home) in RULES.items() if where != home
                  for n in _restated(source, pattern)]
    assert found == [], "call attn_spec.reference / checking.tolerance.earned instead of restating the rule"


def test_the_rule_checker_finds_a_restated_rule_and_spares_a_mistake_model():
    source = '''
def grouped(k, g):
    return k.repeat_interleave(g, dim=-3)  # "k.repeat_interleave" in a comment is not code


def allowed(n_q, n_kv, device):
    offset = n_kv - n_q
    return torch.arange(n_kv, device=device)[None, :] <= torch.arange(n_q)[:, None] + offset


def budget(naive, unit):
    return FACTOR * naive + FLOOR_ULPS * unit


@mistake("causal-off-by-one")
def off_by_one(i, j):
    return j <= i - 1


def words():
    return "j <= i + n_kv - n_q, FLOOR_ULPS"
'''
    hits = {rule: _restated(source, pattern) for rule, (pattern, _) in RULES.items()}
    assert hits == {"K/V grouping (h // g)": [3], "the causal offset": [7], "which keys a query sees": [8],
                    "the earned budget": [12]}
