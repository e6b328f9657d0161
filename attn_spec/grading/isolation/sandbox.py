"""The child side of the grader: confine this process, load one submission, answer calls.

This code runs in a process forked from the zygote (:mod:`attn_spec.grading.isolation.zygote`), which
imported torch and this module and did no tensor math. Everything here is trusted until the
submission is imported; from then on the student's code shares the process and can change
anything in it (torch, the kit, this module), so the grader believes nothing it sends back beyond
its being plain data: it generates the inputs and judges the outputs itself.

Order of events: tripwires (armed once in the zygote; here only pointed at this child's report
pipe) -> confine (own session, scratch dir, output to the grader's pipe, clean environment,
rlimits, own network and IPC namespaces, unprivileged user) -> read and scan the source and report
(trusted: no student code has run yet) -> import -> report what it defines -> answer calls until killed.
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
import traceback

import torch

from attn_spec.targets.conventions import FunctionTarget, ModuleTarget
from attn_spec.targets.module_adapters import SeedAdapter
from attn_spec.targets.deadline import timeout
from attn_spec.errors import Failure, KitSignal, TargetRaised, Unsupported
from attn_spec.failures import fail
from attn_spec.grading.isolation import diagnosis, hidden, wire
from attn_spec.grading.isolation.wire import BROKEN
from attn_spec.grading.isolation.scan import scan
from attn_spec.targets import interpreter
from attn_spec.targets.integrity import not_plain
from attn_spec.targets.loading import user_traceback

METHODS = ("attend", "multihead", "vjp")  # what the grader may call on a target
TEXT_LIMIT = 8000  # characters of a message or traceback sent back
CLONE_NEWNET, CLONE_NEWIPC, PR_SET_NO_NEW_PRIVS = 0x40000000, 0x08000000, 38


class BadOutput(KitSignal):
    """The submission returned something other than a plain tensor (BaseException: not a user error)."""


def _plain(out, call: str):
    """``out`` if it is a plain tensor with values the grader can judge; else BadOutput saying what it is."""
    if not isinstance(out, torch.Tensor):
        raise BadOutput(f"{call} returned {type(out).__name__!s:.60}, not a plain torch.Tensor")
    problem = not_plain(out)
    if problem:
        raise BadOutput(f"{call} returned {problem}")
    if out.dtype not in wire.WIRE_DTYPES.values():
        raise BadOutput(f"{call} returned a {out.dtype} tensor; expected one of the input's floating dtypes")
    return out


def _checked_function(fn, name: str):
    """The student's function, called on the caller thread (attn_spec.grading.isolation.hidden), its output
    checked before the adapter sees it (signature kept)."""
    @functools.wraps(fn)
    def checked(*args):
        return _plain(hidden.call(fn, *args), f"{name}(...)")
    return checked


def _checked_class(cls, name: str):
    """Builds the student's module and runs every forward on the caller thread (attn_spec.grading.isolation.hidden),
    checking its output before the adapter sees it."""
    def construct(*args):
        module = hidden.call(cls, *args)
        if isinstance(module, torch.nn.Module):
            forward = module.forward

            @functools.wraps(forward)
            def unseen_forward(*inputs, **kwargs):
                return hidden.call(forward, *inputs, **kwargs)

            module.forward = unseen_forward
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


# ---------------------------------------------------------------- tripwires

# Where a tripwire reports a call: the write end of a pipe whose other end the grader holds, set in
# each child (a list, so that closures made before the fork see the child's value). The report is
# written before the call goes ahead, so nothing the submission does afterwards can take it back.
_HITS = [-1]
# Other ways into a forbidden torch operator than its public name: its private kernels, by prefix.
KERNELS = {"scaled_dot_product_attention": ("_scaled_dot_product_", "_flash_attention_", "_efficient_attention_",
                                            "_triton_scaled_dot_attention")}
_armed: dict = {"patterns": None, "names": []}  # what the tripwires in this process cover


def _tripwire(fn, name: str):
    """``fn``, reporting each call to the grader first; no ``__wrapped__``. A call it cannot report is refused."""
    line, write, hits = f"{name}\n".encode(), os.write, _HITS  # bound now: patching os later changes nothing

    def tripwire(*args, **kwargs):
        try:
            write(hits[0], line)
        except OSError:
            raise RuntimeError(f"{name} is forbidden in this assignment") from None
        return fn(*args, **kwargs)

    for attr in ("__name__", "__qualname__", "__doc__"):
        try:
            setattr(tripwire, attr, getattr(fn, attr))
        except (AttributeError, TypeError):
            pass
    if isinstance(fn, torch._ops.OpOverloadPacket):  # torch.ops.aten.X.default and the other overloads
        for overload in fn.overloads():
            setattr(tripwire, overload, _tripwire(getattr(fn, overload), f"{name}.{overload}"))
    return tripwire


def _targets(pattern: str):
    """(owner, attribute, dotted name) for each callable a forbidden entry names."""
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


def _operator_entry_points(op: str):
    """torch.ops.aten.<op>, and the private kernels of a known operator in torch and torch.ops.aten."""
    prefixes = KERNELS.get(op, ())
    names = {op} | {name.split("::", 1)[1].split(".")[0] for name in torch._C._dispatch_get_all_op_names()
                    if name.startswith("aten::") and name[6:].startswith(prefixes or (op,))}
    for name in sorted(names):
        if hasattr(torch.ops.aten, name):
            yield torch.ops.aten, name, f"torch.ops.aten.{name}"
        if name != op and prefixes and callable(getattr(torch, name, None)):
            yield torch, name, f"torch.{name}"


def entry_points(patterns) -> list[tuple[object, str, str]]:
    """(owner, attribute, dotted name) of every way in to what ``patterns`` forbid that this process
    can see: the names themselves; every module attribute bound to the same object (``torch._C._nn``,
    a kit module that imported it by name); and for a torch operator, its ``torch.ops.aten`` packet
    and private kernels. (``torch._C._VariableFunctions`` is read-only and stays uncovered.)"""
    found: dict[tuple[int, str], tuple] = {}
    originals: dict[int, object] = {}
    for pattern in patterns:
        for owner, attr, dotted in _targets(pattern):
            obj = getattr(owner, attr)
            found[(id(owner), attr)] = (owner, attr, dotted)
            if inspect.isclass(obj):
                continue  # its __init__ is wrapped on the class itself, whatever name reaches it
            originals[id(obj)] = obj
            if inspect.isbuiltin(obj) and getattr(obj, "__name__", None):
                for owner2, attr2, dotted2 in _operator_entry_points(obj.__name__):
                    found[(id(owner2), attr2)] = (owner2, attr2, dotted2)
                    originals[id(getattr(owner2, attr2))] = getattr(owner2, attr2)
    for module in list(sys.modules.values()) + [torch._C._nn]:  # torch._C._nn is not in sys.modules
        names = getattr(module, "__dict__", None)
        if not isinstance(names, dict):
            continue
        for attr, value in list(names.items()):
            if id(value) in originals and originals[id(value)] is value and (id(module), attr) not in found:
                found[(id(module), attr)] = (module, attr, f"{getattr(module, '__name__', '?')}.{attr}")
    return list(found.values())


def arm_tripwires(patterns) -> list[str]:
    """Wrap every entry point to a forbidden callable so that each call is reported (see :data:`_HITS`);
    returns their dotted names. Done once in the zygote, before any fork; again only for other patterns."""
    patterns = tuple(patterns)
    if _armed["patterns"] == patterns:
        return _armed["names"]
    names = []
    for owner, attr, dotted in entry_points(patterns):
        obj = getattr(owner, attr)
        if inspect.isclass(obj):
            obj.__init__ = _tripwire(obj.__init__, dotted)
        else:
            try:
                setattr(owner, attr, _tripwire(obj, dotted))
            except (AttributeError, TypeError):  # a read-only namespace
                continue
        names.append(dotted)
    _armed.update(patterns=patterns, names=sorted(set(names)))
    return _armed["names"]


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
    # System V IPC (shared memory, semaphores, queues) of its own, gone when it ends; where the kernel
    # refuses, its monitor removes the shared-memory segments it created (zygote.remove_segments).
    sandbox["ipc"] = "own namespace" if libc.unshare(CLONE_NEWIPC) == 0 else "shared; its segments removed afterwards"
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
        name = config.get("module", "submission")  # check --isolate: the file's own stem
        interpreter.prepare(os.path.join(scratch, entry))  # a Triton kernel without a GPU: under its interpreter
        spec = importlib.util.spec_from_file_location(name, os.path.join(scratch, entry))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        hidden.call(spec.loader.exec_module, module)  # its import-time code sees no kit frame either
    except SyntaxError as exc:
        return {"ok": False, "outcome": "syntax-error", "line": exc.lineno, "file": os.path.basename(exc.filename or entry),
                "message": f"{exc.msg}"[:TEXT_LIMIT], "traceback": user_traceback(exc)[-TEXT_LIMIT:]}
    except MemoryError:
        return {"ok": False, "outcome": "memory-limit", "message": "importing ran out of memory"}
    except Exception as exc:  # noqa: BLE001 - whatever the submission raises at import is the finding
        return {"ok": False, "outcome": "import-error", "type": type(exc).__name__,
                "module": getattr(exc, "name", None) if isinstance(exc, ImportError) else None,
                "message": str(exc)[:TEXT_LIMIT], "traceback": user_traceback(exc)[-TEXT_LIMIT:],
                **_where_raised(exc, scratch)}
    names = {conv: config["names"][conv] for conv in ("function", "module")}
    fn, cls = getattr(module, names["function"], None), getattr(module, names["module"], None)
    targets = {}
    if callable(fn) and not inspect.isclass(fn):
        targets["function"] = FunctionTarget(_checked_function(fn, names["function"]), names["function"])
    if inspect.isclass(cls):
        targets["module"] = ModuleTarget(SeedAdapter(_checked_class(cls, names["module"])), names["module"])
    return {"ok": True, "found": sorted(targets), "targets": targets,
            "kinds": {conv: type(obj).__name__ for conv, obj in (("function", fn), ("module", cls)) if obj is not None}}


def _where_raised(exc: BaseException, scratch: str) -> dict:
    """{"file", "line"} of the submission's innermost frame in ``exc``'s traceback (the import statement
    that failed, say), or {} when none of its frames is in the submission's folder."""
    inside = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.realpath(f.filename).startswith(os.path.join(os.path.realpath(scratch), ""))]
    return {"file": os.path.relpath(os.path.realpath(inside[-1].filename), os.path.realpath(scratch)),
            "line": inside[-1].lineno} if inside else {}


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


