"""The adapter layer: every target, whatever its convention, seen through one call interface.

Properties never touch the user's object. They call

- ``target.attend(q, k, v, mask=None) -> out``: attention on Q [..., Tq, Dk], K [..., Tk, Dk],
  V [..., Tk, Dv], bool mask broadcastable to [..., Tq, Tk] with True = may attend;
- ``target.multihead(x_q, x_kv, weights, n_heads, mask=None) -> out``: a multi-head module
  built as ``Cls(d_model, n_heads)`` with the given projection weights (``module`` only).

Tensors go in and come out, so the same catalog can drive a target that lives in another
process (the grader) or inside pytest.

Conventions:
- ``function``: ``attention(Q, K, V, mask=None)``, the seed's function.
- ``module``: a class ``Cls(d_model, n_heads)`` with ``nn.Linear`` (no bias) ``W_Q``, ``W_K``,
  ``W_V``, ``W_O`` and ``forward(x_q [Tq, D], x_kv [Tk, D], mask=None)``. ``attend`` embeds plain
  attention in it: one head, identity projections, Q scaled by 2^m where D = 4^m * Dk, so that
  the module's own 1/sqrt(D) becomes exactly 1/sqrt(Dk) with no rounding.
"""
from __future__ import annotations

import inspect

import torch

from attn_spec.errors import Failure, TargetRaised, Unsupported
from attn_spec.loading import user_traceback

CONVENTIONS = ("function", "module")
PROJECTIONS = ("W_Q", "W_K", "W_V", "W_O")


def _call(fn, args, call: str):
    """Run the user's code; its exceptions become a TargetRaised (or Unsupported) with its traceback.

    Autograd follows the caller's mode: off by default, on inside ``Target.vjp``.
    """
    try:
        return fn(*args)
    except NotImplementedError as exc:
        raise Unsupported(f"{call} raised NotImplementedError: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - anything the user's code raises is a finding
        raise TargetRaised(exc, call, user_traceback(exc)) from None


def check_output(out, shape: tuple, call: str) -> torch.Tensor:
    """The output must be a tensor of the contract's shape."""
    if not isinstance(out, torch.Tensor):
        raise Failure(f"{call} returned a {type(out).__name__}, expected a torch.Tensor of shape {list(shape)}",
                      cause="the function must return the output tensor (only the output, not a tuple)")
    if tuple(out.shape) != tuple(shape):
        raise Failure(f"{call} returned shape {list(out.shape)}, expected {list(shape)}",
                      cause="the output must be [..., n_q, d_v]: one row per query, as wide as V")
    return out


class Target:
    """Base adapter. ``name`` names the target in reports; ``calls`` counts calls into it."""

    convention = "?"

    def __init__(self, obj, name: str):
        self.obj, self.name, self.calls = obj, name, 0

    def attend(self, q, k, v, mask=None) -> torch.Tensor:
        with torch.no_grad():
            return self._attend(q, k, v, mask)

    def _attend(self, q, k, v, mask):
        raise NotImplementedError  # sanity check: every convention implements it

    def vjp(self, q, k, v, mask, grad_out):
        """(out, dQ, dK, dV): the output and the gradients of <out, grad_out> w.r.t. Q, K and V.

        A gradient that does not reach an input comes back as zeros. A target whose output
        is not differentiable at all (detached, computed under no_grad) raises Unsupported.
        """
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
        with torch.enable_grad():
            out = self._attend(*leaves, mask)
            if not out.requires_grad:
                raise Unsupported("no autograd: the output is not differentiable in Q, K, V "
                                  "(computed under no_grad, detached, or outside torch)")
            grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]
        return (out.detach(), *grads)

    def multihead(self, x_q, x_kv, weights, n_heads, mask=None) -> torch.Tensor:
        raise Unsupported(f"the {self.convention} convention has no multi-head projections to compare")


def _attend_shape(q, k, v):
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    return tuple(batch) + (q.shape[-2], v.shape[-1])


class FunctionTarget(Target):
    """``attention(Q, K, V, mask=None) -> out``."""

    convention = "function"

    def _attend(self, q, k, v, mask):
        self.calls += 1
        call = "attention(Q, K, V, mask)" if mask is not None else "attention(Q, K, V)"
        args = (q, k, v) if mask is None else (q, k, v, mask)
        return check_output(_call(self.obj, args, call), _attend_shape(q, k, v), call)


