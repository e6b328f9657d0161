"""`attn-spec grade` against submissions that attack the grader (issue 14, items 1 to 9).

A class of hostile submissions (tests/submissions/_security/, plus links, a sparse file and two
names that read alike, built here) is graded once, as the grader is run in practice: with a secret
in its environment, a previous run's outputs in --out, and an unrelated process running as `nobody`.
Each test checks that one attack got nothing; the helpers below it are checked in-process.
"""
from __future__ import annotations

import csv
import json
import os
import re
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import torch

from attn_spec.cli import main
from attn_spec.grading import outputs, rubric as rubrics
from attn_spec.grading.isolation import wire, zygote
from attn_spec.grading.submissions import UID_BASE, discover, sandbox_ids
from attn_spec.report import markdown as md
from grading_run import HERE, ROOT, grade, rubric

RUBRIC = rubric(output_kb=16)
SECRETS = {"env": "grader-token-5f1e0c9a", "file": "root-only-secret-77c1", "bystander": "bystander-token-31d4",
           "previous": "previous-run-grade-a9e2"}
SHM_SIZE = 64 * 2**20 + 4321  # shm_leak.py's segments


def _folder_submission(subs: Path, name: str, targets: str) -> None:
    """Move subs/NAME.py into a folder NAME/ with targets.txt beside it."""
    folder = subs / name
    folder.mkdir()
    (subs / f"{name}.py").rename(folder / "attention.py")
    (folder / "targets.txt").write_text(targets)


def _shm_sizes() -> list[int]:
    with open("/proc/sysvipc/shm") as fh:
        return [int(row.split()[3]) for row in fh.readlines()[1:]]


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    base = tmp_path_factory.mktemp("attacks")
    subs, out = base / "class", base / "out"
    shutil.copytree(HERE / "submissions" / "_security", subs, ignore=shutil.ignore_patterns("__pycache__"))
    # 9: two names that sanitise to the same file name
    shutil.copy(HERE / "submissions" / "buggy_no_scale.py", subs / "a b.py")
    shutil.copy(HERE / "submissions" / "correct_seed.py", subs / "a_b.py")
    # 4: links out of a submission, and a folder too large to copy (a sparse file: no real disk here)
    secret = base / "secret.py"
    secret.write_text(f"print({SECRETS['file']!r})\n" + (HERE / "submissions" / "correct_seed.py").read_text())
    secret.chmod(0o600)
    (subs / "linked.py").symlink_to(secret)
    (subs / "linked_entry").mkdir()
    (subs / "linked_entry" / "attention.py").symlink_to(secret)
    (subs / "huge").mkdir()
    shutil.copy(HERE / "submissions" / "correct_seed.py", subs / "huge" / "attention.py")
    with open(subs / "huge" / "weights.bin", "wb") as fh:
        fh.truncate(512 * 2**20)
    # 5: the previous run's outputs, as an older grader left them (0755 folder, 0644 files), one a link
    out.mkdir(mode=0o755)
    (out / "feedback").mkdir(mode=0o755)
    for path in (out / "grades.json", out / "summary.md", out / "feedback" / "old_student.md"):
        path.write_text(f"{SECRETS['previous']}\n")
        path.chmod(0o644)
    out.chmod(0o755)
    (base / "victim.txt").write_text("untouched")
    (out / "grades.csv").symlink_to(base / "victim.txt")
    _folder_submission(subs, "reads_outputs", f"{out}\n")
    # 6: a process that has nothing to do with grading, running as nobody
    bystander = (subprocess.Popen(["sleep", "600"], user=65534, group=65534, env={"TOKEN": SECRETS["bystander"]})
                 if ROOT else subprocess.Popen(["sleep", "600"]))
    _folder_submission(subs, "attacks_bystander", f"{bystander.pid}\n")
    (base / "rubric.toml").write_text(RUBRIC)
    shm_before = _shm_sizes()
    try:
        run = grade(subs, "--out", out, "--rubric", base / "rubric.toml", "--jobs", 2, timeout=600,
                    env=dict(os.environ, GRADER_SECRET=SECRETS["env"]))  # 1: a token the grader holds
        bystander_alive = bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
    grades = json.loads((out / "grades.json").read_text())
    texts = {str(p.relative_to(out)): p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()}
    return {"run": run, "out": out, "base": base, "by": {s["name"]: s for s in grades["submissions"]},
            "grades": grades, "texts": texts, "bystander_alive": bystander_alive, "shm_before": shm_before}