# The previous call's outputs and their bytes as they were sent. The grader gets copies, so a submission that
# returns one buffer and overwrites it on the next call would harm nobody here; in-process it hands its caller
# a result that changes under it (the grader of check --isolate and grade asks for the same as check does).
_EARLIER: list = []


def _overwritten(outputs: list, method: str) -> None:
    """Fail this call if it changed what an earlier call returned; remember this call's outputs."""
    changed = any(wire.raw_bytes(wire.span_view(t)) != raw for t, raw in _EARLIER)
    _EARLIER[:] = [(t, wire.raw_bytes(wire.span_view(t))) for t in outputs]
    if changed:
        fail("changed by this call", what="the values of the result an earlier call returned",
             expected="the same values", call=method,
             cause="the target returns one buffer and writes every call into it: a caller that keeps a result "
                   "sees it change (return a new tensor each call)")


def _answer(chan: wire.Channel, header: dict, tensors: list, targets: dict) -> None:
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
        _overwritten(outputs, method)
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
    try:
        chan.send(reply, reply_tensors)
    except wire.ProtocolError as exc:  # a result the wire does not carry (_plain lets none through): its answer
        chan.send({"error": "bad-output", "message": f"{method} returned what the grader cannot read: {exc}"[:TEXT_LIMIT],
                   "inputs": [None] * len(tensors)})


