"""A call that can kill the process, run in a forked child: the CPU flash op of torch 2.13 dies with SIGFPE on
zero keys (pytorch #141219), a Triton kernel under the interpreter that stores out of bounds corrupts the heap
(SIGABRT at a later free), and a header probe or a property must not take the whole check down with it.

:func:`call_in_child` runs one function so; :func:`call_forked` is ``targets.base._call`` for a target whose every
call runs so (``StateGuard.in_child``: a target under Triton's interpreter, attn_spec.targets.interpreter): the
same outcomes as in the process (its value, a declined input, TargetRaised with the target's traceback, TargetHung
at the call's deadline), and a dead child is :class:`attn_spec.errors.TargetDied` ("the process died: SIGABRT,
likely an out-of-bounds store"), a failure of that case. What a call cannot do from a child: hand back an autograd
graph (its output arrives as a plain tensor), alias an input's storage, or change the kit's process.

The child runs single-threaded (an OpenMP pool forked mid-use hangs the child otherwise) and sends its result
back through a pipe, read while the child runs (a result larger than the pipe's buffer would block it); a
child killed by a signal is reported by the signal's name, one that does not finish in time is killed.
"""
from __future__ import annotations

import builtins
import contextlib
import faulthandler
import importlib
import os
import pickle
import select
import signal
import sys
import tempfile
import time

import torch

from attn_spec.errors import TargetDied, TargetHung, TargetRaised, Unsupported
from attn_spec.targets.deadline import DeadlinePassed, seconds_now, timeout as call_deadline
from attn_spec.targets.loading import library_dirs, raised_on_purpose
from attn_spec.targets.tracebacks import user_traceback

NO_DEADLINE = 7 * 24 * 3600.0  # seconds a child gets when calls have no deadline (call-timeout 0)
LIKELY = {"SIGABRT": "an out-of-bounds store (the heap was corrupted)", "SIGSEGV": "an out-of-bounds store or load",
          "SIGBUS": "a misaligned or out-of-bounds access", "SIGFPE": "an integer division by zero",
          "SIGILL": "an instruction this CPU does not have"}


def call_in_child(fn, *, timeout: float = 20.0) -> tuple[str, object]:
    """``fn()`` in a forked child: ("value", its result), ("raises", (exception type name, its text, whether it
    is an attn_spec.Unsupported)), ("crashes", signal name), ("hangs", None), or ("unrun", why)."""
    if not hasattr(os, "fork"):
        return "unrun", "no fork on this platform"
    for stream in (sys.stdout, sys.stderr):  # what is buffered here would be written again by the child
        with contextlib.suppress(Exception):
            stream.flush()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        faulthandler.disable()  # a crash is the result, not a traceback on the parent's stderr
        torch.set_num_threads(1)
        try:
            with call_deadline(0):  # the parent times the child (``timeout``): no deadline of its own in here
                result = ("value", fn())
        except BaseException as exc:  # noqa: BLE001 - the call's outcome, whatever it is
            result = ("raises", (type(exc).__name__, str(exc), isinstance(exc, Unsupported)))
        try:
            data = pickle.dumps(result)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be sent is reported as such
            data = pickle.dumps(("raises", (type(exc).__name__, f"the result cannot be sent back: {exc}", False)))
        _write_all(write, data)
        os._exit(0)
    os.close(write)
    chunks, deadline, sent = [], time.monotonic() + timeout, False
    try:
        return _wait(pid, read, chunks, deadline, sent)
    except BaseException:  # the user's Ctrl-C while waiting: the child goes too
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        raise
    finally:
        os.close(read)


def _wait(pid, read, chunks, deadline, sent) -> tuple[str, object]:
    """The child's outcome, reading its result while it runs; killed at ``deadline``."""
    while time.monotonic() < deadline:
        if not sent and select.select([read], [], [], 0.01)[0]:
            chunk = os.read(read, 1 << 16)
            if chunk:
                chunks.append(chunk)
                continue
            sent = True  # end of file: the child is exiting (a closed pipe is always ready: no spinning on it)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            if os.WIFSIGNALED(status):
                return "crashes", signal.Signals(os.WTERMSIG(status)).name
            chunks.append(_read_rest(read))
            data = b"".join(chunks)
            return pickle.loads(data) if data else ("unrun", "the child exited without a result")
        if sent:
            time.sleep(0.001)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hangs", None


