"""`attn-spec grade` on a class of ordinary and hostile submissions (tests/submissions/).

The folder is graded once per module (two jobs, the quick profile, small limits); each test then
checks one submission's outcome and score, or one property of the outputs.
"""
from __future__ import annotations

import csv
import hashlib
import html
import json
import os
import re
import shutil
import tempfile
import tomllib
from pathlib import Path

import pytest
import torch

from attn_spec.cli import main
from attn_spec.grading import rubric as rubrics
from attn_spec.grading.isolation import wire
from attn_spec.grading.grader import OUTCOMES
from attn_spec.grading.isolation.scan import scan
from grading_run import HERE, ROOT, grade, rubric

# Every test here grades a class in real processes (a module fixture grades it once: about 30 s): the fast lane
# leaves them out (pytest -m 'not slow'); test_grade_fairness, test_grade_security and test_attacks keep
# grading's processes in it.
pytestmark = pytest.mark.slow

OUTPUT_KB = 8
RUBRIC = rubric(OUTPUT_KB)
CORRECT = ["correct_seed", "correct_einsum_mha", "correct_float64", "correct_folder", "flood", "vandal"]


def _digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    base = tmp_path_factory.mktemp("grade")
    subs, out = base / "submissions", base / "out"
    shutil.copytree(HERE / "submissions", subs, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(subs / "buggy_no_scale.py", subs / "buggy_no_scale_again.py")  # the same code, graded twice
    bystander = base / "bystander.txt"
    bystander.write_text("keep me")
    out.mkdir()
    if ROOT:  # without privilege separation there is nothing to protect them: see docs/grading.md
        (subs / "vandal" / "targets.txt").write_text(f"{subs}\n{out}\n{bystander}\n")
        (subs / "forger" / "targets.txt").write_text(f"{out}\n")
    before = _digest(subs)
    (base / "rubric.toml").write_text(RUBRIC)
    # The grader's TMPDIR: its scratch folders are this run's alone (xdist runs other graders meanwhile). Under
    # /tmp, as the sandbox users must be able to enter it (test_a_tmpdir_the_sandbox_users_cannot_enter...).
    scratch = Path(tempfile.mkdtemp(prefix="attn-spec-test-scratch-"))
    scratch.chmod(0o711)
    run = grade(subs, "--out", out, "--rubric", base / "rubric.toml", "--jobs", 2,
               env={**os.environ, "TMPDIR": str(scratch)})
    grades = json.loads((out / "grades.json").read_text())
    by_name = {s["name"]: s for s in grades["submissions"]}
    yield {"run": run, "out": out, "subs": subs, "grades": grades, "by": by_name, "before": before,
           "bystander": bystander, "base": base, "scratch": scratch}
    shutil.rmtree(scratch, ignore_errors=True)


def _points(sub, status=None, convention=None):
    return {(p["convention"], p["id"]): p["status"] for p in sub["properties"]
            if (status is None or p["status"] == status) and (convention is None or p["convention"] == convention)}


def test_the_run_finishes_and_grades_everyone(graded):
    assert graded["run"].returncode == 0, graded["run"].stderr
    names = {p.stem if p.is_file() else p.name for p in graded["subs"].iterdir() if not p.name.startswith((".", "_"))}
    assert set(graded["by"]) == names
    assert f"graded {len(names)} submission(s)" in graded["run"].stdout


@pytest.mark.parametrize("name", CORRECT)
def test_no_correct_submission_loses_a_point(graded, name):
    sub = graded["by"][name]
    assert sub["outcome"] == "graded", sub["detail"]
    assert all(p["points"] == p["max_points"] for p in sub["properties"]), \
        [p for p in sub["properties"] if p["points"] != p["max_points"]]
    assert sub["score"] == sub["max_score"] + sub["bonus"] and sub["max_score"] > 0


def test_the_optional_module_is_a_bonus_that_never_lowers_a_grade(graded):
    """The default policy: a module attempted with one bug ends no lower than no module at all."""
    both, view, seed = graded["by"]["correct_einsum_mha"], graded["by"]["buggy_heads_view"], graded["by"]["correct_seed"]
    assert both["found"] == ["function", "module"] and "module" not in seed["found"]
    assert _points(both, convention="module")[("module", "head-concat-equivalence")] == "pass"
    assert _points(view, convention="module")[("module", "head-concat-equivalence")] == "fail"
    assert all(p["points"] == p["max_points"] for p in view["properties"] if p["convention"] == "function")
    assert both["max_score"] == view["max_score"] == seed["max_score"]  # the module adds to no maximum
    assert seed["score"] < view["score"] < both["score"] and 0 < view["bonus"] < both["bonus"]
    assert "bonus" in {p["counts"] for p in view["properties"] if p["convention"] == "module"} <= {"bonus", "no"}
    feedback = (graded["out"] / "feedback" / "buggy_heads_view.md").read_text()
    assert "Optional, a bonus" in feedback and "bonus)" in feedback
    assert "Optional, a bonus" in (graded["out"] / "feedback" / "correct_seed.md").read_text()  # shown when absent


@pytest.mark.parametrize("name, conv, mistake", [
    ("buggy_no_scale", "function", "scale-missing"),
    ("buggy_softmax_dim", "function", "softmax-over-queries"),
    ("buggy_in_place", "function", "queries-scaled-in-place"),
    ("buggy_heads_view", "module", "heads-split-without-transpose"),
    ("buggy_mask_after_softmax", "function", "mask-after-softmax"),
])
def test_one_bug_is_one_named_root_and_costs_its_points_once(graded, name, conv, mistake):
    """Issue 26: each single-bug submission of the class gets one root, naming its bug, which explains every
    failure; it is charged once, at the weight of the most important property it breaks (issue 38: the
    mask applied after the softmax, whose root is mask-semantics, worth 1, cost 1 although it breaks
    rows-sum-to-one, worth 2), and its maximum is everyone's."""
    sub, correct = graded["by"][name], graded["by"]["correct_seed"]
    assert [(d["convention"], d["mistake"]) for d in sub["roots"]] == [(conv, mistake)]
    root = sub["roots"][0]
    rows = {p["id"]: p for p in sub["properties"] if p["convention"] == conv}
    failed = [p["id"] for p in rows.values() if p["status"] != "pass" and p["status"] != "n/a"]
    assert failed and sorted(root["explains"]) == sorted(failed)
    assert all(rows[p]["explained_by"] == mistake for p in failed)
    assert all(rows[p]["blocked_by"] == root["root"] for p in failed if p != root["root"])
    lost = max(rows[p]["max_points"] for p in failed)  # the most important property it breaks
    charged = [p for p in failed if rows[p]["points"] < rows[p]["max_points"]]
    assert [rows[p]["max_points"] - rows[p]["points"] for p in charged] == [lost]  # charged once; the rest keep theirs
    assert sub["max_score"] == correct["max_score"]
    full = correct["max_score"] if conv == "function" else sum(p["max_points"] for p in rows.values())
    assert (sub["score"] if conv == "function" else sub["bonus"]) == pytest.approx(full - lost)
    feedback = (graded["out"] / "feedback" / f"{name}.md").read_text()
    for words in (f"### Root 1 of 1: {root['sentence']} [{mistake}]", f"- fix: {root['fix']}", "- evidence: reproduces",
                  f"- charged: {lost:g} point{'' if lost == 1 else 's'}, the weight of {charged[0]}, the",
                  "- explains: ", f"`attn-spec explain {mistake}`", "attn_spec.reproduce(", "counterexample"):
        assert words in feedback, words


def test_a_nan_output_earns_nothing(graded):
    """NaN whatever the inputs ignores them: determinism, inputs-unchanged and dtype-device are vacuous too."""
    sub = graded["by"]["returns_nan"]
    rows = {p["id"]: p for p in sub["properties"]}
    assert sub["score"] == 0 and sub["max_score"] == graded["by"]["correct_seed"]["max_score"]
    assert all(rows[p]["vacuous"] and rows[p]["points"] == 0 for p in ("determinism", "inputs-unchanged", "dtype-device"))


@pytest.mark.parametrize("name, failing, passing", [
    ("buggy_no_scale", "scale-sqrt-dk", "rows-sum-to-one"),
    ("buggy_softmax_dim", "rows-sum-to-one", "inputs-unchanged"),
    ("buggy_in_place", "inputs-unchanged", "rows-sum-to-one"),  # its edit reaches the grader's tensors
    ("returns_nan", "matches-reference", None),
    ("patches_kit", "matches-reference", None),
    ("forger", "matches-reference", None),
])
def test_wrong_attention_loses_the_properties_it_breaks(graded, name, failing, passing):
    sub = graded["by"][name]
    statuses = _points(sub, convention="function")
    assert sub["outcome"] == "graded"
    assert statuses[("function", failing)] == "fail"
    if passing:
        assert statuses[("function", passing)] == "pass"
    assert sub["score"] < sub["max_score"]


@pytest.mark.parametrize("name", ["patches_kit", "returns_constant", "returns_values"])  # zeros (in its own process), 0.5, V
def test_an_output_that_ignores_its_inputs_scores_at_most_a_tenth(graded, name):
    """Issue 14: trivial submissions score at most 10% under the default rubric (of the one max_score)."""
    sub, full = graded["by"][name], graded["by"]["correct_seed"]["max_score"]
    assert sub["outcome"] == "graded" and sub["max_score"] > 0
    assert sub["score"] <= 0.1 * min(sub["max_score"], full), [p["id"] for p in sub["properties"] if p["points"]]
    assert not _points(sub, status="pass", convention="function")
    vacuous = [p for p in sub["properties"] if p["vacuous"]]
    assert vacuous and all(p["points"] == 0 and p["counts"] == "score" for p in vacuous)  # charged: no credit


@pytest.mark.parametrize("name, outcome, words", [
    ("syntax_error", "syntax-error", "line 3"),
    ("missing_import", "import-error", "line 3 of missing_import.py imports the module "
                                       "'flash_attn_unavailable_module', which does not exist"),
    ("misspelled_import", "import-error", "line 3 of misspelled_import.py imports the module 'torch.nn.functinal', "
                                          "which does not exist: no such module in Python, its installed packages or "
                                          "the submission's own files (did you mean 'torch.nn.functional'?)"),
    ("missing_attention", "missing-attention", "attention is not defined"),
    ("loop_in_function", "timeout", "took longer than 4 s"),
    ("sleeps", "timeout", "took longer than 4 s"),
    ("loop_at_import", "timeout", "importing the submission took longer than 5 s"),
    ("exits", "exited", "exit status 3"),
    ("os_exit", "exited", "os._exit"),
    ("segfault", "crashed", "SIGSEGV"),
    ("breaks_grading", "crashed", "the grading code in its process failed"),
    ("memory_hog", "memory-limit", "out of memory"),
    ("lying_subclass", "bad-output", "torch.Tensor subclass AlwaysRight"),
    ("returns_list", "bad-output", "returned list"),
    ("returns_complex", "bad-output", "returned a complex tensor (torch.complex64)"),
    ("returns_meta", "bad-output", "returned a tensor on the meta device"),
])
def test_each_hostile_submission_gets_its_outcome_and_nothing_it_did_not_earn(graded, name, outcome, words):
    sub = graded["by"][name]
    assert sub["outcome"] == outcome
    assert words in sub["detail"]
    assert sub["score"] == 0 and sub["max_score"] > 0
    assert not _points(sub, status="pass")


def test_a_forbidden_call_is_reported_with_the_property_results(graded):
    sdpa, hidden = graded["by"]["forbidden_sdpa"], graded["by"]["forbidden_hidden"]
    for sub in (sdpa, hidden):
        assert sub["outcome"] == "forbidden" and sub["score"] == 0
        assert _points(sub)[("function", "matches-reference")] == "pass"  # still shown: it computes the right thing
        assert sum(p["points"] for p in sub["properties"]) > 0  # earned, then removed by the penalty
    assert {"name": "torch.nn.functional.scaled_dot_product_attention", "line": 6,
            "how": "named in the source"} in sdpa["forbidden"]
    assert [h["how"] for h in hidden["forbidden"]] == ["called while grading"] * len(hidden["forbidden"])
    assert "attn_spec.reference.reference_attention" in {h["name"] for h in hidden["forbidden"]}
    assert "Forbidden calls" in (graded["out"] / "feedback" / "forbidden_hidden.md").read_text()


def test_the_same_submission_always_gets_the_same_grade(graded):
    first, again = graded["by"]["buggy_no_scale"], graded["by"]["buggy_no_scale_again"]
    assert first["score"] == again["score"]
    assert [(p["id"], p["status"]) for p in first["properties"]] == [(p["id"], p["status"]) for p in again["properties"]]
    assert [p["counterexample"]["case"] for p in first["properties"] if p["counterexample"]] == \
           [p["counterexample"]["case"] for p in again["properties"] if p["counterexample"]]


def test_output_is_captured_and_truncated(graded):
    flood = graded["by"]["flood"]
    assert flood["output"].startswith("loading line 0 ")
    assert "more bytes not kept" in flood["output"] and len(flood["output"]) < OUTPUT_KB * 1024 + 100


def test_printed_and_written_forgeries_change_nothing(graded):
    forger = graded["by"]["forger"]
    assert "All tests passed" in forger["output"]  # it printed its forgery; the grade ignores it
    assert forger["score"] < forger["max_score"]
    assert not (graded["subs"] / "grades.json").exists()
    assert "forger,100" not in (graded["out"] / "grades.csv").read_text()
    assert "Score: 100" not in (graded["out"] / "feedback" / "forger.md").read_text().split("## What your code printed")[0]


@pytest.mark.skipif(not ROOT, reason="children run as the grader's own user when it is not root (docs/grading.md)")
def test_the_files_around_survive(graded):
    assert graded["bystander"].read_text() == "keep me"
    after = _digest(graded["subs"])
    assert {k: v for k, v in after.items() if not k.endswith("targets.txt")} == \
           {k: v for k, v in graded["before"].items() if not k.endswith("targets.txt")}
    assert not list(graded["out"].rglob("pwned.txt"))
    assert "PermissionError" in graded["by"]["vandal"]["output"]
    assert graded["by"]["vandal"]["sandbox"]["user"].endswith("(unprivileged)")


def test_no_scratch_folder_or_process_is_left_behind(graded):
    """The run's scratch folders are gone, and so are its processes: the zygote and every child work in
    a folder under the run's TMPDIR (other tests' graders, under xdist, work under theirs)."""
    scratch = str(graded["scratch"])
    assert not list(graded["scratch"].glob("attn-spec-grade-*"))
    workers = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if os.readlink(proc / "cwd").startswith(scratch):
                workers.append(proc.name)
        except OSError:
            pass
    assert not workers  # the zygote, its monitors and every child are gone


@pytest.mark.skipif(not ROOT, reason="without root the children run as the grader's own user")
def test_a_tmpdir_the_sandbox_users_cannot_enter_is_refused_before_grading(tmp_path):
    """Scratch folders under a 0700 folder would make every submission an import-error ("Permission
    denied"), charged to students for the grader's set-up: the grader refuses it and says why."""
    closed = tmp_path / "private"
    closed.mkdir(mode=0o700)
    run = grade(HERE / "submissions", "--out", tmp_path / "out", env={**os.environ, "TMPDIR": str(closed)})
    assert run.returncode == 2, run.stderr
    assert f"would go under {closed}, but the sandbox users cannot enter" in run.stderr and "Set TMPDIR" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "out" / "grades.csv").exists()


