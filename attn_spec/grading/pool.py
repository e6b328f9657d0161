"""Grade a class: :func:`grade_all`, with ``--jobs N`` judge processes so that judging runs on every core.

Judging a submission is mostly the grader's own Python (Hypothesis draws the inputs, the float64
reference and the budgets judge the outputs). Threads in one process queue behind its interpreter
lock, so parallel jobs are processes: each judge is forked from the grader once the zygote is
ready and the calibration is done, and grades the submissions it is handed, one at a time,
through the same zygote (its spawn requests are single datagrams, so judges can share its socket).
Each judge gets one sandbox identity of its own. Grades come back as JSON; judges are the kit's
own trusted processes, and nothing a submission produced is ever unpickled.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import traceback
from dataclasses import dataclass

import torch

from attn_spec.grading.grader import GRADER_ERROR, Grade, Grader, PropertyGrade
from attn_spec.grading.isolation import zygote
from attn_spec.grading.rubric import Rubric
from attn_spec.grading.submissions import Submission, sandbox_ids


@dataclass
class _Judge:
    pid: int
    sock: socket.socket
    reader: object  # the socket's file object, for line-by-line reads
    busy: int | None = None  # index of the submission it is grading

    def close(self) -> None:
        self.reader.close()  # the socket's file descriptor stays open until its file object closes too
        self.sock.close()


def _serve(grader: Grader, subs, ids, sock: socket.socket) -> None:
    """In a judge: read a submission index per line, answer with its grade as one JSON line."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the grader's to handle: it kills us
    grader.ids = ids
    with sock.makefile("r") as lines, sock.makefile("w") as out:
        for line in lines:
            grade = grader.grade(subs[int(line)])
            out.write(json.dumps(grade.to_dict()) + "\n")
            out.flush()


def _start(grader: Grader, subs, ids, others: list[_Judge]) -> _Judge:
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for judge in others:  # so that each judge sees the end of its own socket only
                judge.close()
            mine.close()
            _serve(grader, subs, ids, theirs)
        except BaseException:  # noqa: BLE001 - a judge never returns into the grader's code
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    theirs.close()
    return _Judge(pid, mine, mine.makefile("r"))


def _grade_from(data: dict) -> Grade:
    data["properties"] = [PropertyGrade(**row) for row in data["properties"]]
    return Grade(**data)


def grade_in_judges(grader: Grader, subs, ids: list, progress=None) -> dict[str, Grade]:
    """Grade ``subs`` with one judge process per entry of ``ids`` (sandbox identities); name -> Grade."""
    judges: list[_Judge] = []
    grades: dict[str, Grade] = {}
    todo = list(range(len(subs)))
    try:
        for slot in ids[:len(subs)]:
            judges.append(_start(grader, subs, slot, judges))
        for judge in judges:
            _hand_out(judge, todo)
        while any(judge.busy is not None for judge in judges):
            ready, _, _ = select.select([j.sock for j in judges if j.busy is not None], [], [])
            for judge in [j for j in judges if j.sock in ready]:
                sub = subs[judge.busy]
                line = judge.reader.readline()
                if line.endswith("\n"):
                    grades[sub.name] = _grade_from(json.loads(line))
                else:  # the judge itself died (mid-line, perhaps): the grader's failure, never the student's
                    grades[sub.name] = Grade(sub.name, GRADER_ERROR, detail="the judge process grading it died; "
                                             "this is not the student's doing")
                    judge.close()
                    judge.busy = None
                if progress:
                    progress(list(grades.values()), len(subs))
                if judge.busy is not None:
                    _hand_out(judge, todo)
        for index in todo:  # every judge died before these were handed out
            grades[subs[index].name] = Grade(subs[index].name, GRADER_ERROR, detail="no judge process was left")
    finally:
        for judge in judges:
            judge.close()
            if judge.busy is not None:  # interrupted: its submission's child dies with its sockets
                os.kill(judge.pid, signal.SIGKILL)
        for judge in judges:
            os.waitpid(judge.pid, 0)
    return grades


def _hand_out(judge: _Judge, todo: list[int]) -> None:
    judge.busy = todo.pop(0) if todo else None
    if judge.busy is not None:
        judge.sock.sendall(f"{judge.busy}\n".encode())


def grade_all(subs: list[Submission], rubric: Rubric, *, jobs: int = 1, progress=None,
              launched: zygote.Launch | None = None) -> list[Grade]:
    """Grade every submission, ``jobs`` at a time (judge processes, below); results in the order of ``subs``.

    ``launched``: a zygote already started with :func:`attn_spec.grading.isolation.zygote.launch` (it is closed here).
    """
    grades: dict[str, Grade] = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # judging small tensors: parallelism comes from the jobs, not from OpenMP
    try:
        with Grader(rubric, launched) as grader:
            if jobs > 1 and len(subs) > 1:
                grades = grade_in_judges(grader, subs, sandbox_ids(jobs), progress)
            else:
                for sub in subs:
                    grades[sub.name] = grader.grade(sub)
                    if progress:
                        progress(list(grades.values()), len(subs))
    finally:
        torch.set_num_threads(threads)
    return [grades[sub.name] for sub in subs]
