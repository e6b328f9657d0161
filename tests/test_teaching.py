"""The teaching side: ``attn-spec list`` and ``explain``, the sympy derivations, the HTML report
(``--format html``, ``Report._repr_html_``, rendered by headless Chromium when there is one) and the
tutorial script, whose printed failures must match what its text announces."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import pytest

import attn_spec
from attn_spec import lessons, reference, symbolic
from attn_spec.properties import catalog

REGISTRY = catalog()
DERIVATIONS = {pid: p.derivation for pid, p in REGISTRY.items() if p.derivation}
from attn_spec.cli import main
from attn_spec.report.html import heatmaps, to_html

REPO = Path(__file__).resolve().parents[1]
IDS = list(REGISTRY)


def test_list_shows_every_property(capsys):
    assert main(["list"]) == 0
    text = capsys.readouterr().out
    assert all(pid in text for pid in IDS)
    assert main(["list", "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert md.startswith("| id") and all(f"| {pid} " in md for pid in IDS)
    for p in REGISTRY.values():
        assert f"| {p.family} " in md and p.statement in md


def test_every_property_has_its_lesson_beside_its_check():
    missing = sorted(pid for pid, p in REGISTRY.items() if p.lesson is None)
    assert not missing, f"give these properties a lesson=Lesson(...) in their @prop: {missing}"
    assert all(p.lesson.example in lessons.EXAMPLES for p in REGISTRY.values()), "a lesson names no worked example"
    for pid, derive in DERIVATIONS.items():  # a derivation lives in the module of its property
        assert derive.__module__ == REGISTRY[pid].fn.__module__, pid


@pytest.mark.slow
@pytest.mark.parametrize("pid", IDS)
def test_explain_every_property(pid, capsys):
    sections = lessons.lesson_sections(pid)
    for key in ("unicode", "latex", "math", "why", "breaks", "example", "check"):
        assert sections[key].strip(), f"{pid}: empty section {key!r}"
    assert re.search(r"\d\.\d", sections["example"]), f"{pid}: the worked example shows no computed numbers"
    assert main(["explain", pid]) == 0
    text = capsys.readouterr().out
    assert all(lessons.TITLES[key] in text for key in lessons.SECTIONS) and sections["unicode"] in text
    assert main(["explain", pid, "--format", "markdown"]) == 0
    md = capsys.readouterr().out
    assert f"$$\n{sections['latex']}\n$$" in md and md.count("```") >= 2
    has_derivation = REGISTRY[pid].derivation is not None
    assert (lessons.TITLES["derivation"] in text) == has_derivation
    if has_derivation:
        assert md.count("$$") >= 2 * (1 + len(lessons.derivation_steps(pid)))


def test_unknown_id_is_a_usage_error(capsys):
    assert main(["explain", "no-such-property"]) == 2
    err = capsys.readouterr().err
    assert "no-such-property" in err and all(pid in err for pid in IDS)


def test_derivations_justify_catalog_properties():
    assert set(DERIVATIONS) <= set(REGISTRY)
    assert set(DERIVATIONS) == {"rows-sum-to-one", "key-shift-invariance", "scale-sqrt-dk",
                                "gradients", "head-concat-equivalence"}


@pytest.mark.parametrize("pid", list(DERIVATIONS))
def test_derivation_holds(pid):
    steps = lessons.derivation_steps(pid)
    assert len(steps) >= 3 and all(text and expr is not None for text, expr in steps)


@pytest.mark.parametrize("pid", list(DERIVATIONS))
def test_derivation_breaks_when_the_reference_scale_changes(pid, monkeypatch):
    original = reference.attention

    def scaled_by_d_k(q, k, v, mask=None, **kw):  # the classic 1/d_k bug, in the kit's own reference
        return original(q, k, v, mask, **{**kw, "scale": 1 / q.shape[-1]})

    monkeypatch.setattr(reference, "attention", scaled_by_d_k)
    with pytest.raises(symbolic.DerivationError):
        DERIVATIONS[pid]()


@pytest.mark.parametrize("pid", list(DERIVATIONS))
def test_derivation_breaks_when_the_symbolic_scale_changes(pid, monkeypatch):
    monkeypatch.setattr(symbolic, "canonical_scale", lambda d_k: 1 / d_k)
    with pytest.raises(symbolic.DerivationError):
        DERIVATIONS[pid]()


def inverted_mask(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / Q.size(-1) ** 0.5
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))  # bug: True means "may attend"
    return scores.softmax(dim=-1) @ V


class _Checker(HTMLParser):
    VOID = {"meta", "br", "hr", "img", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack, self.errors, self.tags = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


@pytest.fixture(scope="module")
def failing_report():
    return attn_spec.check(inverted_mask, profile="quick", seed=3, devices=["cpu"],
                           only=["causal-mask", "scale-sqrt-dk", "mask-semantics"])


def test_html_report_is_self_contained_with_heatmaps(failing_report):
    page = to_html(failing_report)
    assert page == failing_report._repr_html_()
    checker = _Checker()
    checker.feed(page)
    assert not checker.errors and not checker.stack, "unbalanced HTML"
    assert "http://" not in page and "https://" not in page and "<script" not in page and "url(" not in page
    assert {tag for tag, _ in checker.tags} >= {"html", "head", "style", "body", "table"}
    heat = [attrs for tag, attrs in checker.tags if tag == "table" and attrs.get("class") == "heat"]
    assert len(heat) >= 2, "got and expected heatmaps for the causal-mask failure"
    cells = [attrs.get("class", "") for tag, attrs in checker.tags if tag == "td"]
    assert any("masked" in c for c in cells) and any("diff" in c for c in cells)
    causal = next(p for p in failing_report.targets[0].properties if p.id == "causal-mask")
    n = len(causal.counterexample["mask"])  # the shrunk case's
    assert n >= 2 and causal.counterexample["mask"] == reference.causal_mask(n, n).tolist()
    assert "DOES NOT CONFORM" in page and "causal-mask" in page


def test_every_heatmap_of_weights_hatches_the_masked_cells(failing_report):
    """mask-semantics shows the weights read with V = identity: its heatmaps hatch the masked keys too (they did
    not, as its failure was labelled as a plain output)."""
    shown = [p for p in failing_report.targets[0].properties if p.counterexample and p.counterexample["got"]
             and "weights" in " ".join(p.counterexample["labels"])]
    assert {p.id for p in shown} >= {"causal-mask", "mask-semantics"}
    for p in shown:
        assert p.counterexample.get("mask") is not None, p.id
        assert re.search(r'<td class="[^"]*\bmasked\b', heatmaps(p.counterexample)), p.id


def test_check_format_html(tmp_path):
    out = tmp_path / "report.html"
    rc = main(["check", f"{REPO / 'examples' / 'buggy_attention.py'}:attention", "--only", "scale-sqrt-dk",
               "--profile", "quick", "--seed", "1", "--device", "cpu", "--format", "html", "--output", str(out)])
    page = out.read_text(encoding="utf-8")
    assert rc == 1 and page.startswith("<!DOCTYPE html>") and 'class="heat"' in page and "1/d_k" in page


@pytest.mark.skipif(not any(map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))),
                    reason="no chromium on this machine")
def test_html_report_renders_in_headless_chromium(failing_report, tmp_path):
    page = tmp_path / "r.html"
    page.write_text(to_html(failing_report), encoding="utf-8")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "render_html.py"), "--out",
                           str(tmp_path / "r.png"), "--from-html", str(page)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def _tutorial_steps(source: str) -> list[tuple[str, set[str]]]:
    """(title, what the text tells the reader to expect) for each '## Step' markdown cell."""
    steps = []
    for cell in source.split("# %%")[1:]:
        title = re.search(r"^# ## (Step .*)$", cell, re.M)
        if title:
            steps.append((title.group(1), set(re.findall(r"\*\*([A-Za-z-]+)\*\*", cell))))
    return steps


@pytest.mark.slow
def test_tutorial_runs_and_shows_what_it_announces():
    path = REPO / "examples" / "tutorial.py"
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240, cwd=REPO)
    assert done.returncode == 0, done.stderr
    verdicts = re.findall(r"^verdict: (.*)$", done.stdout, re.M)
    chunks = re.split(r"^verdict: .*$", done.stdout, flags=re.M)[:-1]  # one per run of the kit
    steps = _tutorial_steps(path.read_text(encoding="utf-8"))
    assert len(steps) == len(verdicts) == len(chunks) == 6
    for (title, expected), verdict, chunk in zip(steps, verdicts, chunks):
        assert expected, f"{title}: the text announces nothing"
        assert chunk.lstrip().startswith(f"## {title}\n"), f"a script run prints the step's title first:\n{chunk}"
        if expected == {"CONFORMS"}:
            assert verdict == "CONFORMS", f"{title}: announced CONFORMS, got\n{chunk}"
        else:
            assert verdict == "DOES NOT CONFORM", title
            failed = set(re.findall(r"^FAIL ([a-z-]+)", chunk, re.M))
            assert expected <= failed, f"{title}: the text announces {expected}, the kit reported {failed}"
    assert verdicts[-1] == "CONFORMS"


def test_a_nan_weight_on_a_masked_key_is_said_nan_not_inf():
    """Issue 38.6: NaN weights on masked keys (softmax over the queries of a -inf-filled mask) read "inf"."""
    import math

    import attn_spec

    def softmax_over_queries(Q, K, V, mask=None):
        scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return scores.softmax(dim=-2) @ V

    report = attn_spec.check(softmax_over_queries, only=["mask-semantics"], profile="quick", seed=3, diagnose=False)
    (result,) = report.targets[0].properties
    assert result.status == "fail" and "the largest weight on a masked key: NaN, expected exactly 0" in result.message


def test_the_table_says_explained_by_for_evidence_and_blocked_by_only_without_it():
    """Issue 38.6: failures a named root reproduces read "blocked by scale-sqrt-dk", README's word for a failure
    with no evidence of its own."""
    import attn_spec
    from attn_spec.report.text import row_verdict

    from test_cli import BUGGY

    report = attn_spec.check(f"{BUGGY}:attention", profile="quick", seed=7)
    (target,) = report.targets
    (root,) = target.diagnoses
    verdicts = {p.id: row_verdict(p, target) for p in target.failures}
    assert verdicts["scale-sqrt-dk"] == "fail (root 1)"
    for pid in root.explains[1:]:
        word = f"blocked by {root.root}" if pid in root.unproven else f"explained by {root.mistake}"
        assert verdicts[pid] == f"fail (root 1: {word})"
    assert root.evidenced[1:] and "explained by scale-one-over-dk" in str(report)


def test_the_verdict_counts_apart_the_failures_that_never_ran():
    """Issue 38.6: "16 of 27 properties fail" where the table read "not run (root 1)" for 15 of them (a target
    that raises on every masked call)."""
    import attn_spec
    from attn_spec.report.text import row_verdict
    from gallery.masking import sparse_mask

    report = attn_spec.check(sparse_mask, profile="quick", seed=1)
    (target,) = report.targets
    rows = [row_verdict(p, target) for p in target.failures]
    not_run = sum(v.startswith("not run") for v in rows)
    assert not_run and target.verdict.startswith(
        f"DOES NOT CONFORM ({len(rows) - not_run} of {len(target.properties) - sum(p.status == 'not-run' for p in target.properties)} "
        f"properties fail, {not_run} more not run")


def test_a_module_header_lists_no_batch_capability_where_batch_independence_does_not_apply():
    """Issue 38.6: the module's header listed `batch` while batch-independence "does not apply to the module
    convention"."""
    import attn_spec
    from attn_spec.reference import MultiHeadAttention
    from attn_spec.report.text import header_lines

    report = attn_spec.check(MultiHeadAttention, only=["batch-independence", "rows-sum-to-one"], profile="quick")
    (target,) = report.targets
    skipped = next(p for p in target.properties if p.id == "batch-independence")
    assert skipped.status == "skip" and "does not apply to the module convention" in skipped.message
    capabilities = next(line for line in header_lines(target) if line.startswith("capabilities: "))
    assert "batch" not in capabilities.replace("batch-independence", "") and "mask" in capabilities