def _write_all(fd, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_rest(fd) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def in_child(fn, *, timeout: float = 20.0) -> str:
    """``fn()``'s string result, computed in a forked child: or "crashes (SIGFPE)", "raises (E)", "hangs"."""
    kind, value = call_in_child(lambda: str(fn()), timeout=timeout)
    if kind == "value":
        return value
    if kind == "raises":
        return f"raises ({value[0]})"
    if kind == "crashes":
        return f"crashes ({value})"
    return "hangs" if kind == "hangs" else f"unprobed ({value})"


def call_forked(fn, args, call: str, state):
    """``fn(*args)``, the user's code, run in a forked child under ``state``'s guard and the call's deadline; raises
    as ``targets.base._call`` does (Unsupported, TargetRaised, TargetHung), or TargetDied when the child died."""
    with state.call(call), tempfile.TemporaryFile() as said:  # said: the child's native stderr (glibc's last words)
        seconds = seconds_now()
        kind, value = call_in_child(lambda: _outcome(fn, args, said.fileno()), timeout=seconds or NO_DEADLINE)
        words = _last_line(said) if kind == "crashes" else ""
    if kind == "value":
        value, imported = value
        _import_here(imported)
    if kind == "value" and value[0] == "returned":
        return value[1]
    if kind == "value" and value[0] == "declined":
        raise Unsupported(f"{call} declined: {value[1]}", total=value[2])
    if kind == "value":  # raised: its type's name, its message, its traceback, whether on purpose
        raise TargetRaised(_rebuilt(*value[1:3], on_purpose=value[4]), call, value[3])
    if kind == "crashes":
        raise TargetDied(call, value, LIKELY.get(value, ""), words)
    if kind == "hangs":
        stop = DeadlinePassed(seconds)
        raise TargetHung(stop, call, seconds, "(in a forked child: killed at its deadline, no traceback)")
    if kind == "raises":  # the child could not send its result
        raise TargetRaised(type(value[0], (Exception,), {})(value[1]), call, "")
    raise TargetRaised(RuntimeError(value), call, "")  # unrun: no fork on this platform


def _outcome(fn, args, stderr: int) -> tuple:
    """In the child: (("returned", value), ("declined", why, total) or ("raised", type name, message, traceback);
    the installed modules the call imported). Native code's stderr (file descriptor 2) goes to ``stderr``."""
    os.dup2(stderr, 2)
    before = set(sys.modules)
    outcome = _run(fn, args)
    return outcome, [name for name in set(sys.modules) - before if _installed(sys.modules[name])]


def _last_line(file) -> str:
    """The last line written to ``file`` (at most its last 4 kB), stripped."""
    file.seek(max(0, os.fstat(file.fileno()).st_size - 4096))
    lines = file.read().decode("utf-8", "replace").strip().splitlines()
    return lines[-1].strip() if lines else ""


def _installed(module) -> bool:
    where = getattr(module, "__file__", None)
    return bool(where) and os.path.realpath(where).startswith(library_dirs())


def _import_here(names) -> None:
    """Import in the kit's process the installed modules (torch's, Triton's: attn_spec.targets.loading.library_dirs)
    that a call imported lazily in its child, so that the next child inherits them instead of importing them again
    (Triton's first launch and torch.broadcast_shapes import about 2 s of modules). The target's own modules never
    are: their code runs only in children."""
    for name in sorted(names):
        if name not in sys.modules:
            with contextlib.suppress(Exception):
                importlib.import_module(name)


def _run(fn, args) -> tuple:
    try:
        return "returned", fn(*args)
    except Unsupported as exc:
        return "declined", str(exc), exc.total
    except BaseException as exc:  # noqa: BLE001 - whatever the target raises is sent back to be judged
        if isinstance(exc, NotImplementedError) and raised_on_purpose(exc):
            return "declined", f"raised NotImplementedError: {exc}", False
        try:
            text = str(exc)
        except BaseException:  # noqa: BLE001
            text = "(its message cannot be printed)"
        return "raised", type(exc).__name__, text, user_traceback(exc), raised_on_purpose(exc)


def _rebuilt(name: str, text: str, *, on_purpose: bool) -> BaseException:
    """The child's exception in the kit's process: a builtin type as itself (an ``assert`` stays an AssertionError,
    so an envelope's refusal reads as one: attn_spec.targets.envelope), any other as a class of its name. Its
    traceback stayed in the child, which read whether a statement of the target's own code raised it
    (loading.raised_on_purpose) and says so."""
    cls = getattr(builtins, name, None)
    exc = cls(text) if isinstance(cls, type) and issubclass(cls, Exception) else type(name, (Exception,), {})(text)
    exc.attn_spec_on_purpose = on_purpose
    return exc
