"""A call into the user's code may not change what the kit depends on: it is restored after every call.

Every call into a target (its forward, its backward, building and loading a module, importing it)
runs inside :meth:`StateGuard.call`. The guard reads the global state below before the call and
after it; whatever the call changed is put back and remembered, so that the report can say what
the target changed, and no later property or target sees the change:

- grad mode, the default dtype and device, the float32 matmul precision;
- ``torch.backends`` flags (TF32, reduced-precision reductions, cuDNN, oneDNN, the SDPA backends),
  deterministic algorithms, anomaly detection, the number of threads;
- the global RNG, when the target reseeds it (``torch.manual_seed``): the state before the call
  comes back (a target that merely draws random numbers keeps the stream it advanced);
- ``sys.stdout``/``sys.stderr`` and the working directory.

(The warnings filters are restored after each property by the capture of its output,
attn_spec.targets.capture; per call they would blame a target for what a lazy import adds.)

It also tells the user's Ctrl-C from a ``KeyboardInterrupt`` the target raises itself: while a
call runs in the main thread, SIGINT is noted before the usual handler raises. Only the real
one stops the run (:func:`passes_through`). And it puts each call under its deadline
(attn_spec.targets.deadline).
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading

import torch

from attn_spec.errors import KitSignal, TargetHung
from attn_spec.targets.deadline import limit
from attn_spec.targets.integrity import Outputs, Snapshot

_cuda, _cudnn, _mkldnn = torch.backends.cuda, torch.backends.cudnn, torch.backends.mkldnn


def _flag(owner, name):
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _sdp(name):
    return getattr(_cuda, f"{name}_sdp_enabled"), getattr(_cuda, f"enable_{name}_sdp")


def _set_deterministic(value):
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _default_device():
    """The device set with torch.set_default_device, or None (torch.get_default_device says "cpu" for both)."""
    context = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    return None if context is None else context.device


def _set_streams(value):
    sys.stdout, sys.stderr = value


# name -> (read, restore). Cheap reads: the guard costs about 15 us a call.
STATE = {
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "default device": (_default_device, torch.set_default_device),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "torch.backends.cuda.matmul.allow_tf32": _flag(_cuda.matmul, "allow_tf32"),
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
        _flag(_cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
        _flag(_cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    "torch.backends.cudnn.enabled": _flag(_cudnn, "enabled"),
    "torch.backends.cudnn.allow_tf32": _flag(_cudnn, "allow_tf32"),
    "torch.backends.cudnn.deterministic": _flag(_cudnn, "deterministic"),
    "torch.backends.cudnn.benchmark": _flag(_cudnn, "benchmark"),
    "torch.backends.mkldnn.enabled": _flag(_mkldnn, "enabled"),
    "flash SDPA backend": _sdp("flash"),
    "memory-efficient SDPA backend": _sdp("mem_efficient"),
    "math SDPA backend": _sdp("math"),
    "cuDNN SDPA backend": _sdp("cudnn"),
    "deterministic algorithms": ((lambda: (torch.are_deterministic_algorithms_enabled(),
                                           torch.is_deterministic_algorithms_warn_only_enabled())),
                                 _set_deterministic),
    "anomaly detection": (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    "number of threads": (torch.get_num_threads, torch.set_num_threads),
    "global RNG seed": (torch.initial_seed, None),  # restored from the saved RNG state, below
    "sys.stdout/sys.stderr": ((lambda: (sys.stdout, sys.stderr)), _set_streams),
    "working directory": (os.getcwd, os.chdir),
}
_READS = tuple(read for read, _ in STATE.values())


def _describe(name: str, before, after) -> str:
    if name == "grad mode":
        return f"left {'on' if after else 'off'}"
    if name == "global RNG seed":
        return f"reseeded (torch.manual_seed({after}))"
    if name == "sys.stdout/sys.stderr":
        return "replaced"
    if isinstance(after, bool):
        return "turned on" if after else "turned off"
    return f"set to {after}"


@contextlib.contextmanager
def _watching_ctrl_c():
    """A KeyboardInterrupt raised while no SIGINT arrived is marked as the target's own.

    Only in the main thread (the only one that receives signals); elsewhere every
    KeyboardInterrupt is taken as the user's."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous, pressed = signal.getsignal(signal.SIGINT), []

    def on_sigint(signum, frame):
        pressed.append(signum)
        if previous is signal.SIG_IGN:
            return
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    except KeyboardInterrupt as exc:
        if not pressed:
            exc.attn_raised_by_target = True
        raise
    finally:
        signal.signal(signal.SIGINT, previous)


def passes_through(exc: BaseException) -> bool:
    """True for what must stop a call's caller, not be reported as the target's: the kit's own
    control-flow signals, a call past its deadline (TargetHung: attn_spec.targets.deadline), and the
    user's Ctrl-C (a KeyboardInterrupt the target raises itself is the target's; one that cannot be
    told apart is taken as the user's)."""
    return isinstance(exc, (KitSignal, TargetHung)) or (isinstance(exc, KeyboardInterrupt)
                                          and not getattr(exc, "attn_raised_by_target", False))


class StateGuard:
    """Restores the global state after each call into one target; ``changes`` says what it changed.

    ``changes``: name -> (what changed, the call that first changed it), in the order found.
    ``tampered``: torch's functions and the kit's own objects the target replaced (attn_spec.targets.integrity),
    name -> (what it did, when), found and undone by :meth:`verify`; a target that tampered does not conform.
    """

    def __init__(self):
        self.changes: dict[str, tuple[str, str]] = {}
        self.tampered: dict[str, tuple[str, str]] = {}
        self.kit = Snapshot()  # torch and the kit as they were when the kit got the target
        self.outputs = Outputs()  # the last output it returned, to compare after the next call
        self.in_child = False  # each call runs in a forked child (a kernel under Triton's interpreter: attn_spec.targets.forked)

    def verify(self, when: str) -> list[str]:
        """Undo whatever the target replaced in torch or the kit since the snapshot (``when``: "at import",
        "during matches-reference", ...); returns the names it replaced now."""
        found = self.kit.restore()
        for name, change in found:
            self.tampered.setdefault(name, (change, when))
        return [name for name, _ in found]

    @contextlib.contextmanager
    def call(self, call: str, *, deadline: float = 1.0):
        """The call ``call`` (as the user would write it), under ``deadline`` times a call's deadline."""
        before = tuple(read() for read in _READS)
        rng = torch.get_rng_state()
        try:
            with _watching_ctrl_c(), limit(call, deadline):  # past its deadline: TargetHung
                yield
        finally:
            after = tuple(read() for read in _READS)
            if after != before:
                self._restore(before, after, rng, call)

    def _restore(self, before, after, rng, call):
        for (name, (_, restore)), old, new in zip(STATE.items(), before, after):
            if old == new:
                continue
            if restore is None:
                torch.set_rng_state(rng)
            else:
                restore(old)
            self.changes.setdefault(name, (_describe(name, old, new), call))

    def notes(self) -> list[dict]:
        """The changes for the report: ``[{"state": ..., "change": ..., "during": ...}]``."""
        return [{"state": name, "change": change, "during": call} for name, (change, call) in self.changes.items()]
