"""Why a target's output is not differentiable: which of the classic ways it left the graph.

Run only after the fact, once the output came back without ``requires_grad``: the forward is
called once more under a ``TorchFunctionMode`` that watches the tensors that carry gradients.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_BREAKS = {  # a Tensor method -> how it leaves the graph
    torch.Tensor.detach: ".detach()",
    torch.Tensor.detach_: ".detach_()",
    torch.Tensor.data.__get__: ".data",
    torch.Tensor.numpy: "a NumPy round trip (.numpy())",
    torch.Tensor.__array__: "a NumPy round trip (np.asarray)",
    torch.Tensor.tolist: "a round trip through Python numbers (.tolist())",
    torch.Tensor.item: "a round trip through Python numbers (.item())",
    torch.Tensor.requires_grad_: "requires_grad_(False)",
}


class _Watch(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def _note(self, how: str) -> None:
        if how not in self.found:
            self.found.append(how)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        tracked = any(t.requires_grad for t in tensors)
        floating = any(t.is_floating_point() for t in tensors)
        how = _BREAKS.get(func)
        if how and (tracked or (floating and "round trip" in how)):
            if func is not torch.Tensor.requires_grad_ or not (args[1:] + tuple(kwargs.values()) + (True,))[0]:
                self._note(how)
        elif tracked and not torch.is_grad_enabled():
            self._note("torch.inference_mode()" if torch.is_inference_mode_enabled() else
                       "torch.no_grad() (grad mode off inside the target)")
        return func(*args, **kwargs)


def how_detached(forward) -> str:
    """``forward()`` reruns the target's forward on inputs that require grad; how it left the graph."""
    watch = _Watch()
    try:
        with torch.enable_grad(), watch:
            forward()
    except Exception:  # noqa: BLE001 - only a diagnosis: the first call already told what matters
        pass
    if not watch.found:
        return "the output does not depend on Q, K, V through autograd (built from new tensors, or outside torch)"
    return "it leaves the autograd graph through " + " and ".join(watch.found)