def _hits(sub) -> set[str]:
    return {h["name"] for h in sub["forbidden"] if h["how"] == "called while grading"}


@pytest.mark.slow
def test_no_attack_causes_a_grader_error(attacked):
    """3: whatever a submission sends or contains is its own outcome, never the grader's."""
    assert attacked["run"].returncode == 0, attacked["run"].stderr
    assert "grader-error" not in {s["outcome"] for s in attacked["by"].values()}
    assert "Traceback" not in attacked["run"].stderr


@pytest.mark.slow
def test_the_graders_environment_never_reaches_a_submission(attacked):
    """1: the child's inherited environment block is the zygote's, which holds none of the grader's variables."""
    printed = attacked["by"]["leaks_environment"]["output"]
    assert "ENV-BLOCK" in printed and "OMP_NUM_THREADS=1" in printed  # it did read its environment block
    for name, text in attacked["texts"].items():
        assert SECRETS["env"] not in text, name
        assert "GRADER_SECRET" not in text, name


def test_the_zygote_starts_with_an_empty_environment(monkeypatch):
    monkeypatch.setenv("GRADER_SECRET", SECRETS["env"])
    launched = zygote.launch()
    try:
        with open(f"/proc/{launched.proc.pid}/environ", "rb") as fh:
            environ = dict(item.split(b"=", 1) for item in fh.read().split(b"\0") if item)
    finally:
        launched.close()
    assert b"GRADER_SECRET" not in environ
    assert set(environ) <= {b"OMP_NUM_THREADS", b"MKL_NUM_THREADS", b"LANG", b"LC_CTYPE"} | {
        k.encode() for k in zygote.PASSED_ENV}


@pytest.mark.parametrize("name, called", [
    ("tripwire_wrapped", "torch.nn.functional.scaled_dot_product_attention"),
    ("tripwire_aten", "torch.ops.aten.scaled_dot_product_attention.default"),
    ("tripwire_c_nn", "torch._C._nn.scaled_dot_product_attention"),
    ("tripwire_kit", "attn_spec.reference.attention"),
])
def test_a_forbidden_call_is_caught_however_it_is_reached(attacked, name, called):
    """2: no __wrapped__ leads past a tripwire, hits are recorded in the grader as they happen (emptying
    anything in the child afterwards changes nothing), and torch.ops.aten / torch._C._nn are covered."""
    sub = attacked["by"][name]
    assert sub["outcome"] == "forbidden" and sub["score"] == 0, (sub["outcome"], sub["detail"])
    assert called in _hits(sub)
    assert not [h for h in sub["forbidden"] if h["how"] == "named in the source"]  # the scan could not see it


def test_forged_frames_are_the_submissions_bad_output(attacked):
    """3: a reply frame with an absurd tensor record; a load report with fields of the wrong types."""
    frame, load = attacked["by"]["forges_frame"], attacked["by"]["forges_load"]
    assert frame["outcome"] == "bad-output" and "not valid data" in frame["detail"] and frame["score"] == 0
    assert load["outcome"] == "missing-attention" and load["score"] == 0


def test_links_out_of_a_submission_are_never_followed_by_the_grader(attacked):
    """4: a class entry that is a link, and a folder whose entry file is a link, to a root-only file."""
    linked, entry = attacked["by"]["linked"], attacked["by"]["linked_entry"]
    assert linked["outcome"] == "import-error" and "symbolic link" in linked["detail"]
    assert entry["outcome"] == "import-error"
    if ROOT:  # the child follows the link with its own rights, which do not reach the file
        assert "cannot read attention.py: Permission denied" in entry["detail"]
    for name, text in attacked["texts"].items():
        assert SECRETS["file"] not in text, name


def test_the_whole_submission_copy_is_bounded(attacked):
    huge = attacked["by"]["huge"]
    assert huge["outcome"] == "import-error" and "larger than 64 MB" in huge["detail"]