class ModuleTarget(Target):
    """``Cls(d_model, n_heads)`` with W_Q, W_K, W_V, W_O and ``forward(x_q, x_kv, mask=None)``."""

    convention = "module"

    def __init__(self, obj, name):
        super().__init__(obj, name)
        self._modules = {}  # (d_model, n_heads, dtype, device) -> instance; weights are reloaded per call

    def _build(self, d_model, n_heads, weights, dtype, device):
        key = (d_model, n_heads, dtype, str(device))
        if key not in self._modules:
            self._modules[key] = self._construct(d_model, n_heads, dtype, device)
        module = self._modules[key]
        with torch.no_grad():
            for name in PROJECTIONS:
                getattr(module, name).weight.copy_(weights[name])
                if getattr(getattr(module, name), "bias", None) is not None:
                    getattr(module, name).bias.zero_()
        return module

    def _construct(self, d_model, n_heads, dtype, device):
        call = f"{self.name}({d_model}, {n_heads})"
        module = _call(self.obj, (d_model, n_heads), call)
        for name in PROJECTIONS:
            layer = getattr(module, name, None)
            w = getattr(layer, "weight", None)
            if not isinstance(w, torch.Tensor) or tuple(w.shape) != (d_model, d_model):
                raise Failure(f"{call}.{name} is not an nn.Linear({d_model}, {d_model})",
                              cause="the module convention needs W_Q, W_K, W_V, W_O as nn.Linear(d_model, d_model)")
        if hasattr(module, "to"):
            module = module.to(device=device, dtype=dtype)
            module.eval()
        return module

    def multihead(self, x_q, x_kv, weights, n_heads, mask=None):
        with torch.no_grad():
            return self._multihead(x_q, x_kv, weights, n_heads, mask)

    def _multihead(self, x_q, x_kv, weights, n_heads, mask):
        self.calls += 1
        module = self._build(x_q.shape[-1], n_heads, weights, x_q.dtype, x_q.device)
        call = "forward(x_q, x_kv, mask)" if mask is not None else "forward(x_q, x_kv)"
        args = (x_q, x_kv) if mask is None else (x_q, x_kv, mask)
        return check_output(_call(module, args, call), (x_q.shape[0], x_q.shape[-1]), call)

    def _attend(self, q, k, v, mask):
        batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        n_q, d_k, n_kv, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        m = 0
        while 4**m * d_k < d_k + d_v:
            m += 1
        d_model, gain = 4**m * d_k, 2.0**m  # gain / sqrt(d_model) == 1 / sqrt(d_k), exactly
        eye = torch.eye(d_model, dtype=q.dtype, device=q.device)  # [D, D]
        keep_k = torch.zeros(d_model, dtype=q.dtype, device=q.device)
        keep_k[:d_k] = 1
        keep_v = torch.zeros_like(keep_k)
        keep_v[d_k:d_k + d_v] = 1
        weights = {"W_Q": eye, "W_K": torch.diag(keep_k), "W_V": torch.diag(keep_v), "W_O": eye}
        q, k, v = q.expand(*batch, n_q, d_k), k.expand(*batch, n_kv, d_k), v.expand(*batch, n_kv, d_v)
        if mask is not None:
            mask = mask.expand(*batch, n_q, n_kv)
        rows = []
        for index in (torch.cartesian_prod(*[torch.arange(n) for n in batch]).reshape(-1, len(batch)).tolist()
                      if batch else [[]]):
            index = tuple(index)
            pad_q = torch.zeros(n_q, d_model - d_k, dtype=q.dtype, device=q.device)
            pad_kv = torch.zeros(n_kv, d_model - d_k - d_v, dtype=q.dtype, device=q.device)
            x_q = torch.cat([q[index] * gain, pad_q], dim=-1)  # [Tq, D]
            x_kv = torch.cat([k[index], v[index], pad_kv], dim=-1)  # [Tk, D]
            y = self._multihead(x_q, x_kv, weights, 1, None if mask is None else mask[index])  # [Tq, D]
            rows.append(y[:, d_k:d_k + d_v])  # [Tq, Dv]
        return torch.stack(rows).reshape(*batch, n_q, d_v)  # [..., Tq, Dv]


def detect_convention(obj) -> str:
    """A class is a ``module``; any other callable is a ``function``."""
    return "module" if inspect.isclass(obj) else "function"


def make_target(obj, name: str | None = None, convention: str | None = None) -> Target:
    name = name or getattr(obj, "__qualname__", None) or type(obj).__name__
    convention = convention or detect_convention(obj)
    if convention not in CONVENTIONS:
        from attn_spec.strategies import KitUsageError
        raise KitUsageError(f"convention={convention!r}, but it must be one of {', '.join(CONVENTIONS)}")
    return {"function": FunctionTarget, "module": ModuleTarget}[convention](obj, name)
