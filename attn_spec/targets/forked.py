"""A call that can kill the process, run in a forked child: the CPU flash op of torch 2.13 dies with SIGFPE on
zero keys (pytorch #141219), and a header probe or a property must not take the whole check down with it.

The child runs single-threaded (an OpenMP pool forked mid-use hangs the child otherwise) and sends its result
back through a pipe, read while the child runs (a result larger than the pipe's buffer would block it); a
child killed by a signal is reported by the signal's name, one that does not finish in time is killed.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import select
import signal
import time

import torch

from attn_spec.targets.deadline import timeout as call_deadline


def call_in_child(fn, *, timeout: float = 20.0) -> tuple[str, object]:
    """``fn()`` in a forked child: ("value", its result), ("raises", (exception type name, its text, whether it
    is an attn_spec.Unsupported)), ("crashes", signal name), ("hangs", None), or ("unrun", why)."""
    if not hasattr(os, "fork"):
        return "unrun", "no fork on this platform"
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
            from attn_spec.errors import Unsupported

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
    finally:
        os.close(read)


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
