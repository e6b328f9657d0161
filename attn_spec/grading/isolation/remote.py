"""The grader's side of a submission's process: spawn it, talk to it, time it, kill it.

- :class:`Zygote` is the grader's handle on the warm process: it asks it for one child per submission.
- :class:`Child` is one submission's process: every exchange has a deadline; a timeout, a death,
  or a reply that is not valid data raises :class:`Stopped` with the matching outcome.
- :class:`RemoteTarget` is an ordinary :class:`attn_spec.targets.conventions.Target` whose calls go to the
  child; replies are rebuilt as plain tensors and checked here, so the catalog runs unchanged.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import threading
import time
import warnings

import torch

from attn_spec.checking.assertions import fail
from attn_spec.targets.conventions import Target, attend_shape, check_output
from attn_spec.errors import Failure, IsolationError, KitSignal, TargetRaised, Unsupported
from attn_spec.grading.isolation import wire, zygote
from attn_spec.grading.isolation.wire import BROKEN

SPAWN_SECONDS = 30  # for the zygote to fork a child (it only forks)
STATUS_SECONDS = 5  # for a dead or killed child's exit status to arrive
CRASH_SIGNALS = {signal.SIGSEGV: "a segmentation fault", signal.SIGBUS: "a bus error",
                 signal.SIGABRT: "an abort", signal.SIGILL: "an illegal instruction",
                 signal.SIGFPE: "a floating-point exception"}
BAD_OUTPUT_CAUSE = "return the output itself: one plain torch.Tensor (not a subclass, list, tuple or other object)"
MAX_HITS = 50  # distinct forbidden names kept per submission
_HIT = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,199}")


class Stopped(KitSignal):
    """Grading this submission stops: its process timed out, died, or sent something that is not data.

    A BaseException on purpose: it must pass through the property's body and Hypothesis (which
    treat any Exception as a failing example and would try to shrink it) straight to the grader.
    """

    def __init__(self, outcome: str, detail: str):
        super().__init__(f"{outcome}: {detail}")
        self.outcome, self.detail = outcome, detail


class ZygoteError(IsolationError):
    """The warm worker could not start or stopped answering (a problem of the machine, not a submission)."""


def classify(status: dict | None, killed_by_grader: bool) -> tuple[str, str]:
    """(outcome, detail) for a child that died while the grader was waiting for it."""
    if status is None:
        return "crashed", "its process vanished without an exit status"
    sig = status.get("signal")
    if sig is None and status.get("code") == BROKEN:
        return "crashed", ("the grading code in its process failed (did the submission replace something "
                           "in torch or Python that it relies on?)")
    if sig is None:
        return "exited", (f"it ended its own process (sys.exit or os._exit, exit status {status.get('code')}) "
                          "before grading finished")
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    if sig == signal.SIGXCPU:
        return "timeout", "it used more CPU time than the whole submission is allowed"
    if sig == signal.SIGKILL and not killed_by_grader:
        return "memory-limit", "the system killed it (out of memory)"
    if sig in CRASH_SIGNALS:
        return "crashed", f"its process crashed with {CRASH_SIGNALS[sig]} ({name}), in native code it called"
    return "crashed", f"its process was killed by {name}"


class OutputDrain(threading.Thread):
    """Reads a child's stdout+stderr pipe to the end, keeping the first ``keep`` bytes."""

    def __init__(self, fd: int, keep: int):
        super().__init__(daemon=True)
        self.fd, self.keep, self.data, self.total = fd, keep, bytearray(), 0
        self.start()

    def run(self) -> None:
        with os.fdopen(self.fd, "rb", buffering=0) as pipe:
            while chunk := pipe.read(1 << 16):
                self.total += len(chunk)
                if len(self.data) < self.keep:
                    self.data += chunk[:self.keep - len(self.data)]

    def text(self) -> str:
        text = self.data.decode("utf-8", "replace")
        if self.total > len(self.data):
            text += f"\n[... {self.total - len(self.data)} more bytes not kept]"
        return text


