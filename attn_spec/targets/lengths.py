"""The ``length`` capability: the longest sequence a target takes, and whether that limit is declared.

The probe runs self-attention over LENGTH_CEILING positions; a target that fails there is bisected to
the largest length n it takes. A failure at n + 1 is a *limit* (``max length n``: the properties draw
up to it and the verdict says ``CONFORMS up to n positions``) only when it is declared:

- by the target's own refusal: ``attn_spec.Unsupported``, or an ``assert``, ``raise ValueError``, ``TypeError`` or
  ``NotImplementedError`` statement in its own code (``envelope.declared_refusal``: the innermost frame is a
  ``raise`` in the user's file, not an index or a torch kernel);
- by the module's size: a position attribute of n (``block_size``, ``max_position_embeddings``,
  ``n_positions``, ... on the module, its ``config``, the adapter or an hf target's config), or a buffer
  (nanoGPT's ``bias`` tril of ``block_size``) or position table (``wpe``, ``pos_*``) with a dim of n;
- by the user: ``--require length=N`` with n >= N (the user needs no more).

Any other crash at a length (an ``IndexError`` past a hard-coded block of 16, a size mismatch in a plain
function) is a bug: the value is ``raises``, the reason says where it starts ("raises IndexError from 17
positions on; takes up to 16"), the other properties draw up to n and ``long-sequences`` calls the target
past it, where it fails with that cause (one root: attn_spec.diagnosis.measured.length_crash).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from attn_spec.errors import Failure, TargetRaised, Unsupported
from attn_spec.reference import causal_mask
from attn_spec.targets.envelope import declared_refusal

LENGTH_CEILING = 2048  # every length the profiles draw (long-sequences at thorough: 2048 keys); no more, since a
# float64 target holds [n, n] scores at it (32 MiB at 2048, within a graded submission's memory)
POSITION_ATTRIBUTES = ("block_size", "max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                       "max_seq_length", "max_len", "context_length")


@dataclass(frozen=True)
class Length:
    """What the length probe found: ``value`` ``yes``, ``N`` (a declared limit) or ``raises`` (an undeclared
    crash); ``why``; ``takes`` the largest length measured to run (None: no limit up to LENGTH_CEILING);
    ``crash``, for an undeclared crash, where it starts in one sentence."""

    value: str
    why: str = ""
    takes: int | None = None
    crash: str = ""


def _shape_crash(exc: TargetRaised) -> bool:
    """A crash at a shape check: an index or assertion error, or torch's size mismatch."""
    return isinstance(exc.exc, (IndexError, AssertionError, ValueError)) or (
        isinstance(exc.exc, RuntimeError) and any(word in str(exc.exc) for word in ("size", "shape", "dimension")))


def _named(obj, name):
    try:
        value = getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - a property of the user's that raises declares nothing
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def declared_size(target, n: int) -> str:
    """Where ``target`` declares ``n`` positions ("block_size = 1024", "buffer bias [1, 1, 1024, 1024]"), or ""."""
    obj = target.obj
    found = [obj, getattr(obj, "__self__", None), getattr(target, "adapter", None),
             getattr(getattr(target, "adapter", None), "cls", None), *getattr(target, "_modules", {}).values()]
    for key, value in getattr(target, "extra", {}).items():  # an hf target's config and module attributes
        if key.rsplit(".", 1)[-1] in POSITION_ATTRIBUTES and value == n:
            return f"{key} = {n}"
    for thing in (o for o in found if o is not None):
        for holder, prefix in ((thing, ""), (getattr(thing, "config", None), "config.")):
            for name in POSITION_ATTRIBUTES:
                if holder is not None and _named(holder, name) == n:
                    return f"{prefix}{name} = {n}"
        if isinstance(thing, torch.nn.Module):
            tables = [(f"buffer {name}", t) for name, t in thing.named_buffers()] + [
                (f"position table {name}", t) for name, t in thing.named_parameters()
                if "pos" in name.lower() or "wpe" in name.lower()]
            for what, t in tables:
                if n in t.shape:
                    return f"{what} {list(t.shape)}"
    return ""


def probe_length(target, dtype, device, masked: bool, required: int | None = None, d: int = 2) -> Length:
    """The ``length`` capability of ``target`` (self-attention [n, d], the causal mask where ``masked``)."""
    def takes(n):  # (runs, why, the exception when it crashed undeclared)
        q, k, v = (torch.randn(n, d, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                   .to(device=device, dtype=dtype) for s in range(3))  # [T, D=d] each
        try:
            target.attend(q, k, v, causal_mask(n, n, device=device) if masked else None)
            return True, "", None
        except Unsupported as exc:
            return False, str(exc), None
        except TargetRaised as exc:
            if declared_refusal(exc):
                return False, f"its own check: {exc.message}", None
            if _shape_crash(exc):
                return False, exc.message, exc
            raise
    try:
        ok, why, crash = takes(LENGTH_CEILING)
        if ok or not takes(2)[0]:
            return Length("yes")
        lo, hi = 2, LENGTH_CEILING  # takes lo, not hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            ok, reason, raised = takes(mid)
            lo, hi, why, crash = (mid, hi, why, crash) if ok else (lo, mid, reason, raised)
    except (Failure, RuntimeError, MemoryError):  # another crash, or too big for this machine: no limit to report;
        return Length("yes")  # long-sequences shows a crash itself
    if crash is None:
        return Length(str(lo), f"takes up to {lo} positions; at {hi}: {why}", lo)
    where = declared_size(target, lo)
    if where:
        return Length(str(lo), f"takes up to {lo} positions, as it declares ({where}); at {hi}: {why}", lo)
    if required is not None and lo >= required:
        return Length(str(lo), f"takes up to {lo} positions (--require length={required} needs no more); "
                               f"at {hi}: {why}", lo)
    sentence = f"raises {type(crash.exc).__name__} from {hi} positions on; takes up to {lo}, and declares no limit"
    return Length("raises", f"{sentence} (no refusal of its own, no position buffer or attribute of {lo}): {why}",
                  lo, sentence)
