"""Multi-head module targets (module, torch-mha, adapter), driven through a ModuleAdapter:
``attend`` embeds plain attention in them with one head and identity projections."""
from __future__ import annotations

import inspect
import math

import torch

from attn_spec.failures import fail
from attn_spec.errors import TargetLoadError, TargetRaised, Unsupported
from attn_spec.targets.base import MASK_FORMS, PROJECTIONS, Target, _call, check_output
from attn_spec.targets.guard import StateGuard, passes_through
from attn_spec.targets.layouts import broadcast_shapes
from attn_spec.targets.loading import user_traceback
from attn_spec.targets.module_adapters import ModuleAdapter, SeedAdapter, TorchMhaAdapter
from attn_spec.vocabulary import Traits


class ModuleTarget(Target):
    """A multi-head module, driven through a :class:`ModuleAdapter` (build, load weights, call); the ``module``
    convention itself is the seed's: any class ``Cls(d_model, n_heads)``, through :class:`SeedAdapter`."""

    traits = Traits("module", "Cls(d_model, n_heads) with nn.Linear W_Q, W_K, W_V, W_O; forward(x_q, x_kv, mask=None)",
                    multihead=True, declarable_masks=True, layout="tokens [T, d_model]", detect_rank=30)

    @staticmethod
    def detects(obj, names) -> bool:
        return inspect.isclass(obj)

    @classmethod
    def build(cls, obj, name, **kwargs):
        return cls(SeedAdapter(obj), name, **_module_keywords(kwargs))

    def __init__(self, adapter: ModuleAdapter, name: str, masks=None, **kwargs):
        super().__init__(adapter, name, masks, **kwargs)
        self.adapter = adapter
        self._modules = {}  # (d_model, n_heads, dtype, device) -> instance; weights are reloaded per call

    def fresh_instances(self) -> None:
        self._modules.clear()

    def calls_per_attend(self, case) -> int:
        return math.prod(getattr(case, "batch", ()))  # _attend calls the module once per batch element

    def _build(self, d_model, n_heads, weights, dtype, device):
        key = (d_model, n_heads, dtype, str(device))
        if key not in self._modules:
            if len(self._modules) >= 16:  # a module may hold big buffers (nanoGPT's causal mask): keep the newest
                del self._modules[next(iter(self._modules))]
            self._modules[key] = _call(self._new_module, (d_model, n_heads, dtype, device),
                                       f"{self.name}({d_model}, {n_heads})", self.state)
        module = self._modules[key]
        try:
            with torch.no_grad(), self.state.call(f"loading W_Q, W_K, W_V, W_O into {self.name}({d_model}, {n_heads})"):
                self.adapter.load(module, *(weights[name] for name in PROJECTIONS))
        except (AttributeError, RuntimeError) as exc:
            fail(f"{type(exc).__name__}: {exc}", what="loading W_Q, W_K, W_V, W_O into the module",
                 call=f"{self.name}({d_model}, {n_heads})",
                 cause=f"the {self.convention} convention needs W_Q, W_K, W_V, W_O as "
                       f"nn.Linear(d_model, d_model) (or an adapter that says where they are)")
        except BaseException as exc:  # noqa: BLE001 - the adapter's own code raised
            if passes_through(exc):
                raise
            raise TargetRaised(exc, f"{self.name}.load(...)", user_traceback(exc)) from None
        return module

    def _new_module(self, d_model, n_heads, dtype, device):
        module = self.adapter.build(d_model, n_heads)
        if hasattr(module, "to"):
            module = module.to(device=device, dtype=dtype)
            module.eval()
        return module

    def vjp(self, q, k, v, mask, grad_out):
        try:
            return super().vjp(q, k, v, mask, grad_out)
        finally:  # .backward() also filled the parameters' .grad: leave the modules as they were
            for module in self._modules.values():
                for p in module.parameters() if isinstance(module, torch.nn.Module) else ():
                    p.grad = None

    def multihead(self, x_q, x_kv, weights, n_heads, mask=None):
        mask = self._mask_for_call(mask, x_q.dtype)
        with torch.no_grad():
            return self._multihead(x_q, x_kv, weights, n_heads, mask)

    def _multihead(self, x_q, x_kv, weights, n_heads, mask, module=None):
        if self.adapter.self_attention_only and not (x_q is x_kv or (x_q.shape == x_kv.shape and torch.equal(x_q, x_kv))):
            raise Unsupported(f"{self.name} does self-attention only (no separate x_kv)")
        self.calls += 1
        if module is None:
            module = self._build(x_q.shape[-1], n_heads, weights, x_q.dtype, x_q.device)
        call = "forward(x_q, x_kv, mask)" if mask is not None else "forward(x_q, x_kv)"
        out = self._observe("multihead", {"x_q": x_q, "x_kv": x_kv, "weights": weights, "n_heads": n_heads,
                                          "mask": mask},
                            lambda: _call(lambda *a: self.adapter.forward(module, *a), (x_q, x_kv, mask), call,
                                          self.state),
                            call, state_key=(x_q.shape[-1], n_heads, x_q.dtype, str(x_q.device)))
        return check_output(out, (x_q.shape[0], x_q.shape[-1]), call, inputs={"x_q": x_q, "x_kv": x_kv, "mask": mask},
                            state=self.state)

    def _attend(self, q, k, v, mask, *, scale=None, is_causal=False):
        """Plain attention through the module: one head, projections that select Q, K and V.

        Cross form: x_q = [2^m Q | 0], x_kv = [K | V | 0]. Self-attention-only modules get
        x = [2^m Q | K | V | 0] for both (n_q must equal n_kv). D = 4^m * d_k, so the module's
        1/sqrt(D) times the gain 2^m is exactly 1/sqrt(d_k).
        """
        self._no_extra_arguments(scale, is_causal)
        batch = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        n_q, d_k, n_kv, d_v = q.shape[-2], q.shape[-1], k.shape[-2], v.shape[-1]
        self_only = self.adapter.self_attention_only
        if self_only and n_q != n_kv:
            raise Unsupported(f"{self.name} does self-attention only (n_q != n_kv needs a separate x_kv)")
        width = (2 * d_k if self_only else d_k) + d_v  # columns the inputs need
        m = 0
        while 4**m * d_k < width:
            m += 1
        d_model, gain = 4**m * d_k, 2.0**m  # gain / sqrt(d_model) == 1 / sqrt(d_k), exactly
        k_at, v_at = (d_k, 2 * d_k) if self_only else (0, d_k)  # where K and V sit in the input rows
        weights = {name: torch.zeros(d_model, d_model, dtype=q.dtype, device=q.device) for name in PROJECTIONS}
        idx = torch.arange(d_k, device=q.device)
        weights["W_Q"][idx, idx] = 1  # Q block -> head columns 0:d_k
        weights["W_K"][idx, k_at + idx] = 1  # K block -> head columns 0:d_k
        idv = torch.arange(d_v, device=q.device)
        weights["W_V"][idv, v_at + idv] = 1  # V block -> head columns 0:d_v
        weights["W_O"] = torch.eye(d_model, dtype=q.dtype, device=q.device)
        q, k, v = q.expand(*batch, n_q, d_k), k.expand(*batch, n_kv, d_k), v.expand(*batch, n_kv, d_v)
        if mask is not None:  # a key-padding mask [..., 1, Tk] stays one row: the module sees it as given
            mask = mask.expand(*batch, mask.shape[-2], n_kv)
        module = self._build(d_model, 1, weights, q.dtype, q.device)  # loaded once: a vjp's graph saves the weights
        rows = []
        for index in (torch.cartesian_prod(*[torch.arange(n) for n in batch]).reshape(-1, len(batch)).tolist()
                      if batch else [[]]):
            index = tuple(index)
            if self_only:
                x = torch.cat([q[index] * gain, k[index], v[index],
                               q.new_zeros(n_q, d_model - width)], dim=-1)  # [T, D]
                x_q = x_kv = x
            else:
                x_q = torch.cat([q[index] * gain, q.new_zeros(n_q, d_model - d_k)], dim=-1)  # [Tq, D]
                x_kv = torch.cat([k[index], v[index], q.new_zeros(n_kv, d_model - width)], dim=-1)  # [Tk, D]
            y = self._multihead(x_q, x_kv, weights, 1, None if mask is None else mask[index], module)  # [Tq, D]
            rows.append(y[:, :d_v])  # [Tq, Dv]
        return torch.stack(rows).reshape(*batch, n_q, d_v)  # [..., Tq, Dv]