def test_grades_json_has_the_documented_shape(graded):
    data = graded["grades"]
    assert data["rubric"]["profile"] == "quick" and data["rubric"]["seed"] == 7
    for sub in data["submissions"]:
        assert isinstance(sub["name"], str) and sub["outcome"] in OUTCOMES
        assert isinstance(sub["score"], float) and isinstance(sub["max_score"], float)
        assert 0 <= sub["score"] <= sub["max_score"] + sub["bonus"]
        assert isinstance(sub["feedback"], str) and sub["feedback"].startswith(f"# Feedback for {sub['name']}\n")
        assert sub["feedback"] == (graded["out"] / "feedback" / sub["feedback_file"]).read_text()
        for prop in sub["properties"]:
            assert isinstance(prop["id"], str) and isinstance(prop["status"], str)
            assert isinstance(prop["points"], float) and 0 <= prop["points"] <= prop["max_points"]


def test_csv_summary_and_feedback_files(graded):
    out = graded["out"]
    rows = {r["name"]: r for r in csv.DictReader((out / "grades.csv").open())}
    assert list(rows) == [s["name"] for s in graded["grades"]["submissions"]]
    seed, no_scale = rows["correct_seed"], rows["buggy_no_scale"]
    assert seed["function:rows-sum-to-one"] == "2" and no_scale["function:scale-sqrt-dk"] == "0"
    not_applicable = [p for p in graded["by"]["correct_seed"]["properties"] if p["status"] == "n/a"]
    assert not_applicable and all(seed[f"function:{p['id']}"] == "n/a" for p in not_applicable)  # n/a is not 0
    assert seed["module:head-concat-equivalence"] == ""  # no module: not graded at all
    assert no_scale["function:matches-reference"] == "2" and seed["feedback"] == "correct_seed.md"  # a symptom
    summary = (out / "summary.md").read_text()
    assert "## The class's mistakes" in summary and "| scale-missing | function | 2 of " in summary
    assert "`attn-spec explain scale-missing`" in summary and "## Failures no mistake explains" in summary
    view = json.loads((out / "summary.json").read_text())
    scale = next(m for m in view["mistakes"] if m["mistake"] == "scale-missing")
    assert set(scale["students"]) == {"buggy_no_scale", "buggy_no_scale_again"}
    loaded = {s["name"] for s in graded["grades"]["submissions"] if s["outcome"] in ("syntax-error", "import-error")}
    assert loaded and not any(loaded & set(u["students"]) for u in view["unexplained"])  # load failures left out
    page = (out / "summary.html").read_text()
    assert "Who made which mistake" in page and "buggy_no_scale" in page
    feedback = (out / "feedback" / "buggy_no_scale.md").read_text()
    for words in ("Score:", "scale-sqrt-dk", "likely cause", "counterexample", "attn_spec.reproduce("):
        assert words in feedback
    assert len(list((out / "feedback").glob("*.md"))) == len(graded["by"])


