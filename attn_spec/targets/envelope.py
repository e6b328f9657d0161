"""The envelope: the head dims and dtypes a target takes, found before any other probe, and calls fitted into it.

Kernels state what they take in their own host code, before any arithmetic on the inputs: ``assert D in (16, 32,
64, 128)``, ``if q.dtype not in (torch.float16, torch.bfloat16): raise TypeError(...)``, ``assert Lk == Lv``,
``assert n_q == n_kv``. Such a refusal (:func:`declared_refusal`: an ``AssertionError``, ``ValueError``,
``TypeError`` or ``NotImplementedError`` whose innermost frame is a ``raise`` or ``assert`` statement in the
target's own file, not a torch kernel, an index or a size mismatch) is a declaration, as ``attn_spec.Unsupported``
is: the capability probes read it as ``no`` and the kit draws only inside what is left. Any other exception at some
size stays a crash, drawn and failed.

The probes run at a *base* (:func:`find_base`): float32 at head dim 2 where the target takes it (the kit's
historical baseline), else the first dtype checked and head dim in HEAD_DIMS it runs. At the base dtype every
head dim of HEAD_DIMS is then tried (:func:`probe_head_dims`); the dtypes are tried at the base head dim.

A probe of the kit's own that needs a width the target refuses (V = [[0], [1]] of the scale probe, V = I of the
behaviours) is fitted by :func:`fit_widths`: zero columns appended to Q and K (the scores unchanged; Q scaled by
sqrt(D / d_k) so that the default scale 1/sqrt(D) applies 1/sqrt(d_k)) and to V (its output columns sliced off
again): for a correct kernel the same numbers, inside the envelope.
"""
from __future__ import annotations

import math

import torch

from attn_spec.dtypes import DTYPES
from attn_spec.errors import Failure, NotDifferentiable, TargetRaised, Unsupported
from attn_spec.reference import causal_mask
from attn_spec.targets.loading import raised_on_purpose

HEAD_DIMS = (1, 2, 3, 8, 16, 24, 32, 64, 96, 128, 256)  # the head dims probed: odd ones, and the kernels' blocks
BASE_ORDER = (2, 64, 16, 32, 128, 8, 1, 3, 24, 96, 256)  # where a base is looked for first
REFUSALS = (AssertionError, ValueError, TypeError, NotImplementedError)


def declared_refusal(exc: TargetRaised) -> bool:
    """An ``assert``, ``raise ValueError``, ``TypeError`` or ``NotImplementedError`` statement in the target's own
    code (attn_spec.targets.loading.raised_on_purpose): a deliberate refusal of this input, not a crash."""
    return isinstance(exc.exc, REFUSALS) and raised_on_purpose(exc.exc)


