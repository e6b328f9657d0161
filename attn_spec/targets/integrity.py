"""What a target in the kit's own process may not touch: torch's functions and the kit's own objects.

A target imported into the kit's process can replace ``torch.softmax``, ``torch.allclose`` or
``torch.Tensor.__matmul__`` (the reference would then compute its bug), or the kit's own objects
(``TargetReport.conforms``, a budget of ``checking.tolerance``, a property's function in the catalog),
and a check that trusted them would say CONFORMS. So each target's guard (``targets.guard.StateGuard``)
keeps a :class:`Snapshot` of them, taken when the kit got the target (before its import, for a
``TARGET`` the kit loads), and compares it after the import, after the header's probes, after each
property and before the verdict: what changed is put back and remembered, and a target that changed
anything does not conform (the ``integrity:untouched`` row says what it replaced and when).

What is watched: every attribute of torch, torch.nn, torch.nn.functional, torch.functional, torch.linalg,
torch.special, torch.testing, the torch._C modules their wrappers call (``_nn``, ``_linalg``, ``_special``) and
builtins (names added there are not: a lazy import adds some; torch._C.TensorBase, where Tensor's methods live,
cannot be changed from Python), every attribute of
torch.Tensor (names added too: ``Tensor.__eq__ = ...`` overrides its base's), every attribute of every
loaded attn_spec module, the whole dict of each class those modules define, and each property of the
catalog. A full comparison costs about 0.1 ms (some 7,000 names, compared by identity), so it runs at
those points, not after every call; a patch made during a call is found when that call's property ends,
and that property, judged meanwhile with the patched functions, fails with it.

What it cannot see: a patch made before the kit got the target (``attn_spec.check(fn)`` on a module
the user's own code imported first: ``attn-spec check file.py:fn`` imports it under the guard), and code
that rewrites the guard itself or reads the kit's frames. Only a separate process (``--isolate``) keeps
those out.
"""
from __future__ import annotations

import builtins
import collections
import os
import sys
import types
import weakref

import torch
import torch.nn.functional

KIT = "attn_spec"
_MISSING = object()  # a name the owner did not have


def _kit_module(name: str) -> bool:
    return name == KIT or name.startswith(KIT + ".")


def _owners():
    """(owner, its name, whether a name added to it counts as a change) for everything watched."""
    torch_c = (torch._C._nn, torch._C._linalg, torch._C._special)  # what torch's Python wrappers call
    for module in (torch, torch.nn, torch.nn.functional, torch.functional, torch.linalg, torch.special, torch.testing,
                   *torch_c, builtins):
        yield module, module.__name__, False
    yield torch.Tensor, "torch.Tensor", True
    for name, module in list(sys.modules.items()):
        if not _kit_module(name) or module is None:
            continue
        yield module, name, False
        for value in list(vars(module).values()):
            if isinstance(value, type) and value.__module__ == name:
                yield value, f"{name}.{value.__qualname__}", True
    catalog = sys.modules.get(f"{KIT}.properties")  # the loaded catalog's entries (attn_spec.properties.catalog())
    for pid, entry in dict(getattr(catalog, "_CATALOG", None) or {}).items():
        if hasattr(entry, "__dict__"):
            yield entry, f"{KIT}.properties.catalog()[{pid!r}]", True


TORCH_DIR = os.path.dirname(torch.__file__)


def _rewrapped(old, new) -> bool:
    """``new`` is torch's own wrapper around ``old`` itself: importing torch._dynamo (torch.compile, FlexAttention)
    replaces ``torch.manual_seed`` by ``torch._disable_dynamo(torch.manual_seed)``. The same function, not a patch:
    a wrapper made by torch's code whose ``__wrapped__`` is the very object the snapshot holds."""
    code = getattr(new, "__code__", None)
    return getattr(new, "__wrapped__", None) is old and code is not None and code.co_filename.startswith(TORCH_DIR)


class _Watched:
    """One owner's names and the objects they held, compared by identity."""

    __slots__ = ("owner", "name", "strict", "keys", "values")

    def __init__(self, owner, name: str, strict: bool):
        self.owner, self.name, self.strict = owner, name, strict
        self.keys, self.values = tuple(vars(owner)), tuple(vars(owner).values())

    def unchanged(self) -> bool:
        try:  # one C-level pass: identical objects compare equal without calling __eq__
            return tuple(vars(self.owner).values()) == self.values
        except Exception:  # noqa: BLE001 - an object whose __eq__ raises (a tensor): compare name by name
            return False

    def changes(self):
        """(full name, what happened, how to undo it) for each name that changed; names added to a module are
        taken into the snapshot (a lazy import adds them), and so is torch's own wrapper around the very same
        function (:func:`_rewrapped`)."""
        now, known = vars(self.owner), dict(zip(self.keys, self.values))
        for key, old in known.items():
            new = now.get(key, _MISSING)
            if new is old:
                continue
            if _rewrapped(old, new):
                known[key] = new
                continue
            yield (f"{self.name}.{key}", "removed" if new is _MISSING else "replaced",
                   lambda key=key, old=old: self._put(key, old))
        for key in [key for key in now if key not in known]:
            if not (self.strict and isinstance(self.owner, type)
                    and any(key in vars(base) for base in type.mro(self.owner)[1:])):
                known[key] = now[key]  # a new name nothing read before (pytest marks the classes it warned about)
                continue
            yield (f"{self.name}.{key}", "replaced", lambda key=key: self._put(key, _MISSING))  # overrides its base's
        self.keys, self.values = tuple(known), tuple(known.values())  # what the undone changes put back

    def _put(self, key, value):
        """Set ``key`` back to ``value`` (or delete it: ``_MISSING``) on the owner, whatever kind it is."""
        owner = self.owner
        try:
            if isinstance(owner, types.ModuleType):  # a module: its dict directly
                vars(owner).pop(key, None) if value is _MISSING else vars(owner).__setitem__(key, value)
            elif isinstance(owner, type):
                type.__delattr__(owner, key) if value is _MISSING else type.__setattr__(owner, key, value)
            else:  # a frozen dataclass instance (a property of the catalog)
                object.__delattr__(owner, key) if value is _MISSING else object.__setattr__(owner, key, value)
        except (AttributeError, TypeError):  # an immutable type: the target could not have changed it either
            pass