def test_outputs_are_private_and_links_in_them_are_not_followed(attacked):
    """5: regrading into an older --out leaves it 0700 with 0600 files, before any submission runs."""
    out = attacked["out"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o700
    assert stat.S_IMODE((out / "feedback").stat().st_mode) == 0o700
    for name in ("grades.csv", "grades.json", "summary.md", "feedback/reads_outputs.md"):
        assert stat.S_IMODE((out / name).lstat().st_mode) == 0o600, name
    assert not (out / "grades.csv").is_symlink() and (attacked["base"] / "victim.txt").read_text() == "untouched"
    printed = attacked["by"]["reads_outputs"]["output"]
    assert SECRETS["previous"] not in printed
    if ROOT:
        assert "PermissionError" in printed


@pytest.mark.skipif(not ROOT, reason="sandbox users exist only when the grader runs as root")
def test_sandbox_users_are_dedicated_and_reach_no_other_process(attacked):
    """6: every slot runs as its own uid from a range nobody else uses; a process of `nobody` survives."""
    uids = {int(re.match(r"uid (\d+)", s["sandbox"]["user"]).group(1)) for s in attacked["by"].values() if s["sandbox"]}
    assert len(uids) == 2 and all(uid >= UID_BASE for uid in uids)  # --jobs 2: two users
    assert attacked["bystander_alive"]
    printed = attacked["by"]["attacks_bystander"]["output"]
    assert "my uid 65534" not in printed and "sent SIGKILL" not in printed
    for name, text in attacked["texts"].items():
        assert SECRETS["bystander"] not in text, name


@pytest.mark.skipif(not ROOT, reason="sandbox users exist only when the grader runs as root")
def test_sandbox_ids_avoid_every_account_and_running_process():
    import pwd

    ids = sandbox_ids(3)
    assert len({uid for uid, _ in ids}) == 3 and all(uid == gid for uid, gid in ids)
    for uid, _ in ids:
        with pytest.raises(KeyError):
            pwd.getpwuid(uid)


def test_shared_memory_does_not_outlive_the_run(attacked):
    """7: the child's System V segments are gone (its own IPC namespace, or removed by its monitor)."""
    assert attacked["by"]["shm_leak"]["output"].count("created shm") == 3
    assert _shm_sizes().count(SHM_SIZE) == attacked["shm_before"].count(SHM_SIZE) == 0


def _outside_fences(text: str) -> str:
    return re.sub(r"(?ms)^(`{3,})[^\n]*\n.*?^\1\s*$", "", text)


def test_forged_diagnoses_cannot_add_rows_or_html_to_a_report(attacked):
    """8: text from a submission is escaped (or fenced) in summary.md, its feedback and results."""
    summary = attacked["texts"]["summary.md"]
    assert summary.count("## Submissions") == 1
    table = summary.split("## Submissions")[1].strip().splitlines()[2:]
    assert len(table) == len(attacked["by"])
    assert sorted(row.split(" | ")[0].lstrip("| ") for row in table) == sorted(md.inline(n) for n in attacked["by"])
    feedback = attacked["texts"][f"feedback/{attacked['by']['forges_report']['feedback_file']}"]
    for text in (summary, _outside_fences(feedback)):
        assert not re.search(r"(?<!\\)<(script|img)", text)
        assert not re.search(r"(?<!\\)\[click\]", text)
        assert "\n| a_b | 0 / 21 |" not in text
    assert not re.search(r"<(script|img)", attacked["texts"]["summary.html"])  # escaped there too


def test_a_forged_diagnosis_explains_nothing(attacked):
    """Issue 26: roots come from the child, where the submission can replace the diagnosis; the grader keeps
    a root only where its own replay through the wire is reproduced by that mistake. The forged claim (every
    failure a symptom of a missing scale) and the unknown or ill-typed ones are dropped: each failure is
    charged, as softmax over the queries with no diagnosis at all."""
    sub = attacked["by"]["forges_roots"]
    assert sub["outcome"] == "graded" and sub["roots"] == []
    failed = [p for p in sub["properties"] if p["status"] == "fail"]
    assert failed and all(p["points"] == 0 and not p["explained_by"] and not p["blocked_by"] for p in failed)
    assert sub["score"] == sum(p["max_points"] for p in sub["properties"] if p["status"] == "pass")


def test_names_that_read_alike_get_their_own_feedback_files(attacked):
    """9: one feedback file per name, chosen from the name alone, and the mapping in grades.csv."""
    spaced, underscored = attacked["by"]["a b"], attacked["by"]["a_b"]
    assert underscored["feedback_file"] == "a_b.md" and spaced["feedback_file"] != "a_b.md"
    assert spaced["feedback_file"] == f"{outputs.feedback_stem('a b')}.md"
    assert attacked["texts"][f"feedback/{spaced['feedback_file']}"].startswith("# Feedback for a b\n")
    assert attacked["texts"]["feedback/a_b.md"].startswith("# Feedback for a_b\n")
    assert underscored["score"] == underscored["max_score"] > spaced["score"]
    rows = {r["name"]: r["feedback"] for r in csv.DictReader(attacked["texts"]["grades.csv"].splitlines())}
    assert rows["a b"] == spaced["feedback_file"] and rows["a_b"] == "a_b.md"


# ---------------------------------------------------------------- the pieces, in-process


def test_feedback_stems_are_stable_and_one_to_one():
    names = ["a b", "a_b", "a~b", "a/b", "A_B", "é", "x" * 300, "..hidden", "a_b~" + "0" * 12]
    stems = [outputs.feedback_stem(n) for n in names]
    assert len(set(stems)) == len(names) and stems == [outputs.feedback_stem(n) for n in names]
    assert all(re.fullmatch(r"[A-Za-z0-9._~-]{1,100}", s) and not s.startswith(".") for s in stems)


def test_markdown_from_outside_stays_literal():
    forged = "x |\n| a | 0 |\n<script>alert(1)</script> [l](http://e) **b** `c` _d_ \u202e"
    line = md.inline(forged)
    assert "\n" not in line and "\u202e" not in line
    assert not re.search(r"(?<!\\)[<>|\[\]`*]", line)
    assert md.inline("attention_v2") == "attention_v2"  # no noise inside words
    block = md.fence("```\nclosed?\n````")
    assert block.startswith("`````\n") and block.endswith("\n`````")


def test_a_wire_record_with_an_absurd_shape_is_a_protocol_error():
    import socket

    a, b = socket.socketpair()
    receiver = wire.Channel(b)
    for record in ({"dtype": "float32", "shape": [10**30], "strides": [0], "nbytes": 4, "device": "cpu"},
                   {"dtype": "float32", "shape": [2**30, 2**30], "strides": [0, 0], "nbytes": 4, "device": "cpu"}):
        head = json.dumps({"tensors": [record]}).encode()
        a.sendall(len(head).to_bytes(4, "big") + head + bytes(4))
        with pytest.raises(wire.ProtocolError):
            receiver.recv()
    a.close()
    b.close()


def test_tripwires_cover_torchs_other_entry_points_to_sdpa():
    from attn_spec.grading.isolation.sandbox import entry_points

    names = {dotted for _, _, dotted in entry_points(["torch.nn.functional.scaled_dot_product_attention"])}
    assert {"torch.nn.functional.scaled_dot_product_attention", "torch._C._nn.scaled_dot_product_attention",
            "torch.ops.aten.scaled_dot_product_attention", "torch.ops.aten._scaled_dot_product_attention_math",
            "torch._scaled_dot_product_attention_math"} <= names
    assert torch.nn.functional.scaled_dot_product_attention.__module__ == "torch._C._nn"  # nothing was patched here


def test_a_linked_submission_is_not_followed_with_gradescope_either(tmp_path):
    (tmp_path / "real.py").write_text("def attention(Q, K, V, mask=None):\n    return V\n")
    (tmp_path / "link.py").symlink_to(tmp_path / "real.py")
    (sub,) = discover(str(tmp_path / "link.py"), rubrics.load(None), single=True)
    assert sub.entry is None and "symbolic link" in sub.problem


def test_an_output_folder_of_someone_else_or_with_a_link_is_refused(tmp_path, capsys):
    subs = tmp_path / "subs"
    subs.mkdir()
    shutil.copy(HERE / "submissions" / "correct_seed.py", subs)
    theirs, linked = tmp_path / "theirs", tmp_path / "linked"
    theirs.mkdir()
    linked.mkdir()
    (linked / "feedback").symlink_to(tmp_path)
    if ROOT:
        os.chown(theirs, 12345, 12345)
        assert main(["grade", str(subs), "--out", str(theirs)]) == 2
        assert "belongs to uid 12345" in capsys.readouterr().err
    assert main(["grade", str(subs), "--out", str(linked)]) == 2
    assert "not a folder of yours" in capsys.readouterr().err