def _module_keywords(kwargs) -> dict:
    """What a module target's constructor takes of build()'s keywords (the guard is set by make_target)."""
    return {key: value for key, value in kwargs.items() if key in ("masks", "inference_only")}


class TorchMhaTarget(ModuleTarget):
    """``torch.nn.MultiheadAttention``: the class, an instance, or a factory ``(d_model, n_heads) -> MHA``."""

    traits = Traits("torch-mha", "nn.MultiheadAttention, or a factory (d_model, n_heads) -> nn.MultiheadAttention",
                    trained=False, multihead=True, masks=MASK_FORMS,  # it takes additive float masks too
                    layout="tokens [T, d_model]", detect_rank=20)
    returns_weights = True  # forward returns (out, weights)

    @staticmethod
    def detects(obj, names) -> bool:
        mha = torch.nn.MultiheadAttention
        return isinstance(obj, mha) or (inspect.isclass(obj) and issubclass(obj, mha))

    @classmethod
    def build(cls, obj, name, **kwargs):
        adapter = TorchMhaAdapter.from_instance(obj, name) if isinstance(obj, torch.nn.Module) \
            else TorchMhaAdapter(obj, name=name)
        return cls(adapter, name, **_module_keywords(kwargs))


class AdapterTarget(ModuleTarget):
    """Any other module, through the user's :class:`ModuleAdapter` (a subclass or an instance)."""

    traits = Traits("adapter", "a ModuleAdapter subclass (or instance) that builds, loads and calls the module",
                    multihead=True, declarable_masks=True, layout="tokens [T, d_model]", detect_rank=10)

    @staticmethod
    def detects(obj, names) -> bool:
        return isinstance(obj, ModuleAdapter) or (inspect.isclass(obj) and issubclass(obj, ModuleAdapter))

    @classmethod
    def build(cls, obj, name, *, state=None, **kwargs):
        return cls(_instance(obj, name, state or StateGuard()), name, **_module_keywords(kwargs))


def _instance(adapter, name: str, state: StateGuard):
    """The user's adapter instance (a class is instantiated: an exception there is a TargetLoadError)."""
    if not inspect.isclass(adapter):
        return adapter
    try:
        return _call(adapter, (), f"{name}()", state)
    except (TargetRaised, Unsupported) as exc:
        trace = f"\n\n{exc.user_traceback}" if isinstance(exc, TargetRaised) else ""
        raise TargetLoadError(f"Cannot use target {name!r}: {exc}{trace}") from None
