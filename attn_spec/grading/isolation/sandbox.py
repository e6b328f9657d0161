"""The child side of the grader: confine this process, load one submission, answer calls.

This code runs in a process forked from the zygote (:mod:`attn_spec.grading.isolation.zygote`), which
imported torch and this module and did no tensor math. Everything here is trusted until the
submission is imported; from then on the student's code shares the process and can change
anything in it (torch, the kit, this module), so the grader believes nothing it sends back beyond
its being plain data: it generates the inputs and judges the outputs itself.

Order of events: confine (own session, scratch dir, output to the grader's pipe, clean
environment, tripwires, rlimits, unprivileged user) -> scan the source and report (trusted: no
student code has run yet) -> import -> report what it defines -> answer calls until killed.
"""
from __future__ import annotations

import ctypes
import functools
import importlib
import importlib.util
import inspect
import os
import resource
import signal
import socket
import sys

import torch

from attn_spec.targets.conventions import FunctionTarget, ModuleTarget
from attn_spec.targets.module_adapters import SeedAdapter
from attn_spec.errors import Failure, KitSignal, TargetRaised, Unsupported
from attn_spec.grading.isolation import wire
from attn_spec.grading.isolation.wire import BROKEN
from attn_spec.grading.isolation.scan import scan
from attn_spec.targets.loading import user_traceback

METHODS = ("attend", "multihead", "vjp")  # what the grader may call on a target
TEXT_LIMIT = 8000  # characters of a message or traceback sent back
CLONE_NEWNET, PR_SET_NO_NEW_PRIVS = 0x40000000, 38


class BadOutput(KitSignal):
    """The submission returned something other than a plain tensor (BaseException: not a user error)."""


def _plain(out, call: str):
    if type(out) is not torch.Tensor:
        kind = "a torch.Tensor subclass " if isinstance(out, torch.Tensor) else ""
        raise BadOutput(f"{call} returned {kind}{type(out).__name__!s:.60}, not a plain torch.Tensor")
    return out


def _checked_function(fn, name: str):
    """The student's function, its output checked before the adapter sees it (signature kept)."""
    @functools.wraps(fn)
    def checked(*args):
        return _plain(fn(*args), f"{name}(...)")
    return checked


def _checked_class(cls, name: str):
    """Builds the student's module and checks every forward's output before the adapter sees it."""
    def construct(*args):
        module = cls(*args)
        if isinstance(module, torch.nn.Module):
            module.register_forward_hook(lambda _m, _inputs, out: _plain(out, f"{name}.forward(...)"))
        return module
    construct.__name__ = name
    return construct