class Child:
    """One submission's process, as seen from the grader."""

    def __init__(self, chan: socket.socket, ctrl: socket.socket, out_fd: int, hits_fd: int, limits: dict, devices):
        self.chan, self.ctrl, self.limits, self.devices = wire.Channel(chan), ctrl, limits, tuple(devices)
        self.output = OutputDrain(out_fd, int(limits["output_kb"] * 1024))
        self.hits_fd, self._hits_buf = hits_fd, b""  # the tripwires' reports, one name per line (non-blocking)
        self.deadline = time.monotonic() + limits["submission_seconds"]
        self.forbidden: set[str] = set()
        self.stopped: Stopped | None = None
        self.status: dict | None = None
        self._killed = False

    # ------------------------------------------------------------ ending

    def kill(self) -> None:
        if not self._killed:
            self._killed = True
            try:
                wire.send_message(self.ctrl, {"kill": True})
            except OSError:
                pass

    def _wait_status(self, seconds: float) -> dict | None:
        if self.status is None:
            try:
                message, _ = wire.recv_message(self.ctrl, timeout=seconds)
            except (OSError, ValueError):
                message = None
            if message is not None and isinstance(message.get("status"), dict):
                self.status = dict(message["status"], killed_by_grader=bool(message.get("killed_by_grader")))
        return self.status

    def _stop(self, outcome: str, detail: str):
        self.kill()
        self.stopped = Stopped(outcome, detail)
        raise self.stopped

    def _died(self, what: str):
        """The connection closed: find out how the process ended."""
        status = self._wait_status(STATUS_SECONDS)
        if status is None:  # still alive: it closed the connection itself
            self._stop("crashed", f"it closed its connection to the grader during {what}")
        outcome, detail = classify(status, status["killed_by_grader"])
        self._stop(outcome, f"{detail} (during {what})")

    def close(self) -> None:
        """Kill the process group (always, at the end), collect the status, release everything."""
        self.kill()
        self._wait_status(STATUS_SECONDS)
        self.read_hits()  # the child is dead: whatever it reported is in the pipe
        for sock in (self.chan, self.ctrl):
            sock.close()
        os.close(self.hits_fd)
        self.output.join(STATUS_SECONDS)

    def read_hits(self) -> None:
        """Record the forbidden calls the child's tripwires reported so far (each before the call ran)."""
        while True:
            try:
                chunk = os.read(self.hits_fd, 1 << 16)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            lines = (self._hits_buf + chunk).split(b"\n")
            self._hits_buf = lines.pop()[-256:]
            for line in lines:
                name = line.decode("ascii", "replace")
                if _HIT.fullmatch(name) and (name in self.forbidden or len(self.forbidden) < MAX_HITS):
                    self.forbidden.add(name)

    # ------------------------------------------------------------ talking

    def receive(self, seconds: float, what: str, max_bytes: int = 1 << 28) -> tuple[dict, list]:
        if self.stopped:
            raise self.stopped
        limit = "the whole submission's time limit"
        deadline = time.monotonic() + seconds
        if deadline > self.deadline:
            deadline, seconds = self.deadline, None
        try:
            return self.chan.recv(deadline, max_bytes=max_bytes, devices=self.devices)
        except TimeoutError:
            self._stop("timeout", f"{what} took longer than {f'{seconds:g} s' if seconds else limit}")
        except (wire.PeerClosed, ConnectionError):
            self._died(what)
        except wire.ProtocolError as exc:  # whatever it sent (recv turns every undecodable frame into one)
            self._stop("bad-output", f"its reply to {what} was not valid data: {exc}"[:1000])
        finally:
            self.read_hits()

    def request(self, header: dict, tensors: list, what: str, seconds: float | None = None) -> tuple[dict, list]:
        """Send a request, wait for its reply: at most ``seconds`` (default: the rubric's call_seconds)."""
        if self.stopped:
            raise self.stopped
        seconds = seconds or self.limits["call_seconds"]
        try:
            self.chan.send(header, tensors, min(self.deadline, time.monotonic() + seconds))
        except TimeoutError:
            self._stop("timeout", f"{what}: it stopped reading its input")
        except (ConnectionError, OSError):
            self._died(what)
        size = sum(t.numel() * t.element_size() for t in tensors)
        return self.receive(seconds, what, max_bytes=8 * size + (64 << 20))