class Snapshot:
    """The watched objects as they are now; :meth:`restore` puts back what changed since and says what it was."""

    def __init__(self):
        self.watched = {id(owner): _Watched(owner, name, strict) for owner, name, strict in _owners()}
        self.modules = len(sys.modules)

    def restore(self) -> list[tuple[str, str]]:
        """[(name, "replaced" | "removed" | "added")] for each change since the snapshot, each one undone.
        Kit modules loaded since are taken into the snapshot as they are now."""
        found = []
        for watched in list(self.watched.values()):
            if watched.unchanged():
                continue
            for name, change, undo in list(watched.changes()):
                undo()
                found.append((name, change))
        if len(sys.modules) != self.modules:  # modules loaded since: a kit module among them is watched from now
            self.modules = len(sys.modules)
            for owner, name, strict in _owners():
                self.watched.setdefault(id(owner), _Watched(owner, name, strict))
        return found


# ---------------------------------------------------------------- outputs

RECENT = 16  # outputs remembered (weakly: one still alive that a new output shares storage with is a reused buffer)
KEPT = 2**26  # entries of an output kept whole to compare after the next call; a larger one: a strided sample


def not_plain(out: torch.Tensor) -> str | None:
    """What makes a returned tensor one whose values cannot be judged (grading's isolation refuses the same):
    a subclass (its ``__eq__``, ``allclose`` or arithmetic may lie, its values be computed lazily), a nested or
    sparse layout, complex values, the meta device. None for a plain dense real tensor."""
    if type(out) is not torch.Tensor:
        return f"a torch.Tensor subclass {type(out).__name__!s:.60}, not a plain torch.Tensor"
    if out.is_nested or out.layout != torch.strided:
        return f"a {'nested' if out.is_nested else out.layout} tensor, not a dense one"
    if out.is_complex():
        return f"a complex tensor ({out.dtype}); attention outputs are real"
    if out.device.type == "meta":
        return "a tensor on the meta device, which holds no values"
    return None


def _storage(t) -> int:
    """Where ``t``'s storage starts (0: it has none to share: empty, or not a tensor)."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0 or t.device.type == "meta":
        return 0
    return t.untyped_storage().data_ptr()


def _values(out: torch.Tensor) -> torch.Tensor:
    """A copy of ``out``'s values as they are now (a strided sample of a very large one)."""
    flat = out.detach().reshape(-1)
    return (flat if flat.numel() <= KEPT else flat[:: flat.numel() // KEPT + 1]).clone()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise the same values, NaN matching NaN."""
    same = a == b
    return bool((same | (a.isnan() & b.isnan()) if a.is_floating_point() else same).all())


class Outputs:
    """The last output a target returned, its values read when it returned: an output is its own storage, not an
    earlier output's, and its values do not change after it is returned (:meth:`returned` fails the call). An
    output that is an input's storage is noted (``aliased``) and fails the property when it ends: its values are
    judged meanwhile, so a target that returns V as it is is still diagnosed as doing so."""

    def __init__(self):
        self.last = None  # (the output, its values when returned (None: an input's storage), the call that returned it)
        self.recent = collections.deque(maxlen=RECENT)  # weak references to the last outputs returned
        self.aliased = None  # (what, why) of the first output that was an input's storage, until the property ends

    def changed(self) -> str | None:
        """How many of the last output's values changed since it was returned (None: none did, or no output)."""
        if self.last is None or self.last[1] is None:  # none, or an input's storage: that is said instead
            return None
        before, values, _ = self.last
        now = _values(before)
        if _same(now, values):
            return None
        return f"{int((now != values).sum())} of {now.numel()} values changed after it was returned"

    def returned(self, out: torch.Tensor, inputs: dict, call: str, fail) -> None:
        """Check a plain output ``out`` of ``call`` (``inputs``: name -> tensor it was given); ``fail(measured,
        what=, expected=, cause=)`` raises the failure. The previous output is compared now, after this call."""
        changed, last, self.last = self.changed(), self.last, None
        where = _storage(out)
        given = [name for name, t in inputs.items() if where and where == _storage(t)]
        if where and not given and any(where == _storage(ref()) for ref in self.recent):
            fail("the same buffer as the output of an earlier call", what="the output",
                 expected="a new tensor each call",
                 cause="the target keeps a buffer (one, or one per shape) and overwrites it every call: a caller "
                       "holding an earlier result sees it change")
        if given and self.aliased is None:  # its values are still judged, and diagnosed
            name = given[0]
            self.aliased = (f"the output of {call} shares its storage with {name}",
                            f"the output is {name} itself or a view of it (written in place, or returned as it is): "
                            f"the caller's {name} and the result are the same memory")
        if changed:
            fail(changed, what=f"the output of an earlier call ({last[2]})", expected="the values it returned",
                 cause=CHANGED)
        self.last = (out, None if given else _values(out), call)
        self.recent.append(weakref.ref(out))


CHANGED = ("the output was still being written after the call returned (work left running on a background thread "
           "or stream, a lazy result) or its buffer is reused by a later call")
