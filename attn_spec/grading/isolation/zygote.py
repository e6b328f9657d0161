"""The zygote: a warm process that imports torch once and forks one fresh child per submission.

Started by :func:`launch` as a fresh interpreter (``python -I -B -c "...; main(FD)"``) with an
*empty* environment but for ``OMP_NUM_THREADS=1`` (so it stays single-threaded and forking is safe)
and what the dynamic linker and CUDA need (:data:`PASSED_ENV`), in an empty working folder: nothing of
the grader's environment (its tokens, say) is in its memory, nor in its children's.
This module imports nothing heavy at the top, so the grader can launch the zygote first and import
torch and the catalog while the zygote does the same.
It imports torch and :mod:`attn_spec.grading.isolation.sandbox`, does no tensor math, then waits on the
socket FD for spawn requests: a JSON config plus four file descriptors (the child's channel to
the grader, a control socket, the write end of the output pipe, the write end of the pipe its
tripwires report forbidden calls on). At the first request it arms the tripwires, once for all children.

For each request it forks a *monitor*, and the monitor forks the child. The monitor is the
child's parent: it reports the child's pid, kills the child's process group when the grader
asks (or when the grader disappears), and reports the exit status, since only a parent can
read it. The zygote reaps finished monitors itself (so their CPU time is accounted to it, and on
to the grader).
"""
from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from attn_spec.errors import IsolationError

POLL_SECONDS = 0.02
# The only variables the zygote gets from the grader's environment: none of them holds a secret.
PASSED_ENV = ("LD_LIBRARY_PATH", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "HIP_VISIBLE_DEVICES")
# A child that runs as an unprivileged user may be unable to read the Python installation (under
# /root, say), so whatever it imports later must already be in memory: the whole standard library
# with its submodules (less a few with side effects or no use here) and the modules torch imports
# lazily on the way (torch.broadcast_shapes pulls in sympy, for one).
SKIP_STDLIB = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip",
               "venv", "pydoc", "webbrowser"}
TORCH_PRELOAD = ("torch.nn.functional", "torch.nn.init", "torch.autograd", "torch.linalg", "torch.special",
                 "torch.fft", "torch.fx.experimental.symbolic_shapes")


def preload() -> None:
    import importlib
    import pkgutil

    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIP_STDLIB:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # another platform's module (winreg, msvcrt, ...)
            continue
        for info in pkgutil.walk_packages(getattr(module, "__path__", []), name + "."):
            if "__main__" in info.name or ".test" in info.name or info.name in sys.modules:
                continue  # a __main__ runs a command line; tests are not for submissions
            try:
                importlib.import_module(info.name)
            except (Exception, SystemExit):  # another platform's submodule (asyncio.windows_events, ...)
                pass
    for name in TORCH_PRELOAD:
        importlib.import_module(name)


@dataclass
class Launch:
    """A zygote just started: its scratch base folder, its process, and the grader's end of its socket."""

    base: str
    proc: subprocess.Popen
    sock: socket.socket

    def close(self) -> None:
        """Stop the zygote (idle, it exits when its socket closes; still starting, it is killed) and
        remove the scratch base folder."""
        self.sock.close()
        try:
            self.proc.wait(0.5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.base, ignore_errors=True)


def closed_folder(path: str) -> str | None:
    """The first folder on the way to ``path`` that other users cannot enter (no o+x), or None."""
    for folder in [*reversed(Path(path).parents), Path(path)]:
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return str(folder)
    return None


def launch(prefix: str = "attn-spec-grade-") -> Launch:
    """Start a zygote in a fresh scratch base folder (0711: each child reaches only its own folder) named
    ``prefix`` and a random tail.
    As root the children run as sandbox users, who must be able to enter the temporary folder
    (TMPDIR): if they cannot, an IsolationError says so before anyone is graded."""
    if os.geteuid() == 0:
        closed = closed_folder(tempfile.gettempdir())
        if closed:
            raise IsolationError(f"the scratch folders would go under {tempfile.gettempdir()}, but the sandbox users "
                                 f"cannot enter {closed} (it has no o+x): every submission would fail to import. Set "
                                 f"TMPDIR to a folder they can reach, such as /tmp")
    base = tempfile.mkdtemp(prefix=prefix)  # check --isolate: a name that does not say who runs it
    os.chmod(base, 0o711)
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LANG": "C.UTF-8",
           **{k: os.environ[k] for k in PASSED_ENV if k in os.environ}}
    path = [p for p in sys.path if p]  # the grader's own imports (a PYTHONPATH included), passed as data
    code = (f"import sys; sys.path[:] = {path!r}; "
            f"from attn_spec.grading.isolation.zygote import main; main({theirs.fileno()})")
    proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", code], pass_fds=[theirs.fileno()], cwd=base,
                            env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            start_new_session=True)  # Ctrl-C reaches the grader, which tears everything down
    theirs.close()
    return Launch(base, proc, mine)


