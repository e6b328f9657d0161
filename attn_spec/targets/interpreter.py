"""Triton's interpreter as a platform: a Triton kernel checked on a machine without a GPU.

When the module a TARGET names imports ``triton`` (an ``import triton`` or ``from triton... import`` in its
source) and torch sees no CUDA device, :func:`prepare` sets ``TRITON_INTERPRET=1`` before the module is
imported (Triton reads it when ``@triton.jit`` decorates a kernel): the kernels then run on CPU tensors, each
program in turn, in NumPy. ``TRITON_INTERPRET`` set by the user is kept as it is (and noted).

What the interpreter does not reproduce, said in the report's header (:data:`LIMITS`): TF32 (float32 dots are
exact float32 there), races between programs (they run one after another), the minimum size of ``tl.dot``
(16 on GPUs: a smaller block runs), and faults on out-of-bounds reads (they return whatever host memory is
there). An out-of-bounds *store* writes into the heap: the process may abort later (``free(): invalid next
size``), so the calls of a target under the interpreter run in a forked child (attn_spec.targets.forked), and
a dead child is a failure of its case, not the end of the check.

The interpreter is probed like any platform before a target is blamed: its ``tl.dot`` on bfloat16 operands
multiplies their raw bit patterns (triton issue #11584; a correct kernel's error is about 1e8). A kit-owned
kernel (attn_spec.targets.triton_probe) computes a 16 x 16 bfloat16 product; when it is wrong, bfloat16 is left
out of the check with a platform note (:func:`platform`), never charged to the target. That probe runs in the
kit's process, first: Triton imports about 1 s of modules at its first launch, which every forked call then
inherits instead of importing them again.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import sys
from pathlib import Path

import torch

_LATE: list[str] = []  # "triton" when it was imported before prepare() set TRITON_INTERPRET
LIMITS = ("no TF32 (float32 dots are exact float32), no races (programs run one after another), the minimum tl.dot "
          "size is not enforced, out-of-bounds loads return host memory instead of faulting")


def imports_triton(source: str) -> bool:
    """Whether Python ``source`` imports triton (``import triton``, ``import triton.language as tl``, ``from
    triton...``), anywhere in the module."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(name == "triton" or name.startswith("triton.") for name in names):
            return True
    return False


def _source_of(where: str, root: str | None) -> str:
    """The source of the module ``where`` names (a file path or a dotted module name), or "" if unreadable."""
    if where.endswith(".py") or os.sep in where or "/" in where:
        path = Path(where).expanduser()
    else:
        try:
            spec = importlib.util.find_spec(where)
        except (ImportError, ValueError):
            spec = None
        if spec is None and root:
            path = Path(root, *where.split(".")).with_suffix(".py")
        else:
            path = Path(spec.origin) if spec is not None and spec.origin else Path()
    try:
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
    except OSError:
        return ""


def prepare(where: str, root: str | None = None) -> None:
    """Before the module ``where`` names is imported (attn_spec.targets.loading): if it imports triton and torch
    sees no CUDA device, set TRITON_INTERPRET=1 (a value the user set, 0 included, is kept)."""
    if os.environ.get("TRITON_INTERPRET", "") == "" and imports_triton(_source_of(where, root)) \
            and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        if "triton" in sys.modules:  # imported before (by the caller): its own @triton.jit helpers are compiled-mode
            _LATE.append("triton")


def runs(obj) -> str | None:
    """The header's note when ``obj`` (a TARGET) is a Triton kernel's host code running under the interpreter: its
    module imports triton and TRITON_INTERPRET is on; else None."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return None
    module = sys.modules.get(getattr(obj, "__module__", None) or type(obj).__module__)
    where = getattr(module, "__file__", None)
    if not where or not imports_triton(_source_of(where, None)):
        return None
    late = ("; triton was imported before the kit set TRITON_INTERPRET, so its own @triton.jit helpers (tl.max, "
            "tl.sum) fail under the interpreter: set TRITON_INTERPRET=1 before importing triton" if _LATE else "")
    return (f"runtime: Triton's interpreter (TRITON_INTERPRET={os.environ['TRITON_INTERPRET']}"
            f"{': no CUDA device' if not torch.cuda.is_available() else ''}), each call in a forked child (a "
            f"kernel that corrupts memory kills only its case's call); it does not reproduce: {LIMITS}{late}")


@functools.lru_cache(maxsize=1)
def bfloat16_dot_error() -> float:
    """The relative error of the interpreter's ``tl.dot`` on a 16 x 16 bfloat16 product (exact inputs: small
    integers, so a correct dot is exact in float32), by a kit-owned kernel. Run in the kit's process: it is the
    kit's own kernel, and it imports what Triton imports at its first launch (about 1 s) once, before the target's
    calls are forked from this process."""
    try:
        return _bfloat16_dot_error()
    except Exception:  # noqa: BLE001 - an interpreter that cannot run it cannot be trusted with bfloat16 either
        return float("inf")


def _bfloat16_dot_error() -> float:
    from attn_spec.targets.triton_probe import dot

    a = torch.arange(256, dtype=torch.float32).reshape(16, 16).remainder(7).sub(3)  # [16, 16] in -3..3
    b = torch.arange(256, dtype=torch.float32).reshape(16, 16).remainder(5).sub(2).t()
    expected = a @ b  # [16, 16], exact
    got = dot(a.bfloat16(), b.bfloat16())
    return ((got - expected).abs().max() / expected.abs().max()).item()


def platform() -> dict[str, str]:
    """dtype -> why the interpreter cannot run it (a platform note), for the dtypes this interpreter gets wrong."""
    error = bfloat16_dot_error()
    if error < 1e-2:
        return {}
    return {"bfloat16": f"left out: Triton's interpreter computes tl.dot on bfloat16 wrongly on this machine (a "
                        f"kit-owned 16 x 16 product is off by {error:.3g} of its largest value: it multiplies raw "
                        f"bit patterns, triton issue #11584); a platform defect, not the target's"}
