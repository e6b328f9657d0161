"""Finding submissions, and the scratch folder and sandbox user each one runs with."""
from __future__ import annotations

import grp
import os
import pwd
import shutil
from dataclasses import dataclass
from pathlib import Path

from attn_spec.grading.rubric import Rubric
from attn_spec.errors import KitUsageError

SANDBOX_USER = "nobody"


@dataclass
class Submission:
    name: str
    path: Path  # the student's file, or folder
    entry: str | None  # the file to import, relative to the submission's root
    problem: str = ""  # why there is nothing to import


def _entry(folder: Path, rubric: Rubric) -> tuple[str | None, str]:
    for name in rubric.entry:
        if (folder / name).is_file():
            return name, ""
    files = sorted(p.name for p in folder.glob("*.py") if p.is_file())
    if len(files) == 1:
        return files[0], ""
    return None, (f"found no file to import: looked for {', '.join(rubric.entry)}"
                  + (f" and there are several .py files ({', '.join(files[:6])})" if files else " and there is no .py file"))


def discover(path: str, rubric: Rubric, *, single: bool = False) -> list[Submission]:
    """One submission per .py file or folder in ``path`` (or ``path`` itself when ``single``)."""
    root = Path(path)
    if not root.exists():
        raise KitUsageError(f"no such file or folder: {path}")
    if single or root.is_file():
        if root.is_file() and root.suffix != ".py":
            raise KitUsageError(f"{path} is not a .py file or a folder")
        candidates = [root]
    else:
        candidates = sorted(p for p in root.iterdir() if not p.name.startswith((".", "_"))
                            and (p.is_dir() or (p.is_file() and p.suffix == ".py")))
    subs, seen = [], {}
    for p in candidates:
        name = p.stem if p.is_file() else p.name
        if name in seen:
            raise KitUsageError(f"two submissions are named {name!r}: {seen[name]} and {p.name}")
        seen[name] = p.name
        entry, problem = (p.name, "") if p.is_file() else _entry(p, rubric)
        subs.append(Submission(name, p, entry, problem))
    if not subs:
        raise KitUsageError(f"{path} holds no submissions (one .py file or one folder per student)")
    return subs


# ---------------------------------------------------------------- the sandbox user


def sandbox_ids(slots: int) -> list[tuple[int, int] | None]:
    """(uid, gid) per parallel slot when running as root, else None (children keep our user).

    Slot 0 runs as ``nobody``; other slots get the next lower uids that no account uses, so that
    concurrent submissions cannot signal or touch each other's processes and files.
    """
    if os.geteuid() != 0:
        return [None] * slots
    try:
        user = pwd.getpwnam(SANDBOX_USER)
        uid, gid = user.pw_uid, user.pw_gid
    except KeyError:
        uid, gid = 65534, 65534
    try:
        gid = grp.getgrnam("nogroup").gr_gid
    except KeyError:
        pass
    ids, candidate = [(uid, gid)], uid - 1
    while len(ids) < slots:
        try:
            pwd.getpwuid(candidate)
        except KeyError:
            ids.append((candidate, gid))
        candidate -= 1
    return ids


def prepare(sub: Submission, scratch: str, ids) -> None:
    """Copy the submission into its scratch folder (links stay links) and hand it to the sandbox user."""
    if sub.path.is_file():
        shutil.copyfile(sub.path, os.path.join(scratch, sub.path.name))
    else:
        shutil.copytree(sub.path, scratch, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", ".git"))
    if ids is not None:
        for folder, dirs, files in os.walk(scratch):
            for name in [folder] + [os.path.join(folder, n) for n in dirs + files]:
                os.chown(name, *ids, follow_symlinks=False)


def remove(path: str) -> None:
    """Delete a scratch folder, even one whose sub-folders the submission made unreadable."""
    if os.geteuid() != 0:  # root ignores permissions; the grader's own user needs them back
        for folder, dirs, _ in os.walk(path):
            for name in dirs:
                if not os.path.islink(os.path.join(folder, name)):
                    os.chmod(os.path.join(folder, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