def _status(status: int, rusage) -> dict:
    report = {"max_rss_kb": rusage.ru_maxrss, "cpu_seconds": round(rusage.ru_utime + rusage.ru_stime, 3)}
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["code"] = os.WEXITSTATUS(status)
    return report


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def remove_segments(pid: int) -> None:
    """Remove the System V shared-memory segments process ``pid`` created (where it had no IPC namespace)."""
    try:
        with open("/proc/sysvipc/shm") as fh:
            rows = [line.split() for line in fh.readlines()[1:]]
    except OSError:
        return
    mine = [int(row[1]) for row in rows if len(row) > 4 and row[4] == str(pid)]  # columns: key shmid perms size cpid
    if mine:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        for shmid in mine:
            libc.shmctl(shmid, 0, None)  # IPC_RMID: gone once nothing has it attached (its creator is dead)


def monitor(ctrl: socket.socket, pid: int) -> None:
    """Watch one child: kill its group on request, report its exit status, clean up after it, return."""
    from attn_spec.grading.isolation import wire

    wire.send_message(ctrl, {"pid": pid})
    killed = False
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
        if ctrl is None:
            time.sleep(POLL_SECONDS)
            continue
        ready, _, _ = select.select([ctrl], [], [], POLL_SECONDS)
        if ready:
            try:
                message, _ = wire.recv_message(ctrl)
            except (OSError, ValueError):
                message = None
            _kill_group(pid)  # a "kill" request, or the grader is gone
            killed = True
            if message is None:  # nobody left to report to
                ctrl = None
    _kill_group(pid)  # anything left in its group, while its pid cannot be reused (not yet reaped)
    remove_segments(pid)
    _, status, rusage = os.wait4(pid, 0)
    if ctrl is not None:
        try:
            wire.send_message(ctrl, {"status": _status(status, rusage), "killed_by_grader": killed})
        except OSError:
            pass


def _spawn(config: dict, fds: list[int]) -> None:
    """In the monitor process: fork the child and watch it."""
    chan, ctrl_fd, out, hits = fds
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    pid = os.fork()
    if pid == 0:
        os.close(ctrl_fd)
        from attn_spec.grading.isolation import sandbox

        sandbox.run(chan, out, hits, config)  # never returns
    for fd in (chan, out, hits):
        os.close(fd)
    monitor(socket.socket(fileno=ctrl_fd), pid)


def _reap(*_) -> None:
    """SIGCHLD in the zygote: collect every finished monitor."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def main(fd: int) -> None:
    from attn_spec.grading.isolation import sandbox, wire  # noqa: F401 - loaded once, used by every child
    from attn_spec.properties import catalog

    catalog()  # loaded once here, for every child's diagnosis (isolation/diagnosis.py)
    preload()
    sock = socket.socket(fileno=fd)
    signal.signal(signal.SIGCHLD, _reap)
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    try:
        wire.send_message(sock, {"ready": True, "threads": threads})
    except OSError:  # the grader gave up while we started (a usage error): nothing to say
        return
    while True:
        try:
            message, fds = wire.recv_message(sock, maxfds=4)
        except OSError:  # the grader is gone
            return
        if message is None:
            return
        try:
            sandbox.arm_tripwires(message["config"]["forbidden"])  # once, for every child to come
        except Exception:  # noqa: BLE001 - the child arms them itself and reports what failed
            pass
        pid = os.fork()
        if pid == 0:
            sock.close()
            code = 0
            try:
                _spawn(message["config"], fds)
            except BaseException:  # noqa: BLE001 - a monitor never returns into the zygote's loop
                code = 1
            os._exit(code)
        for f in fds:
            os.close(f)


if __name__ == "__main__":
    main(int(sys.argv[1]))