class Zygote:
    """The grader's handle on a launched zygote: asks it for one confined child per submission."""

    def __init__(self, launched: zygote.Launch):
        self.sock, self.lock = launched.sock, threading.Lock()

    def wait_ready(self, seconds: float = 180) -> None:
        try:
            ready, _ = wire.recv_message(self.sock, timeout=seconds)
        except (OSError, ValueError):
            ready = None
        if not ready:
            raise ZygoteError("the grading worker did not start (see its error above)")
        if ready.get("threads") != 1:  # fork() copies one thread: another one's locks would stay held
            warnings.warn(f"the grading worker runs {ready.get('threads')} threads; its children may hang")

    def spawn(self, config: dict) -> Child:
        chan, chan_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ctrl, ctrl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        out_r, out_w = os.pipe()
        hits_r, hits_w = os.pipe()
        os.set_blocking(hits_r, False)
        try:
            with self.lock:
                wire.send_message(self.sock, {"config": config},
                                  [chan_child.fileno(), ctrl_child.fileno(), out_w, hits_w])
        except OSError as exc:
            for s in (chan, ctrl):
                s.close()
            os.close(out_r)
            os.close(hits_r)
            raise ZygoteError(f"the grading worker is gone: {exc}") from None
        finally:
            chan_child.close()
            ctrl_child.close()
            os.close(out_w)
            os.close(hits_w)
        try:
            message, _ = wire.recv_message(ctrl, timeout=SPAWN_SECONDS)
        except (OSError, ValueError):
            message = None
        if not message or type(message.get("pid")) is not int:
            for s in (chan, ctrl):  # the monitor, if any, kills its child when ctrl closes
                s.close()
            os.close(out_r)
            os.close(hits_r)
            raise ZygoteError("the grading worker did not start a child")
        return Child(chan, ctrl, out_r, hits_r, config["limits"], config["devices"])


# ---------------------------------------------------------------- the target


_REMOTE_TYPES: dict[str, type] = {}


def _remote_exception(type_name, message) -> Exception:
    """An exception that prints like the child's (same class name), without any of its objects."""
    name = type_name if isinstance(type_name, str) and type_name.isidentifier() else "Exception"
    name = name[:80]
    if name not in _REMOTE_TYPES:
        _REMOTE_TYPES[name] = type(name, (Exception,), {"__module__": "submission"})
    return _REMOTE_TYPES[name](str(message)[:4000])


