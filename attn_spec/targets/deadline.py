"""A deadline on every call into a target: one that does not return in time fails its property ("did not return
within 10 s") and the check goes on; one that cannot be interrupted ends the process with a message.

How long: the ``call-timeout`` setting, in seconds (default 10, the grader's ``call_seconds``: a small case takes
a correct attention milliseconds, a plain Python loop over its entries a few seconds), for every call on a case
of up to SMALL_WORK multiply-adds, b * n_q * n_kv * (d_k + d_v) (about the largest the default profile draws;
the header's probes are smaller); proportionally longer on a larger case (a ``--shapes`` rung, a thorough one), so a target as
slow per multiply-add as one that just makes the deadline at SMALL_WORK makes it everywhere. A target's import
gets IMPORT_FACTOR times as long (a heavy library imports slowly), unscaled. 0 disables the deadline.

How: in the main thread, SIGALRM (``signal.setitimer``) raises :class:`DeadlinePassed` in the call. It is a
KitSignal, so a target's ``except Exception`` lets it through; a target that catches it anyway (``except
BaseException``) is stopped at its next line: the alarm repeats every REPEAT seconds and, once the deadline
has passed, a trace function raises it again in the target's frames until the call unwinds (an exception
raised in an ``except`` clause leaves its ``try``), and a call that returns after its deadline fails all the
same: the call then raises :class:`attn_spec.errors.TargetHung`, a failure of its property with the target's
traceback where it was stopped. A call stuck in native code never returns to the interpreter and cannot be
stopped in the process: a watchdog thread waits a grace period past the deadline (as long again, at least
GRACE seconds), writes what hung (target, call, property, case) to stderr and ends the process with EXIT_HUNG
(3). Outside the main thread (no signals there) and where there is no SIGALRM, only the watchdog. A call made
inside another call (a module built inside a property's call) runs under the outer call's deadline. A call
still compiling at its deadline (torch.compile: Dynamo, AOTAutograd, Inductor, Triton frames on its stack) is
not hanging: it gets another deadline's time, up to COMPILING times in all.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from attn_spec.exit_codes import EXIT_HUNG
from attn_spec.errors import KitSignal, TargetHung
from attn_spec.targets.tracebacks import user_traceback

DEFAULT_SECONDS = 10.0  # a call on a small case (the grader's call_seconds)
SMALL_WORK = 2 ** 27  # multiply-adds the default deadline covers: 1 x 4 x 512 x 512 x (64 + 64)
IMPORT_FACTOR = 6  # an import gets 60 s by default
GRACE = 2.0  # seconds past the deadline, at least, before the watchdog ends a process stuck in native code
REPEAT = 0.05  # seconds between alarms once the deadline has passed, until the call unwinds
POLL = 0.25  # seconds between the watchdog's looks
COMPILING = 30  # a call that is compiling (torch.compile) at its deadline gets more, up to 30 times the deadline
COMPILERS = tuple(os.path.join("", *parts, "") for parts in (("torch", "_dynamo"), ("torch", "_functorch"),
                                                             ("torch", "_inductor"), ("triton",)))
_KIT = os.path.join(str(Path(__file__).resolve().parents[1]), "")  # attn_spec/: the kit's own frames, never stopped

_SECONDS: contextvars.ContextVar = contextvars.ContextVar("attn_spec_call_timeout", default=DEFAULT_SECONDS)
_CASE: contextvars.ContextVar = contextvars.ContextVar("attn_spec_call_case", default=(0, None))  # (work, where)
_active = threading.local()  # .on: a call of this thread is under a deadline already


class DeadlinePassed(KitSignal):
    """A call into the target did not return within ``seconds`` (a KitSignal: the target's ``except Exception``
    does not catch it)."""

    def __init__(self, seconds: float):
        super().__init__(f"did not return within {words(seconds)}")
        self.seconds = seconds


def words(seconds: float) -> str:
    return f"{seconds:.3g} s"


@contextlib.contextmanager
def timeout(seconds):
    """Calls made in this block have ``seconds`` (the setting; 0: no deadline) on a small case; None leaves the
    current one."""
    if seconds is None:
        yield
        return
    token = _SECONDS.set(float(seconds))
    try:
        yield
    finally:
        _SECONDS.reset(token)


def work(case) -> int:
    """The multiply-adds of attention on ``case``: b * n_q * n_kv * (d_k + d_v) (a multi-head case: 2 d_model)."""
    dims = getattr(case, "d_k", 0) + getattr(case, "d_v", 0) or 2 * getattr(case, "d_model", 1)
    return math.prod(getattr(case, "batch", ()) or (1,)) * getattr(case, "n_q", 1) * getattr(case, "n_kv", 1) * dims


@contextlib.contextmanager
def on_case(case, where=None):
    """Calls made in this block are on ``case``: their deadline scales with its work; ``where()`` (the property,
    the case, in words) is what the watchdog names if one cannot be stopped."""
    token = _CASE.set((work(case), where))
    try:
        yield
    finally:
        _CASE.reset(token)


def seconds_now(factor: float = 1.0) -> float:
    """The deadline of a call made now, in seconds (0: none)."""
    seconds, (case_work, _) = _SECONDS.get(), _CASE.get()
    return seconds * factor * max(1.0, case_work / SMALL_WORK)


class _Watchdog(threading.Thread):
    """Ends the process when a call is still running a grace period past its deadline (a call stuck in native code;
    one still compiling gets more time). It looks every POLL seconds, so that arming it costs a call nothing."""

    def __init__(self):
        super().__init__(daemon=True, name="attn-spec call watchdog")
        self.watching, self.pid = {}, os.getpid()  # thread id -> its running call's limit

    def watch(self, call: "limit | None") -> None:
        """Watch this thread's ``call`` (None: its call has returned)."""
        if call is None:
            self.watching.pop(threading.get_ident(), None)
        else:
            self.watching[threading.get_ident()] = call

    def run(self) -> None:
        while True:
            time.sleep(POLL)
            for thread, call in list(self.watching.items()):
                if time.monotonic() > call.start + call.allowed + call.grace and \
                        not call.more_if_compiling(sys._current_frames().get(thread)):
                    try:
                        what = call.hung()
                    except Exception as exc:  # noqa: BLE001 - a case whose summary fails: still end, saying so
                        what = f"{call.call} did not return in time ({type(exc).__name__} describing its case)"
                    _end(what)


