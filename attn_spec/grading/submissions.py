"""Finding submissions, and the scratch folder and sandbox user each one runs with."""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from attn_spec.errors import KitUsageError

if TYPE_CHECKING:  # this module stays light: the command checks a class folder before importing torch
    from attn_spec.grading.rubric import Rubric

# Sandbox users: a dedicated range of uids (each also its own gid) that no account, group or running
# process uses. 2,000,000,000 lies in the range systemd leaves unallocated (above the containers'
# 524288-1879048191, below 2**31), so neither `nobody` nor a container's users share it.
UID_BASE = 2_000_000_000
MAX_FILES = 10_000  # files and folders in one submission folder


@dataclass
class Submission:
    name: str
    path: Path  # the student's file, or folder
    entry: str | None  # the file to import, relative to the submission's root
    problem: str = ""  # why there is nothing to import


def _entry(folder: Path, rubric: Rubric) -> tuple[str | None, str]:
    for name in rubric.entry:
        if (folder / name).is_file():  # a link is followed by the child, with its own rights
            return name, ""
    files = sorted(p.name for p in folder.glob("*.py") if p.is_file())
    if len(files) == 1:
        return files[0], ""
    return None, (f"found no file to import: looked for {', '.join(rubric.entry)}"
                  + (f" and there are several .py files ({', '.join(files[:6])})" if files else " and there is no .py file"))


def candidates(root: Path) -> list[Path]:
    """The entries of a class folder that are submissions: .py files and folders (links included, not
    followed), less names starting with "." or "_"."""
    return sorted(p for p in root.iterdir() if not p.name.startswith((".", "_"))
                  and (p.is_dir() or p.suffix == ".py" and (p.is_file() or p.is_symlink())))


def found_in(path: str, *, single: bool = False) -> list[Path]:
    """The submissions' paths in ``path`` (``path`` itself when ``single`` or a file); a KitUsageError
    says why there are none. Light (no torch): the command calls it before the grading worker starts."""
    root = Path(path)
    if not root.exists():
        raise KitUsageError(f"no such file or folder: {path}")
    if single or root.is_file():
        if root.is_file() and root.suffix != ".py":
            raise KitUsageError(f"{path} is not a .py file or a folder")
        return [root]
    found = candidates(root)
    if not found:
        raise KitUsageError(f"{path} holds no submissions (one .py file or one folder per student)")
    return found


def discover(path: str, rubric: Rubric, *, single: bool = False) -> list[Submission]:
    """One submission per .py file or folder in ``path`` (or ``path`` itself when ``single``)."""
    root, found = Path(path), found_in(path, single=single)
    subs, seen = [], {}
    for p in found:
        name = p.stem if p.suffix == ".py" and not p.is_dir() else p.name
        if name in seen:
            raise KitUsageError(f"two submissions are named {name!r}: {seen[name]} and {p.name}")
        seen[name] = p.name
        if p.is_symlink() and not (p == root and p.is_dir()):  # never followed: it may lead anywhere on this machine
            subs.append(Submission(name, p, None, f"{p.name} is a symbolic link; the grader does not follow links "
                                                  "out of a submission (put the file itself in the class folder)"))
            continue
        entry, problem = (p.name, "") if p.is_file() else _entry(p, rubric)
        subs.append(Submission(name, p, entry, problem))
    return subs


# ---------------------------------------------------------------- the sandbox user