def _html_table(page: str, title: str) -> list[list[str]]:
    """The cells of each row of the table titled ``title`` in summary.html."""
    table = page.split(f"<h2>{title}</h2>", 1)[1].split("</table>", 1)[0]
    return [cells for row in re.findall(r"<tr>(.*?)</tr>", table) if (cells := re.findall(r"<td[^>]*>(.*?)</td>", row))]


def test_summary_html_holds_summary_mds_tables_and_a_histogram(graded):
    """Issue 38.1: summary.html left out the scores, outcomes and names (the mistakes' students were a bare
    count), so an import error and every score were invisible on the page."""
    page = (graded["out"] / "summary.html").read_text()
    subs = graded["grades"]["submissions"]
    assert {row[0]: (row[1], row[2]) for row in _html_table(page, "Submissions")} == \
        {html.escape(s["name"]): (f"{s['score']:g} / {s['max_score']:g}", s["outcome"]) for s in subs}
    assert {row[0]: int(row[1]) for row in _html_table(page, "Outcomes")} == graded["grades"]["outcomes"]
    assert "import-error" in graded["grades"]["outcomes"] and "misspelled_import" in page
    view = json.loads((graded["out"] / "summary.json").read_text())
    mistakes = {row[0]: row[3] for row in _html_table(page, "The class's mistakes")}
    assert mistakes == {m["mistake"]: html.escape(", ".join(m["students"])) for m in view["mistakes"]}
    unexplained = _html_table(page, "Failures no mistake explains")
    assert [row[3] for row in unexplained] == [html.escape(", ".join(u["students"])) for u in view["unexplained"]]
    svg = page.split("<h2>Scores</h2>", 1)[1].split("</svg>", 1)[0]
    counts = [int(n) for n in re.findall(r"text-anchor='middle'>(\d+)</text>", svg)]
    assert sum(counts) == sum(1 for s in subs if s["max_score"])  # every graded student is in one bar
    tips = {t.split(": ", 1)[0]: t.split(": ", 1)[1].split(", ") for t in re.findall(r"<title>(.*?)</title>", svg)}
    assert set(tips["100%"]) == {html.escape(s["name"]) for s in subs if s["max_score"] and s["score"] - s["bonus"] >= s["max_score"]}
    assert "buggy_no_scale" in tips["90-99%"] and "returns_nan" in tips["0-9%"]
    heatmap = page.split("<h2>Who made which mistake</h2>", 1)[1].split("</table>", 1)[0]
    assert "buggy_no_scale_again" in heatmap and heatmap.count("class='x'") == sum(len({d["mistake"] for d in s["roots"]}) for s in subs)


