"""Calls into a submission that cannot see the kit around them (the child of ``grade`` and ``check --isolate``).

A kernel that detects its harness behaves when it is watched and cheats when it is not; the usual signs
are the harness's frames on its stack (``inspect.stack()``) and its modules in ``sys.modules``. In the
child, every call into the submission (its function, its module's constructor and forward) runs on one
*caller thread* started before the child confines itself (no new thread may be started afterwards):

- the caller thread's stack holds threading's bootstrap, one frame of code compiled from a string (file
  ``<attention call>``, module ``__call__``) and the submission's own frames: no frame of the kit;
- for the duration of the call, the kit's modules and the packages only the kit brought (:data:`HIDDEN`)
  are taken out of ``sys.modules`` (and put back after it; the kit's own code holds them by reference);
  a submission that imports one anyway gets the module object the process holds (grading's tripwires
  included), not a fresh copy from disk.

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
from importlib.machinery import ModuleSpec

import torch

HIDDEN = ("attn_spec", "hypothesis", "_hypothesis_ftz_detector", "_hypothesis_globals", "sortedcontainers",
          "tabulate", "pytest", "_pytest", "pluggy")  # top-level packages the kit brings into the child

# The caller thread's code, compiled from this string: no frame or class of it names the kit. While a call runs,
# the kit's modules are out of sys.modules, and a finder hands back the very module objects if the submission
# imports one (so it gets what the process holds, tripwires included, never a fresh copy from disk).
_LOOP = '''
class Finder:
    def __init__(self, modules):
        self.modules, self.specs = modules, {}

    def find_spec(self, name, path=None, target=None):
        module = self.modules.get(name)
        if module is None:
            return None
        self.specs[name] = module.__spec__
        return ModuleSpec(name, self, is_package=hasattr(module, "__path__"))

    def create_module(self, spec):
        return self.modules[spec.name]

    def exec_module(self, module):
        module.__spec__ = self.specs.pop(module.__name__, module.__spec__)


def serve(requests, packages):
    while True:
        fn, args, kwargs, grad, done = requests.get()
        names = [name for name in sys.modules if name.split(".", 1)[0] in packages]
        hidden = {name: sys.modules.pop(name) for name in names}
        finder = Finder(hidden)
        sys.meta_path.insert(0, finder)
        try:
            with set_grad_enabled(grad):
                done.append((True, fn(*args, **kwargs)))
        except BaseException as exc:
            done.append((False, exc))
        finally:
            sys.meta_path.remove(finder)
            for name, module in hidden.items():
                sys.modules.setdefault(name, module)
            fn = args = kwargs = hidden = finder = None
            done.ready.set()
'''


class _Done(list):
    def __init__(self):
        super().__init__()
        self.ready = threading.Event()


_requests: queue.SimpleQueue | None = None


def start() -> None:
    """Start the caller thread (once per process, before the process may start no more threads)."""
    global _requests
    if _requests is not None:
        return
    _requests = queue.SimpleQueue()
    scope = {"__name__": "__call__", "sys": sys, "ModuleSpec": ModuleSpec, "set_grad_enabled": torch.set_grad_enabled}
    exec(compile(_LOOP, "<attention call>", "exec"), scope)
    threading.Thread(target=scope["serve"], args=(_requests, HIDDEN), name="attention-call", daemon=True).start()


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