_WATCHDOG: dict[str, _Watchdog] = {}  # the process's one watchdog, kept in a dict: the kit's modules bind no
# name after import (attn_spec.targets.integrity takes a rebound name for a target's patch)


def _watcher() -> _Watchdog:
    """The process's watchdog (a forked child starts its own: threads do not survive a fork)."""
    found = _WATCHDOG.get("watchdog")
    if found is None or found.pid != os.getpid():
        found = _WATCHDOG["watchdog"] = _Watchdog()
        found.start()
    return found


def _end(what: str) -> None:
    for stream in (sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    with contextlib.suppress(OSError):  # the file descriptor itself: sys.stderr may be a capture
        os.write(2, f"\nattn-spec: {what}\nattn-spec: it could not be interrupted (stuck in native code?), so the "
                    f"check stops here, with exit status {EXIT_HUNG}: fix the hang, or raise --call-timeout if the "
                    f"call is only slow\n".encode("utf-8", "replace"))
    os._exit(EXIT_HUNG)


def _in_target(frame) -> bool:
    return frame is not None and not frame.f_code.co_filename.startswith(_KIT)


def _compiling(frame) -> bool:
    """Is torch.compile at work in this stack (Dynamo tracing, AOTAutograd, Inductor or Triton compiling)?"""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in COMPILERS):
            return True
        frame = frame.f_back
    return False


class limit:
    """``with limit(call):`` the call into the target (``call``: as the user would write it) under its deadline."""

    def __init__(self, call: str, factor: float = 1.0):
        self.call, self.seconds = call, seconds_now(factor)
        self.allowed = self.seconds  # more, period by period, while torch.compile is at work
        self.grace = max(GRACE, self.seconds)  # past what is allowed, before the watchdog ends the process
        self.on = bool(self.seconds) and not getattr(_active, "on", False)
        self.passed, self.alarm = False, False

    def __enter__(self):
        if not self.on:
            return self
        _active.on, self.start, self.where = True, time.monotonic(), _CASE.get()[1]
        _watcher().watch(self)
        if hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread():
            self.alarm, self.trace = True, sys.gettrace()
            self.handler = signal.signal(signal.SIGALRM, self._on_alarm)
            self.timer = signal.setitimer(signal.ITIMER_REAL, self.seconds, REPEAT)
        return self

    def more_if_compiling(self, frame) -> bool:
        """One more deadline's time if torch.compile is at work in ``frame``'s stack and the call has had less than
        COMPILING deadlines: True if it got it."""
        if self.allowed >= COMPILING * self.seconds or not _compiling(frame):
            return False
        self.allowed += self.seconds
        return True

    def hung(self) -> str:
        """What hung, in words: the call, its deadline, the property and case."""
        return f"{self.call} did not return within {words(self.allowed)}" + (f" ({self.where()})" if self.where else "")

    def _on_alarm(self, signum, frame):
        if not _in_target(frame):  # the kit's own code, around the call: the call has returned
            return
        if self.more_if_compiling(frame):  # compiling is not hanging
            signal.setitimer(signal.ITIMER_REAL, self.seconds, REPEAT)
            return
        self.passed = True
        stop, inside = DeadlinePassed(self.allowed), set()  # inside: the target's frames, up to the kit's call

        def trace(frame, event, arg):  # the next line the target runs raises it again: no except clause keeps it
            if event == "call":  # a frame the target's code calls is the target's too
                if id(frame.f_back) not in inside:
                    return None
                inside.add(id(frame))
            if event == "line":
                raise stop
            return trace

        while _in_target(frame):
            inside.add(id(frame))
            frame.f_trace = trace
            frame = frame.f_back
        sys.settrace(trace)
        raise stop

    def __exit__(self, kind, exc, tb):
        if not self.on:
            return False
        if self.alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, self.handler)
            if self.passed:
                sys.settrace(self.trace)
            if self.timer[0] > 0:  # someone else's alarm (pytest-timeout): what was left of it
                signal.setitimer(signal.ITIMER_REAL, max(1e-3, self.timer[0] - (time.monotonic() - self.start)),
                                 self.timer[1])
        _watcher().watch(None)
        _active.on = False
        if not self.passed:
            return False
        if not isinstance(exc, DeadlinePassed):  # it caught the interrupt, and returned or raised another
            exc = DeadlinePassed(self.allowed)
        raise TargetHung(exc, self.call, self.allowed, user_traceback(exc), stopped_at(exc)) from None


def stopped_at(exc: BaseException) -> str:
    """Where the target's code was when ``exc`` stopped it: ``file.py:3 in spin``, its innermost frame outside
    the kit ("" if none)."""
    tb, found = exc.__traceback__, ""
    while tb is not None:
        if _in_target(tb.tb_frame):
            code = tb.tb_frame.f_code
            found = f"{os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name}"
        tb = tb.tb_next
    return found