def test_gradescope_results_follow_the_published_fields(tmp_path, capsys, graded):
    rubric = tmp_path / "rubric.toml"
    rubric.write_text(RUBRIC)
    code = main(["grade", str(HERE / "submissions" / "buggy_no_scale.py"), "--gradescope",
                 "--out", str(tmp_path / "results"), "--rubric", str(rubric)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"wrote grades.csv, grades.json, summary.md, summary.json, summary.html, results.json and feedback/ in {tmp_path / 'results'}" in out
    assert "can read the others" not in err  # one submission: there are no others
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert isinstance(results["score"], float) and results["output"]
    assert {t["status"] for t in results["tests"]} == {"passed", "failed"}
    for test in results["tests"]:
        assert set(test) >= {"name", "score", "max_score", "status", "output", "visibility"}
        assert test["visibility"] == "visible" and test["score"] <= test["max_score"]
        # the status follows the score: a symptom that keeps its points is not shown failed with full points
        assert (test["status"] == "failed") == (test["score"] < test["max_score"]), test
    symptoms = [t for t in results["tests"] if "symptom" in t["tags"]]
    assert symptoms and all(t["output"].startswith("fails, not charged: explained by the mistake scale-missing")
                            for t in symptoms)
    assert "Mistakes found (1)" in results["output"] and "`scale-missing` (function)" in results["output"]
    assert results["score"] == sum(t["score"] for t in results["tests"])
    assert results["extra_data"]["max_score"] == sum(t["max_score"] for t in results["tests"])  # the same percentage
    assert results["score"] == graded["by"]["buggy_no_scale"]["score"]  # graded alone (--jobs 1) or by a judge


def test_a_judge_that_dies_costs_only_the_submission_it_was_grading(tmp_path, monkeypatch):
    from attn_spec.grading import grader as grading
    from attn_spec.grading.pool import grade_all
    from attn_spec.grading.submissions import discover

    for name in ("a", "victim", "b", "c"):
        shutil.copy(HERE / "submissions" / "correct_seed.py", tmp_path / f"{name}.py")
    rubric = rubrics.load(None)
    real_grade = grading.Grader.grade
    monkeypatch.setattr(grading.Grader, "grade",  # runs in the judge processes, forked from this one
                        lambda self, sub: os._exit(3) if sub.name == "victim" else real_grade(self, sub))
    grades = {g.name: g for g in grade_all(discover(str(tmp_path), rubric), rubric, jobs=2)}
    assert grades["victim"].outcome == "grader-error" and "judge process" in grades["victim"].detail
    assert [grades[n].outcome for n in ("a", "b", "c")] == ["graded"] * 3  # the other judge graded the rest
    assert all(grades[n].score == grades[n].max_score > 0 for n in ("a", "b", "c"))


def test_usage_errors_are_clear(tmp_path, capsys):
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "a.py").write_text("def attention(Q, K, V, mask=None):\n    return V\n")
    assert main(["grade", str(subs), "--out", str(subs / "grades")]) == 2
    assert "inside the submissions folder" in capsys.readouterr().err
    assert main(["grade", str(subs)]) == 2
    assert "give SUBMISSIONS and --out DIR" in capsys.readouterr().err
    assert main(["grade", str(subs), "--out", str(tmp_path / "o"), "--jobs", "0"]) == 2
    assert "--jobs must be at least 1" in capsys.readouterr().err


# ---------------------------------------------------------------- rubric, scan and wire, in-process


def test_print_rubric_prints_the_default_rubric(capsys):
    assert main(["grade", "--print-rubric"]) == 0
    assert tomllib.loads(capsys.readouterr().out) == tomllib.loads(rubrics.DEFAULT_RUBRIC)


def test_rubric_defaults_and_errors():
    rubric = rubrics.load(None)
    rubric.check_catalog()
    assert rubric.conventions["function"].points_for("rows-sum-to-one") == 2
    assert rubric.conventions["function"].points_for("some-future-property") == 1.0  # default_points
    custom = rubrics.parse('[function]\ndefault_points = 3\n[function.points]\ncausal-mask = 5\n')
    assert custom.conventions["function"].points_for("causal-mask") == 5
    assert custom.conventions["function"].points_for("rows-sum-to-one") == 3  # its table replaces the default's
    for text, words in [('colour = "red"', "unknown key(s) colour"),
                        ('[function.points]\nno-such-property = 1', "unknown property 'no-such-property'"),
                        ('profile = "fast"', "profile='fast'"),
                        ('[function.points]\nhead-concat-equivalence = 1', "does not apply to the function convention"),
                        ('[forbidden]\ncalls = ["torch.nn.functional.no_such_thing"]', "names nothing"),
                        ('[forbidden]\npenalty = 2', "at most 1.0"),
                        ('[limits]\ncall_seconds = 0', "positive number")]:
        with pytest.raises(rubrics.RubricError, match=words.replace("(", r"\(").replace(")", r"\)")):
            rubrics.parse(text).check_catalog()


def test_scan_follows_import_aliases_but_not_the_students_own_names():
    forbidden = ["torch.nn.functional.scaled_dot_product_attention", "attn_spec.reference.*"]
    source = b"""
import torch.nn.functional as F
from torch.nn import functional
from attn_spec import reference
def scaled_dot_product_attention(q, k, v):
    return q
out = scaled_dot_product_attention(1, 2, 3)
a = F.scaled_dot_product_attention
b = functional.scaled_dot_product_attention
"""
    hits = scan(source, "x.py", forbidden)["forbidden"]
    assert hits == [{"name": "attn_spec.reference", "line": 4},
                    {"name": "torch.nn.functional.scaled_dot_product_attention", "line": 8},
                    {"name": "torch.nn.functional.scaled_dot_product_attention", "line": 9}]
    assert scan(b"def f(:\n", "x.py", forbidden)["syntax_error"]["line"] == 1


def test_wire_keeps_strides_and_refuses_what_it_does_not_carry():
    import socket

    a, b = socket.socketpair()
    sender, receiver = wire.Channel(a), wire.Channel(b)
    q = torch.arange(6.0).reshape(2, 3).t()  # transposed
    k = torch.tensor([1.0, 2.0]).expand(3, 2)  # stride 0
    sender.send({"op": "x"}, [q, k, torch.ones(0, 4, dtype=torch.bfloat16)])
    header, (q2, k2, e2) = receiver.recv()
    assert header["op"] == "x" and torch.equal(q2, q) and q2.stride() == q.stride()
    assert torch.equal(k2, k) and k2.stride() == (0, 1) and e2.shape == (0, 4) and type(q2) is torch.Tensor
    for record in ({"dtype": "complex64", "shape": [1], "strides": [1], "nbytes": 8, "device": "cpu"},
                   {"dtype": "float32", "shape": [2], "strides": [1], "nbytes": 4, "device": "cpu"},
                   {"dtype": "float32", "shape": [1], "strides": [1], "nbytes": 4, "device": "meta"}):
        head = json.dumps({"tensors": [record]}).encode()
        a.sendall(len(head).to_bytes(4, "big") + head)
        with pytest.raises(wire.ProtocolError):
            receiver.recv()
    a.sendall((5).to_bytes(4, "big") + b"[[[[[")
    with pytest.raises(wire.ProtocolError):
        receiver.recv()
