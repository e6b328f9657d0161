"""Turn ``path/to/file.py:name`` or ``package.module:name`` into the user's object.

A module that imports triton, on a machine without a CUDA device, is imported under Triton's interpreter
(attn_spec.targets.interpreter)."""
from __future__ import annotations

import dis
import functools
import hashlib
import importlib
import importlib.util
import os
import site
import sys
import sysconfig
from pathlib import Path

from attn_spec.errors import TargetLoadError
from attn_spec.targets import interpreter
from attn_spec.targets.guard import passes_through
from attn_spec.targets.tracebacks import user_traceback

FORMAT_HINT = "A TARGET looks like path/to/file.py:name or package.module:name."


@functools.lru_cache(maxsize=1)
def library_dirs() -> tuple[str, ...]:
    """Where installed code lives: the standard library, site-packages, torch and the kit itself."""
    import torch

    dirs = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else ())
    dirs.update((site.getusersitepackages(), os.path.dirname(torch.__file__), str(Path(__file__).resolve().parents[1])))
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs if d)


def raised_on_purpose(exc: BaseException) -> bool:
    """True when ``exc`` comes from a ``raise`` statement in the user's own code.

    The innermost frame of its traceback must be a file outside the standard library,
    site-packages, torch and the kit, stopped at a ``raise``: a ``NotImplementedError`` from a
    torch kernel (``Could not run 'aten::...'``) also surfaces on the user's line, but at a call.
    """
    if hasattr(exc, "attn_spec_on_purpose"):  # raised in a forked child, which read its traceback (targets.forked)
        return exc.attn_spec_on_purpose
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if os.path.realpath(code.co_filename).startswith(library_dirs()) or code.co_filename.startswith("<frozen"):
        return False
    return any(i.offset == tb.tb_lasti and i.opname.startswith("RAISE") for i in dis.get_instructions(code))


def _import_file(path: Path):
    name = "attn_spec_target_" + hashlib.sha1(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))  # the user's file may import its neighbours
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def _import(where: str, root: str | None = None):
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).expanduser().resolve()
        if not path.is_file():
            raise TargetLoadError(f"Cannot load target: no file {where!r} (looked for {path}). {FORMAT_HINT}")
        return _import_file(path)
    # As with `python -m`, modules in the current directory are importable; ``root`` (the folder of
    # the pyproject.toml that named the target) too, so a check run from a subfolder finds them.
    extra = list(dict.fromkeys([os.getcwd(), *([root] if root else [])]))
    sys.path[:0] = extra
    try:
        return importlib.import_module(where)
    except ModuleNotFoundError as exc:
        if exc.name and where.startswith(exc.name):
            raise TargetLoadError(f"Cannot load target: no module named {exc.name!r} "
                                  f"(is it installed, or on PYTHONPATH?). {FORMAT_HINT}") from None
        raise
    finally:
        for folder in extra:
            sys.path.remove(folder)


def load_target(spec: str, root: str | None = None):
    """Import and return the object named by ``spec``; raises TargetLoadError with a readable message.

    ``root``: a folder whose modules are importable too (a pyproject.toml's, for the targets it names)."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise TargetLoadError(f"Cannot load target {spec!r}: it names no object. {FORMAT_HINT}")
    dont_write = sys.dont_write_bytecode
    sys.dont_write_bytecode = True  # leave no __pycache__ beside the user's file
    try:
        interpreter.prepare(where, root)  # a Triton kernel without a GPU: its interpreter, set before the import
        module = _import(where, root)
    except TargetLoadError:
        raise
    except BaseException as exc:  # the user's module raised (or exited) while importing
        if passes_through(exc):
            raise
        raise TargetLoadError(f"Cannot load target {spec!r}: importing {where!r} raised "
                              f"{type(exc).__name__}: {exc}\n\n{user_traceback(exc)}") from None
    finally:
        sys.dont_write_bytecode = dont_write
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = sorted(n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n)))
            raise TargetLoadError(f"Cannot load target {spec!r}: {where!r} has no attribute {part!r}. "
                                  f"Callables it defines: {', '.join(names) or 'none'}.")
        obj = getattr(obj, part)
    if not callable(obj):
        kind = type(obj).__name__
        raise TargetLoadError(f"Cannot load target {spec!r}: it is {'an' if kind[0] in 'aeiou' else 'a'} {kind}, "
                              f"not a function or class.")
    return obj


def spec_of(obj) -> str | None:
    """A TARGET string that loads ``obj`` again (file path for files loaded by the kit), or None."""
    qualname, module = getattr(obj, "__qualname__", None), sys.modules.get(getattr(obj, "__module__", "") or "")
    if qualname is None or module is None or "<locals>" in qualname:
        return None
    if module.__name__.startswith("attn_spec_target_") or module.__name__ == "__main__":
        where = getattr(module, "__file__", None)
        return f"{where}:{qualname}" if where else None
    return f"{module.__name__}:{qualname}"
