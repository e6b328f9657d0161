"""Calls into a submission that cannot see the kit around them (the child of ``grade`` and ``check --isolate``).

A kernel that detects its harness behaves when it is watched and cheats when it is not; the usual signs
are the harness's frames on its stack (``inspect.stack()``) and its modules in ``sys.modules``. In the
child, every call into the submission (its function, its module's constructor and forward) runs on one
*caller thread* started before the child confines itself (no new thread may be started afterwards):

- the caller thread's stack holds threading's bootstrap, one frame of code compiled from a string (file
  ``<attention call>``, module ``__call__``) and the submission's own frames: no frame of the kit;
- for the duration of the call, the kit's modules and the packages only the kit brought (:data:`HIDDEN`)
  are taken out of ``sys.modules`` (and put back after it; the kit's own code holds them by reference).

What this cannot hide, and no in-process measure could: the kit's thread, blocked waiting for the call
(``sys._current_frames()``), the kit's objects on the heap (``gc.get_objects()``), files on disk, and the
name the grader imports the file under. The reference, budgets, RNG and verdict are in another process
all the same: seeing the kit is not reaching it. A kernel that detects a harness by other means (timing,
its inputs' statistics) cannot be told apart from one that is right by any black-box check.
"""
from __future__ import annotations

import queue
import sys
import threading

import torch

HIDDEN = ("attn_spec", "hypothesis", "_hypothesis_ftz_detector", "_hypothesis_globals", "sortedcontainers",
          "tabulate", "pytest", "_pytest", "pluggy")  # top-level packages the kit brings into the child

_LOOP = '''
def serve(requests, hide):
    while True:
        fn, args, kwargs, grad, done = requests.get()
        hidden = hide()
        try:
            with set_grad_enabled(grad):
                done.append((True, fn(*args, **kwargs)))
        except BaseException as exc:
            done.append((False, exc))
        finally:
            restore(hidden)
            fn = args = kwargs = None
            done.ready.set()
'''


class _Done(list):
    def __init__(self):
        super().__init__()
        self.ready = threading.Event()


def _kit_modules(name: str) -> bool:
    return name.split(".", 1)[0] in HIDDEN


def hide() -> dict:
    """Take the kit's modules out of sys.modules; returns them, for :func:`restore`."""
    return {name: sys.modules.pop(name) for name in [n for n in sys.modules if _kit_modules(n)]}


def restore(hidden: dict) -> None:
    for name, module in hidden.items():
        sys.modules.setdefault(name, module)


_requests: queue.SimpleQueue | None = None


def start() -> None:
    """Start the caller thread (once per process, before the process may start no more threads)."""
    global _requests
    if _requests is not None:
        return
    _requests = queue.SimpleQueue()
    scope = {"__name__": "__call__", "set_grad_enabled": torch.set_grad_enabled, "restore": restore}
    exec(compile(_LOOP, "<attention call>", "exec"), scope)
    threading.Thread(target=scope["serve"], args=(_requests, hide), name="attention-call", daemon=True).start()


def call(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` on the caller thread, in this thread's grad mode; its exception re-raised here.
    Without a caller thread (not started), a plain call."""
    if _requests is None:
        return fn(*args, **kwargs)
    done = _Done()
    _requests.put((fn, args, kwargs, torch.is_grad_enabled(), done))
    done.ready.wait()
    ok, value = done.pop()
    if ok:
        return value
    raise value.with_traceback(value.__traceback__)