def _uids_in_use() -> set[int]:
    """Real, effective and saved uids of every process this machine shows in /proc."""
    used = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for line in (proc / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    used.update(int(x) for x in line.split()[1:])
                    break
        except (OSError, ValueError):
            pass
    return used


def _mapped(uid: int) -> bool:
    """Whether ``uid`` exists in this user namespace (a container may map only 65536 uids)."""
    try:
        with open("/proc/self/uid_map") as fh:
            return any(int(start) <= uid < int(start) + int(count) for start, _, count in map(str.split, fh))
    except (OSError, ValueError):
        return True


def _free(uid: int, busy: set[int]) -> bool:
    if uid in busy or not _mapped(uid):
        return False
    try:
        pwd.getpwuid(uid)
        return False
    except KeyError:
        pass
    try:
        grp.getgrgid(uid)
        return False
    except KeyError:
        return True


def sandbox_ids(slots: int) -> list[tuple[int, int] | None]:
    """(uid, gid) per parallel slot when running as root, else None (children keep our user).

    Each slot gets its own uid, from a dedicated range (:data:`UID_BASE` up) that no account, group
    or running process uses, and the gid of the same number: so concurrent submissions cannot signal
    or touch each other's processes and files, nor any other process on the machine (not `nobody`'s).
    Where that range is not mapped (a container with 65536 uids), the highest free uids below 65534.
    """
    if os.geteuid() != 0:
        return [None] * slots
    busy = _uids_in_use()
    candidate = UID_BASE if _mapped(UID_BASE) else 65533
    step = 1 if candidate == UID_BASE else -1
    ids = []
    while len(ids) < slots:
        if candidate <= 1000:
            raise KitUsageError("no free uid for a sandbox user")
        if _free(candidate, busy):
            ids.append((candidate, candidate))
        candidate += step
    return ids


# ---------------------------------------------------------------- scratch folders


def _copy_file(src: str, dst: str, budget: int) -> int:
    """Copy a regular file without following links, spending bytes of ``budget``; the budget left
    (negative when it ran out, and the copy stopped there)."""
    fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else since it was listed
            return budget
        with open(fd, "rb", closefd=False) as fin, open(dst, "xb") as fout:
            while chunk := fin.read(1 << 16):
                budget -= len(chunk)
                if budget < 0:
                    return budget
                fout.write(chunk)
    finally:
        os.close(fd)
    return budget


def prepare(sub: Submission, scratch: str, ids, limit_mb: float) -> str:
    """Copy the submission into its scratch folder and hand it to the sandbox user; "" or why it cannot be.

    Links are copied as links (the child follows them with its own rights; root never reads through
    one), only regular files and folders are copied (a FIFO or device is left out), and the whole copy
    is bounded: at most ``limit_mb`` of file contents (a sparse file counts at its full size) and
    :data:`MAX_FILES` entries."""
    try:
        problem = _copy(sub.path, scratch, limit_mb)
    except OSError as exc:  # a file the grader may not read (when not root), one that vanished, ...
        problem = f"cannot copy {os.path.basename(exc.filename or '') or 'it'}: {exc.strerror or exc}"
    if problem:
        return problem
    if ids is not None:
        for folder, dirs, files in os.walk(scratch):
            for name in [folder] + [os.path.join(folder, n) for n in dirs + files]:
                os.chown(name, *ids, follow_symlinks=False)
    return ""


def _copy(path: Path, scratch: str, limit_mb: float) -> str:
    budget, count = int(limit_mb * 2**20), 0
    too_big = (f"the submission is larger than {limit_mb:g} MB (all its files together) or holds more than "
               f"{MAX_FILES} files")
    if not path.is_dir():
        return "" if _copy_file(str(path), os.path.join(scratch, path.name), budget) >= 0 else too_big
    for folder, dirs, files in os.walk(path):  # does not descend into links to folders
        rel = os.path.relpath(folder, path)
        dirs[:] = [d for d in dirs if d not in ("__pycache__", ".git")]
        for name in dirs + files:
            count += 1
            if count > MAX_FILES:
                return too_big
            src, dst = os.path.join(folder, name), os.path.normpath(os.path.join(scratch, rel, name))
            mode = os.lstat(src).st_mode
            if stat.S_ISLNK(mode):
                os.symlink(os.readlink(src), dst)
            elif stat.S_ISDIR(mode):
                os.mkdir(dst, 0o700)
            elif stat.S_ISREG(mode):
                budget = _copy_file(src, dst, budget)
                if budget < 0:
                    return too_big
    return ""


def remove(path: str) -> None:
    """Delete a scratch folder, even one whose sub-folders the submission made unreadable."""
    if os.geteuid() != 0:  # root ignores permissions; the grader's own user needs them back
        for folder, dirs, _ in os.walk(path):
            for name in dirs:
                if not os.path.islink(os.path.join(folder, name)):
                    os.chmod(os.path.join(folder, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)