# ---------------------------------------------------------------- confinement


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _vm_size() -> int:
    """Bytes of address space this process maps now (torch maps a lot before any work)."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _tripwire(fn, name: str, hits: list):
    @functools.wraps(fn)
    def tripwire(*args, **kwargs):
        hits.append(name)
        return fn(*args, **kwargs)
    return tripwire


def _targets(pattern: str):
    """(owner, attribute, dotted name) for each callable a forbidden entry covers."""
    if pattern.endswith(".*"):
        module = importlib.import_module(pattern[:-2])
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            if not attr.startswith("_") and callable(obj) and getattr(obj, "__module__", None) == module.__name__:
                yield module, attr, f"{module.__name__}.{attr}"
        return
    parts = pattern.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:-1]:
            owner = getattr(owner, attr)
        yield owner, parts[-1], pattern
        return


def install_tripwires(patterns) -> list[str]:
    """Wrap every forbidden callable so that a call is recorded; returns the (growing) record."""
    hits: list[str] = []
    for pattern in patterns:
        for owner, attr, name in _targets(pattern):
            obj = getattr(owner, attr)
            if inspect.isclass(obj):
                obj.__init__ = _tripwire(obj.__init__, name, hits)
            else:
                setattr(owner, attr, _tripwire(obj, name, hits))
    return hits


def confine(config: dict, out_fd: int) -> dict:
    """Isolate this process as far as the OS lets it; returns what was applied."""
    os.setsid()  # its own session and process group: the grader kills the whole group
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized file write fails instead of killing
    os.chdir(config["scratch"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(devnull)
    os.close(out_fd)
    sys.stdout.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(PATH="/usr/bin:/bin", HOME=config["scratch"], TMPDIR=config["scratch"], LANG="C.UTF-8")
    torch.set_num_threads(1)
    sandbox = {"tripwires": config["forbidden"]}
    libc = _libc()
    root = os.geteuid() == 0
    sandbox["network"] = "isolated" if root and libc.unshare(CLONE_NEWNET) == 0 else "not isolated"
    limits = config["limits"]
    cpu = int(limits["submission_seconds"]) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + int(limits["memory_mb"] * 2**20),) * 2)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limits["file_mb"] * 2**20),) * 2)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # no new processes or threads (not enforced for root)
    if root:
        uid, gid = config["uid"], config["gid"]
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    sandbox["user"] = f"uid {os.getuid()}" + (" (unprivileged)" if root else " (the grader's own user)")
    sandbox["no_new_privileges"] = libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
    return sandbox


# ---------------------------------------------------------------- loading


def _load(config: dict) -> dict:
    """Import the submission; {"ok": True, "found": {...}} or {"ok": False, "outcome": ..., ...}."""
    scratch, entry = config["scratch"], config["entry"]
    sys.path.insert(0, scratch)
    sys.dont_write_bytecode = True
    try:
        spec = importlib.util.spec_from_file_location("submission", os.path.join(scratch, entry))
        module = importlib.util.module_from_spec(spec)
        sys.modules["submission"] = module
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        return {"ok": False, "outcome": "syntax-error", "line": exc.lineno, "file": os.path.basename(exc.filename or entry),
                "message": f"{exc.msg}"[:TEXT_LIMIT], "traceback": user_traceback(exc)[-TEXT_LIMIT:]}
    except MemoryError:
        return {"ok": False, "outcome": "memory-limit", "message": "importing ran out of memory"}
    except Exception as exc:  # noqa: BLE001 - whatever the submission raises at import is the finding
        return {"ok": False, "outcome": "import-error", "type": type(exc).__name__,
                "module": getattr(exc, "name", None) if isinstance(exc, ImportError) else None,
                "message": str(exc)[:TEXT_LIMIT], "traceback": user_traceback(exc)[-TEXT_LIMIT:]}
    names = {conv: config["names"][conv] for conv in ("function", "module")}
    fn, cls = getattr(module, names["function"], None), getattr(module, names["module"], None)
    targets = {}
    if callable(fn) and not inspect.isclass(fn):
        targets["function"] = FunctionTarget(_checked_function(fn, names["function"]), names["function"])
    if inspect.isclass(cls):
        targets["module"] = ModuleTarget(SeedAdapter(_checked_class(cls, names["module"])), names["module"])
    return {"ok": True, "found": sorted(targets), "targets": targets,
            "kinds": {conv: type(obj).__name__ for conv, obj in (("function", fn), ("module", cls)) if obj is not None}}


# ---------------------------------------------------------------- answering calls


def _error_reply(exc: BaseException) -> dict:
    if isinstance(exc, BadOutput):
        return {"error": "bad-output", "message": str(exc)[:TEXT_LIMIT]}
    if isinstance(exc, TargetRaised):
        inner = exc.exc
        memory = isinstance(inner, MemoryError) or "can't allocate memory" in str(inner)
        return {"error": "memory" if memory else "raised", "type": type(inner).__name__,
                "message": str(inner)[:TEXT_LIMIT], "call": exc.message.split(" raised ")[0],
                "traceback": exc.user_traceback[-TEXT_LIMIT:]}
    if isinstance(exc, Unsupported):
        return {"error": "unsupported", "message": str(exc)[:TEXT_LIMIT], "total": bool(getattr(exc, "total", False))}
    if isinstance(exc, Failure):
        return {"error": "failure", "message": exc.message[:TEXT_LIMIT], "cause": exc.cause[:TEXT_LIMIT]}
    if isinstance(exc, MemoryError):
        return {"error": "memory", "type": "MemoryError", "message": "out of memory"}
    return {"error": "raised", "type": type(exc).__name__, "message": str(exc)[:TEXT_LIMIT], "call": "the grader's call",
            "traceback": user_traceback(exc)[-TEXT_LIMIT:]}


def _answer(chan: wire.Channel, header: dict, tensors: list, targets: dict, hits: list) -> None:
    target, method = targets.get(header.get("convention")), header.get("method")
    before = [wire.raw_bytes(wire.span_view(t)) for t in tensors]  # as they arrived: the call may write into them
    args = wire.unpack(header.get("args", []), tensors)
    reply_tensors: list = []
    try:
        if target is None or method not in METHODS:
            raise Unsupported(f"no {header.get('convention')} target here to call {method}")
        kwargs = wire.unpack(header.get("kwargs", {}), tensors)
        result = getattr(target, method)(*args, **kwargs)
        outputs = list(result) if isinstance(result, tuple) else [result]
        reply = {"ok": True, "result": [wire.pack(_plain(t, method).detach(), reply_tensors) for t in outputs]}
    except BaseException as exc:  # noqa: BLE001 - SystemExit and friends are re-raised below
        if isinstance(exc, TargetRaised) and isinstance(exc.exc, SystemExit):
            raise exc.exc from None  # the submission exits: its process ends, and that is its outcome
        if isinstance(exc, (SystemExit, KeyboardInterrupt, GeneratorExit)):
            raise
        try:
            reply, reply_tensors = _error_reply(exc), []
        except BaseException:  # noqa: BLE001 - an exception whose __str__ raises, and so on
            reply, reply_tensors = {"error": "raised", "type": "Exception", "message": "(unprintable exception)",
                                    "call": method, "traceback": ""}, []
    # In-place edits go back: each input the call changed, as the whole storage span it addresses
    # (None: unchanged, byte for byte).
    reply["inputs"] = [None if wire.raw_bytes(wire.span_view(t)) == raw else wire.pack(wire.span_view(t), reply_tensors)
                       for t, raw in zip(tensors, before)]
    reply["forbidden"] = sorted(set(hits))
    chan.send(reply, reply_tensors)


def serve(chan_fd: int, out_fd: int, config: dict) -> None:
    """The child's life: confine, scan, import, then answer the grader's calls until it kills us."""
    chan = wire.Channel(socket.socket(fileno=chan_fd))
    try:
        hits = install_tripwires(config["forbidden"])
        sandbox = confine(config, out_fd)
        with open(os.path.join(config["scratch"], config["entry"]), "rb") as fh:
            source = fh.read(int(config["limits"]["source_kb"] * 1024) + 1)
    except Exception as exc:  # noqa: BLE001 - the sandbox itself failed: the grader's problem, not the student's
        chan.send({"stage": "sandbox-error", "message": f"{type(exc).__name__}: {exc}"[:TEXT_LIMIT]})
        return
    if len(source) > config["limits"]["source_kb"] * 1024:
        report = {"too_large": f"{config['entry']} is larger than {config['limits']['source_kb']:g} KB"}
    else:
        report = scan(source, config["entry"], config["forbidden"])
    chan.send({"stage": "scanned", "sandbox": sandbox, **report})
    if "syntax_error" in report or "too_large" in report:
        return
    loaded = _load(config)
    targets = loaded.pop("targets", {})
    chan.send({"stage": "loaded", **loaded, "forbidden_calls": sorted(set(hits))})
    while True:
        header, tensors = chan.recv(devices=config["devices"])
        _answer(chan, header, tensors, targets, hits)


def run(chan_fd: int, out_fd: int, config: dict):
    """Entry point in the forked child; never returns."""
    code = 0
    try:
        serve(chan_fd, out_fd, config)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except wire.PeerClosed:
        code = 0
    except BaseException:  # noqa: BLE001 - this code failed (the submission may have broken what it uses)
        code = BROKEN
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:  # noqa: BLE001
            pass
        os._exit(code)
