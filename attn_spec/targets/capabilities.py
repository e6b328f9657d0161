"""Capabilities: what a target can be asked to do. Probed on tiny inputs and reported in the header.

A target that lacks one (it takes no such argument, or raises ``NotImplementedError``) is not
wrong: the properties that need it are skips with the reason. A user who needs it says so with
``attn-spec check --require mask autograd``, and a missing capability becomes a failing result
``capability:<name>``.

==============  ==================================================================
capability      probe (float32, Q [2, 2] against K, V [2, 2] unless stated)
==============  ==================================================================
``mask``        a bool mask argument
``batch``       leading batch dims: Q, K, V [2, 2, 2]
``cross``       n_q != n_kv: K, V [3, 2] (self-attention-only modules lack it)
``dv-ne-dk``    values wider than keys: V [2, 3]
``scale``       an explicit ``scale`` argument (the sdpa convention)
``is-causal``   an ``is_causal`` argument (the sdpa convention)
``autograd``    gradients flow from the output to Q, K and V
``gqa``         grouped-query heads: Q [4, 2, 2] over K, V [2, 2, 2] (function conventions)
``float64``,    the baseline in that dtype; ``unchecked`` when ``--dtypes`` leaves it out
``float16``,
``bfloat16``
==============  ==================================================================

Each probe yields ``yes``; ``no`` (the target declared or lacks it); ``raises`` (it raised some
other exception, in its forward or its backward: the properties that use such inputs fail and say
why); ``n/a``/``unchecked``; or ``error`` (a bug of the kit's own in that probe).
"""
from __future__ import annotations

import torch

from attn_spec.targets.conventions import FUNCTION_CONVENTIONS
from attn_spec.checking.cases import DTYPES
from attn_spec.errors import Failure, NotDifferentiable, TargetRaised, Unsupported
from attn_spec.errors import KitUsageError

CAPABILITIES = ("mask", "batch", "cross", "dv-ne-dk", "scale", "is-causal", "autograd", "gqa",
                "float64", "float16", "bfloat16")


def _t(*shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(device=device, dtype=dtype)


def _probes(target, dtype, device):
    """name -> a call that exercises that capability alone (every other input is the baseline)."""
    def t(*shape, seed=0, dt=dtype):
        return _t(*shape, dtype=dt, device=device, seed=seed)

    q, k, v = t(2, 2), t(2, 2, seed=1), t(2, 2, seed=2)  # the baseline: [T=2, D=2] each
    causal = torch.ones(2, 2, dtype=torch.bool, device=device).tril()  # [Tq, Tk], True = may attend
    probes = {
        "mask": lambda: target.attend(q, k, v, causal),
        "batch": lambda: target.attend(t(2, 2, 2), t(2, 2, 2, seed=1), t(2, 2, 2, seed=2)),
        "cross": lambda: target.attend(q, t(3, 2, seed=1), t(3, 2, seed=2)),
        "dv-ne-dk": lambda: target.attend(q, k, t(2, 3, seed=2)),
        "scale": lambda: target.attend(q, k, v, scale=0.5),
        "is-causal": lambda: target.attend(q, k, v, is_causal=True),
        "autograd": lambda: target.vjp(q, k, v, None, torch.ones_like(q)),
        "gqa": lambda: target.attend(t(4, 2, 2), t(2, 2, 2, seed=1), t(2, 2, 2, seed=2)),
    }
    for name in ("float64", "float16", "bfloat16"):
        dt = DTYPES[name]
        probes[name] = lambda dt=dt: target.attend(t(2, 2, dt=dt), t(2, 2, seed=1, dt=dt), t(2, 2, seed=2, dt=dt))
    return probes


def probe_capabilities(target, dtypes=tuple(DTYPES), device: str = "cpu") -> tuple[dict, dict]:
    """(values, reasons): ``{"mask": "yes", "scale": "no", ...}`` and, for each capability that is not
    ``yes``, why (the target's own words where it gave them)."""
    base = torch.float32 if "float32" in dtypes else DTYPES[dtypes[0]]
    values, reasons = {}, {}
    for name, call in _probes(target, base, device).items():
        if name in DTYPES and name not in dtypes:
            values[name], reasons[name] = "unchecked", "not among the dtypes checked (--dtypes)"
            continue
        if name == "gqa" and target.convention not in FUNCTION_CONVENTIONS:
            values[name], reasons[name] = "n/a", f"the {target.convention} convention has no head dims to group"
            continue
        try:
            call()
            values[name] = "yes"
        except Unsupported as exc:
            values[name], reasons[name] = "no", str(exc)
        except TargetRaised as exc:  # GQA is opt-in: a target that cannot broadcast the heads lacks it
            values[name], reasons[name] = ("no" if name == "gqa" else "raises"), exc.message
        except NotDifferentiable as exc:  # detached: the gradients property fails and says how
            values[name], reasons[name] = "no", exc.message
        except Failure as exc:  # a wrong shape or type: the properties say more
            values[name], reasons[name] = "raises", exc.message
        except Exception as exc:  # noqa: BLE001 - a bug of the kit's own: this probe only, the others still run
            values[name], reasons[name] = "error", f"internal error in attn-spec: {type(exc).__name__}: {exc}"
    return values, reasons


def parse_capabilities(items) -> list[str]:
    """The capability names among ``--require`` items (those without ``=``); unknown names are a usage error."""
    names = [item for item in items or () if "=" not in item]
    unknown = [name for name in names if name not in CAPABILITIES]
    if unknown:
        raise KitUsageError(f"{unknown[0]!r} is not a capability; capabilities: {', '.join(CAPABILITIES)} "
                            f"(or a convention as key=value, see attn_spec.targets.behaviours)")
    return names