def tensor(*shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def outcome(call, raised: str = "raises") -> tuple[str, str]:
    """("yes", "") or ("no" | "raises" | "error", why) for one probe call; ``raised``: the value when the target
    raises (a declared refusal is always ``no``)."""
    try:
        call()
        return "yes", ""
    except Unsupported as exc:
        return "no", str(exc)
    except TargetRaised as exc:
        return ("no", f"its own check: {exc.message}") if declared_refusal(exc) else (raised, exc.message)
    except NotDifferentiable as exc:  # detached: the gradients property fails and says how
        return "no", exc.message
    except Failure as exc:  # a wrong shape or type: the properties say more
        return "raises", exc.message
    except Exception as exc:  # noqa: BLE001 - a bug of the kit's own: this probe only, the others still run
        return "error", f"internal error in attn-spec: {type(exc).__name__}: {exc}"


def _self_attention(target, dtype, d: int, device, masked: bool):
    q, k, v = (tensor(2, d, dtype=dtype, device=device, seed=s) for s in range(3))  # [T=2, D=d] each
    return outcome(lambda: target.attend(q, k, v, causal_mask(2, 2, device=device) if masked else None))


def find_base(target, dtypes, device) -> tuple[str, int, bool]:
    """(dtype name, head dim, whether it ran) the capability probes run at: float32 (else the first dtype checked) at
    d = 2 where the target takes it, else the first pair, dtype by dtype, that runs without a mask or with the causal
    one. The search goes on only past the target's refusals: a crash (or a hang) ends it at the first pair, so a
    target that fails everywhere costs two calls here, and the properties say why."""
    order = (["float32"] if "float32" in dtypes else []) + [name for name in dtypes if name != "float32"]
    for name in order:
        for d in BASE_ORDER:
            for masked in (False, True):
                value, _ = _self_attention(target, DTYPES[name], d, device, masked)
                if value == "yes":
                    return name, d, True
                if value != "no":
                    return order[0], 2, False
    return order[0], 2, False  # it refuses everything: the properties say why


def probe_head_dims(target, dtype, device, masked: bool) -> tuple[str, str, tuple[int, ...] | None]:
    """(value, why, taken): ``yes`` when it refuses none of HEAD_DIMS (taken None: every width is drawn), else the
    taken ones in words ("16-128": every probed dim between, or "16/32/64/128") and the first refusal. A crash at a
    head dim is no refusal: that dim is drawn, and the properties fail there."""
    found = {d: _self_attention(target, dtype, d, device, masked) for d in HEAD_DIMS}
    refused = [d for d, (value, _) in found.items() if value == "no"]
    taken = tuple(d for d in HEAD_DIMS if d not in refused)
    if not refused or not taken:
        return "yes", "", None
    between = [d for d in HEAD_DIMS if taken[0] <= d <= taken[-1]]
    words = f"{taken[0]}-{taken[-1]}" if list(taken) == between and len(taken) > 1 else "/".join(map(str, taken))
    return words, f"at head dim {refused[0]}: {found[refused[0]][1]}", taken


def width_for(taken, width: int) -> int:
    """The smallest taken head dim at least ``width`` (the largest taken when none is)."""
    return min((d for d in taken if d >= width), default=max(taken))


def fit_widths(supported, q, k, v, scale):
    """(q, k, V's column blocks, d_v) inside ``supported``'s head dims: zero columns appended to Q and K (Q scaled by
    sqrt(D / d_k) when no explicit scale is given, so the target's default 1/sqrt(D) applies 1/sqrt(d_k)); V split
    into blocks of columns as wide as the target takes (V = I of Tk > 128 columns: one call per block), each padded
    with zero columns; ``d_v`` the width of V's own columns, to slice the joined output back to. Inputs inside the
    envelope, or that no padding fits, come back as they are (one block)."""
    taken, d_k, d_v = getattr(supported, "head_dims", None), q.shape[-1], v.shape[-1]
    same = supported is not None and not supported.dv_ne_dk
    if supported is None or k.shape[-1] != d_k or ((taken is None or (d_k in taken and d_v in taken))
                                                   and (not same or d_k == d_v)):
        return q, k, [v], d_v
    widths = taken or (max(d_k, d_v),)
    width_k = width_for(widths, max(d_k, d_v) if same else d_k)
    width_v = width_k if same else width_for(widths, d_v)
    if width_k < d_k:
        return q, k, [v], d_v  # wider keys than it takes: the call shows what the target does
    if width_k != d_k:
        if scale is None:
            q = q * math.sqrt(width_k / d_k)
        q, k = (torch.nn.functional.pad(t, (0, width_k - d_k)) for t in (q, k))  # [..., T, D]
    blocks = [torch.nn.functional.pad(block, (0, width_v - block.shape[-1]))  # [..., Tk, D_v]
              for block in v.split(width_v, dim=-1)]
    return q, k, blocks, d_v


def phrase(taken) -> str:
    """The verdict's words for the head dims taken: ``within head dims 16-128``."""
    between = [d for d in HEAD_DIMS if taken[0] <= d <= taken[-1]]
    return f"within head dims {taken[0]}-{taken[-1]}" if list(taken) == between and len(taken) > 1 else \
        f"within head dims {'/'.join(map(str, taken))}"
