"""A probe that can kill the process, run in a forked child: the CPU flash op of torch 2.13 dies with SIGFPE on
zero keys (pytorch #141219), and a header probe must not take the whole check down with it.

The child runs single-threaded (an OpenMP pool forked mid-use hangs the child otherwise) and sends its result
back through a pipe; a child killed by a signal is reported by the signal's name, one that does not finish in
time is killed.
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import time

import torch


def in_child(fn, *, timeout: float = 20.0) -> str:
    """``fn()``'s string result, computed in a forked child: or "crashes (SIGFPE)", "raises (E)", "hangs"."""
    if not hasattr(os, "fork"):
        return "unprobed (no fork on this platform)"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read)
        faulthandler.disable()  # a crash is the result, not a traceback on the parent's stderr
        torch.set_num_threads(1)
        try:
            result = str(fn())
        except BaseException as exc:  # noqa: BLE001 - the probe's outcome, whatever it is
            result = f"raises ({type(exc).__name__})"
        os.write(write, pickle.dumps(result))
        os._exit(0)
    os.close(write)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.WIFSIGNALED(status):
                    return f"crashes ({signal.Signals(os.WTERMSIG(status)).name})"
                data = os.read(read, 1 << 16)
                return pickle.loads(data) if data else "exits without a result"
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return "hangs"
    finally:
        os.close(read)
