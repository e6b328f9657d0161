"""``attn-spec check --isolate``: each TARGET runs in a grading child, the check stays in this process.

The child is the one ``attn-spec grade`` runs a submission in (zygote, sandbox, wire: see this package):
forked from a warm zygote, confined (own session, scratch folder, clean environment, rlimits, an
unprivileged user where we are root), talking raw bytes. Here an :class:`IsolatedTarget` (a
:class:`~attn_spec.grading.isolation.remote.RemoteTarget`) stands for the target, so the catalog, the probes
and the diagnosis run unchanged and everything that judges (the reference, the budgets, the RNG, the
verdict) stays in this process, out of the target's reach. In the child the target sees no kit frame on its
stack and no kit module in ``sys.modules`` while it runs (attn_spec.grading.isolation.hidden).

What it takes: ``path/to/file.py:name`` naming a function ``attention(Q, K, V, mask=None)`` or a module
class in the seed's form (``MultiHeadAttention(d_model, n_heads)``): the conventions grading calls. The file
is imported alone, copied into the child's scratch folder. Gradients cross the boundary as grading's
``vjp`` (the backward runs in the child). Nothing is forbidden (grading's tripwires stay unarmed).

A call that does not return within ``call_seconds``, or a child that dies, fails the property that made
the call with the grader's words (timeout, crashed, memory-limit, exited); the child is replaced and the
run goes on. After a timeout, the target's later calls are not made: each fails at once, naming it (a
hanging target costs one deadline, not one per call).
"""
from __future__ import annotations

import atexit
import os
from pathlib import Path

from attn_spec.checking.assertions import fail
from attn_spec.errors import KitUsageError, TargetLoadError
from attn_spec.grading.isolation import zygote
from attn_spec.grading.isolation.remote import RemoteTarget, Stopped, Zygote
from attn_spec.grading.submissions import Submission, prepare, remove, sandbox_ids

CONVENTIONS = ("function", "module")  # what a grading child can call
LIMITS = {"import_seconds": 60, "call_seconds": 60, "submission_seconds": 24 * 3600, "memory_mb": 16 * 1024,
          "output_kb": 256, "file_mb": 64, "source_kb": 4096, "folder_mb": 64}  # a check's, not a class's
TIMEOUT_CAUSE = "the target hangs (an endless loop, a wait that nothing ends) or is far slower than attention"