def _read_entry(config: dict) -> dict:
    """{"source": bytes}, or why the entry file cannot be graded (read with the sandbox user's rights)."""
    entry, limit = config["entry"], int(config["limits"]["source_kb"] * 1024)
    try:
        with open(os.path.join(config["scratch"], entry), "rb") as fh:
            source = fh.read(limit + 1)
    except OSError as exc:  # a link to a file it may not read, a folder, ...: the submission's problem
        return {"unreadable": f"cannot read {entry}: {exc.strerror or type(exc).__name__}"}
    if len(source) > limit:
        return {"too_large": f"{entry} is larger than {config['limits']['source_kb']:g} KB"}
    return {"source": source}


def serve(chan_fd: int, out_fd: int, hits_fd: int, config: dict) -> None:
    """The child's life: confine, scan, import, then answer the grader's calls until it kills us."""
    chan = wire.Channel(socket.socket(fileno=chan_fd))
    try:
        names = arm_tripwires(config["forbidden"])  # already armed in the zygote: no work here
        _HITS[0] = hits_fd
        hidden.start()  # before confine: no thread may be started after it
        sandbox = confine(config, out_fd)
    except Exception as exc:  # noqa: BLE001 - the sandbox itself failed: the grader's problem, not the student's
        chan.send({"stage": "sandbox-error", "message": f"{type(exc).__name__}: {exc}"[:TEXT_LIMIT]})
        return
    report = _read_entry(config)
    if "source" in report:
        report = scan(report.pop("source"), config["entry"], list(config["forbidden"]) + names)
    chan.send({"stage": "scanned", "sandbox": sandbox, **report})
    if set(report) & {"syntax_error", "too_large", "unreadable"}:
        return
    loaded = _load(config)
    targets = loaded.pop("targets", {})
    chan.send({"stage": "loaded", **loaded})
    with timeout(0):  # the grader times every call from outside (call_seconds): no deadline of the kit's in here
        while True:
            header, tensors = chan.recv(devices=config["devices"])
            if header.get("op") == "diagnose":
                diagnosis.answer(chan, header, targets, _HITS)
            else:
                _answer(chan, header, tensors, targets)


def run(chan_fd: int, out_fd: int, hits_fd: int, config: dict):
    """Entry point in the forked child; never returns."""
    code = 0
    try:
        serve(chan_fd, out_fd, hits_fd, config)
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
