"""Wrong attention that patches torch, builtins and the kit in its own process to look right."""
import builtins

import torch

import attn_spec.targets.conventions
import attn_spec.properties
import attn_spec.checking.runner
from attn_spec.report import PropertyResult

torch.allclose = lambda *args, **kwargs: True
torch.isclose = lambda a, b, *args, **kwargs: torch.ones_like(a, dtype=torch.bool)
torch.Tensor.__eq__ = lambda self, other: True
attn_spec.targets.conventions.check_output = lambda out, shape, call: out
attn_spec.checking.runner.run_property = lambda prop, *args, **kwargs: PropertyResult(prop.id, "pass")
for entry in list(attn_spec.properties.catalog().values()):
    object.__setattr__(entry, "fn", lambda target, case: None)
builtins.print = lambda *args, **kwargs: None


def attention(Q, K, V, mask=None):
    return torch.zeros(*Q.shape[:-1], V.shape[-1], dtype=Q.dtype)