class Isolation:
    """The zygote of one check and the children of its targets; a context manager."""

    def __init__(self, call_seconds: float | None = None):
        self.limits = dict(LIMITS, **({"call_seconds": call_seconds} if call_seconds else {}))
        self.launched = zygote.launch(prefix="run-")
        self.targets: list[IsolatedTarget] = []
        try:
            self.zygote = Zygote(self.launched)
            self.ids = sandbox_ids(1)[0]
            self.zygote.wait_ready()
        except BaseException:
            self.launched.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for target in self.targets:
            target.close()
        self.launched.close()

    def target(self, spec: str, convention: str | None = None, *, devices=("cpu",),
               root: str | None = None) -> "IsolatedTarget":
        """The TARGET ``spec`` (path/to/file.py:name; ``root``: the folder a relative path is read from) in its own
        child. Raises TargetLoadError (it cannot be imported or names nothing callable) or KitUsageError (it is
        not a file, or its convention is not one a child can call)."""
        where, sep, attr = spec.rpartition(":")
        path = Path(root or ".", os.path.expanduser(where)) if sep else None
        if path is None or not where.endswith(".py") or "." in attr:
            raise KitUsageError(f"--isolate takes path/to/file.py:name targets, not {spec!r}")
        if not path.is_file():
            raise TargetLoadError(f"Cannot load target {spec!r}: there is no file {path}")
        if convention not in (None, *CONVENTIONS):
            raise KitUsageError(f"--isolate checks the {' and '.join(CONVENTIONS)} conventions (those `attn-spec grade` "
                                f"calls), not {convention}")
        target = IsolatedTarget(self, spec, path.resolve(), attr, convention, list(devices))
        self.targets.append(target)
        return target

    def spawn(self, path: Path, attr: str, devices: list) -> tuple[object, dict]:
        """A child with ``path`` imported: (child, its load report), or TargetLoadError saying why not."""
        scratch = os.path.join(self.launched.base, f"{len(os.listdir(self.launched.base)):05d}")
        os.mkdir(scratch, 0o700)
        problem = prepare(Submission(path.stem, path, path.name), scratch, self.ids, self.limits["folder_mb"])
        if problem:
            remove(scratch)
            raise TargetLoadError(f"Cannot isolate {path}: {problem}")
        config = {"scratch": scratch, "entry": path.name, "module": path.stem, "limits": self.limits, "forbidden": [],
                  "names": {c: attr for c in CONVENTIONS}, "devices": devices,
                  "uid": self.ids[0] if self.ids else None, "gid": self.ids[1] if self.ids else None}
        child = self.zygote.spawn(config)
        child.scratch = scratch
        try:
            scanned, _ = child.receive(self.limits["import_seconds"], "setting up its process")
            if scanned.get("stage") != "scanned":
                raise TargetLoadError(f"Cannot isolate {path}: {scanned.get('message') or scanned}")
            loaded, _ = child.receive(self.limits["import_seconds"], f"importing {path.name}")
        except Stopped as stop:
            _close(child)
            raise TargetLoadError(f"Cannot load {path} in its own process ({stop.outcome}): {stop.detail}") from None
        except BaseException:
            _close(child)
            raise
        if loaded.get("ok") is not True:
            _close(child)
            where = f" ({loaded['type']}: {loaded.get('message', '')})" if loaded.get("type") else \
                f": {loaded.get('message', loaded.get('outcome'))}"
            raise TargetLoadError(f"Cannot load {path} in its own process{where}\n{loaded.get('traceback', '')}".rstrip())
        return child, loaded


_shared: list[Isolation] = []


def shared() -> Isolation:
    """This process's Isolation, started at its first use and closed when the process exits (the command line,
    the API and the pytest plugin all check their TARGETs through it)."""
    if not _shared:
        _shared.append(Isolation())
        atexit.register(_shared[0].close)
    return _shared[0]


def _close(child) -> None:
    """End a child and remove its folder, once (a target's child may be ended by a stop and again at the end)."""
    if not getattr(child, "closed", False):
        child.closed = True
        child.close()
        remove(child.scratch)


class IsolatedTarget(RemoteTarget):
    """A TARGET checked through a grading child; a dead child is replaced, a hung one stops the calls."""

    def __init__(self, isolation: Isolation, spec: str, path: Path, attr: str, convention: str | None, devices: list):
        self.isolation, self.path, self.attr, self.devices = isolation, path, attr, devices
        child, loaded = isolation.spawn(path, attr, devices)
        found = [c for c in CONVENTIONS if c in (loaded.get("found") or [])]
        if convention and convention not in found or not found:
            _close(child)
            kind = (loaded.get("kinds") or {}).get("function", "nothing")
            raise KitUsageError(f"--isolate: {spec} is {kind}: neither a function attention(Q, K, V, mask=None) nor a "
                                f"module class in the seed's form (MultiHeadAttention(d_model, n_heads))")
        super().__init__(child, convention or found[0], spec)
        self.hung: Stopped | None = None

    def close(self) -> None:
        _close(self.child)

    def _remote(self, method: str, args: list, n_results: int, call: str, **kwargs):
        if self.hung is not None:
            fail(f"{call} was not made: an earlier call {self.hung.detail}", cause=TIMEOUT_CAUSE)
        try:
            return super()._remote(method, args, n_results, call, **kwargs)
        except Stopped as stop:
            _close(self.child)
            self.child, _ = self.isolation.spawn(self.path, self.attr, self.devices)  # the run goes on with a fresh process
            if stop.outcome == "timeout":
                self.hung = stop
                fail(f"{call} did not return: {stop.detail}", cause=TIMEOUT_CAUSE)
            fail(f"{call}: its process stopped ({stop.outcome}): {stop.detail}",
                 cause=f"the target {'crashed' if stop.outcome == 'crashed' else 'ended its process'} in this call")