class RemoteTarget(Target):
    """A target living in a child process; the catalog's properties run on it unchanged."""

    def __init__(self, child: Child, convention: str, name: str):
        super().__init__(None, name)
        self.convention, self.child = convention, child
        self.bad_output = False  # a reply was not a plain tensor; the grader reads and resets it

    def _remote(self, method: str, args: list, n_results: int, call: str, **kwargs) -> list[torch.Tensor]:
        sent: list = []
        header = {"op": "call", "convention": self.convention, "method": method, "args": wire.pack(args, sent),
                  "kwargs": wire.pack(kwargs, sent)}
        reply, tensors = self.child.request(header, sent, call)
        try:
            return self._read_reply(reply, tensors, sent, n_results, call)
        except (Stopped, Failure, Unsupported):
            raise
        except Exception as exc:  # noqa: BLE001 - a reply that breaks our reading of it is the submission's
            self.child._stop("bad-output", f"its reply to {call} could not be read ({type(exc).__name__}: {exc})"[:1000])

    def _read_reply(self, reply: dict, tensors: list, sent: list, n_results: int, call: str) -> list[torch.Tensor]:
        self._write_back(reply.get("inputs"), sent, tensors, call)
        error = reply.get("error")
        if error is None:
            result = reply.get("result")
            if not (isinstance(result, list) and len(result) == n_results):
                self.child._stop("bad-output", f"its reply to {call} does not hold {n_results} tensor(s)")
            return [self._tensor(ref, tensors, call) for ref in result]
        message = str(reply.get("message", ""))[:4000]
        if error == "bad-output":
            self.bad_output = True
            fail(message, cause=BAD_OUTPUT_CAUSE)  # worded by the child
        if error == "memory":
            self.child._stop("memory-limit", f"{call} ran out of memory ({str(reply.get('type'))[:80]}"
                                             f"{': ' + message[:300] if message else ''})")
        if error == "unsupported":
            raise Unsupported(message, total=bool(reply.get("total")))
        if error == "failure":
            fail(message, cause=str(reply.get("cause", ""))[:1000])  # the child's Failure, worded by its assertions
        if error == "raised":
            raise TargetRaised(_remote_exception(reply.get("type"), message), call, str(reply.get("traceback", ""))[-8000:])
        self.child._stop("bad-output", f"its reply to {call} has an unknown error kind")

    def _tensor(self, ref, tensors, call) -> torch.Tensor:
        if not (isinstance(ref, dict) and set(ref) == {"$t"} and type(ref["$t"]) is int and 0 <= ref["$t"] < len(tensors)):
            self.child._stop("bad-output", f"its reply to {call} names a tensor that was not sent")
        return tensors[ref["$t"]]

    def _write_back(self, echoed, sent, tensors, call) -> None:
        """Copy in-place changes the submission made to its inputs back into the caller's tensors.

        For each input the child returns None (unchanged) or the storage it addressed, so changes
        through any view (transposed, sliced, expanded) land where they would have landed in-process.
        """
        if not (isinstance(echoed, list) and len(echoed) == len(sent)):
            self.child._stop("bad-output", f"its reply to {call} does not account for the inputs it was given")
        for original, ref in zip(sent, echoed):
            if ref is None:
                continue
            after = self._tensor(ref, tensors, call)
            span = wire.span_view(original)
            if after.shape != span.shape or after.dtype != span.dtype:
                self.child._stop("bad-output", f"its reply to {call} returns an input with another shape or dtype")
            span.copy_(after)

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False):
        self._no_extra_arguments(scale, is_causal)
        self.calls += 1
        call = f"{self.name}({'Q, K, V, mask' if mask is not None else 'Q, K, V'})"
        (out,) = self._observe("attend", {"q": q, "k": k, "v": v, "mask": mask},
                               lambda: self._remote("attend", [q, k, v, mask], 1, call), call)
        return check_output(out, attend_shape(q, k, v), call)

    def multihead(self, x_q, x_kv, weights, n_heads, mask=None):
        if self.convention != "module":
            return super().multihead(x_q, x_kv, weights, n_heads, mask)
        return self._multihead(x_q, x_kv, weights, n_heads, mask)

    def _multihead(self, x_q, x_kv, weights, n_heads, mask):
        self.calls += 1
        call = f"{self.name}({x_q.shape[-1]}, {n_heads}).forward(x_q, x_kv{', mask' if mask is not None else ''})"
        inputs = {"x_q": x_q, "x_kv": x_kv, "weights": dict(weights), "n_heads": n_heads, "mask": mask}
        (out,) = self._observe("multihead", inputs, lambda: self._remote("multihead", [x_q, x_kv, dict(weights), n_heads,
                                                                                       mask], 1, call), call,
                               state_key=(x_q.shape[-1], n_heads, x_q.dtype, str(x_q.device)))
        return check_output(out, (x_q.shape[0], x_q.shape[-1]), call)

    def vjp(self, q, k, v, mask, grad_out):
        self.calls += 1
        call = f"the gradient of {self.name}(Q, K, V{', mask' if mask is not None else ''})"
        out, *grads = self._observe("vjp", {"q": q, "k": k, "v": v, "mask": mask, "grad_out": grad_out},
                                    lambda: tuple(self._remote("vjp", [q, k, v, mask, grad_out], 4, call)), call)
        check_output(out, attend_shape(q, k, v), call)
        for grad, t, name in zip(grads, (q, k, v), "QKV"):
            if grad.shape != t.shape:
                fail(f"{list(grad.shape)}", what=f"the shape of the gradient for {name}", expected=f"{list(t.shape)}",
                     call=call, cause="the gradients did not come back in the shapes of the inputs")
        return (out, *grads)
