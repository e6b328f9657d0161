"""Public import path of ``ModuleAdapter`` (``from attn_spec.module_adapters import ModuleAdapter``);
adapters live in :mod:`attn_spec.targets.module_adapters`."""
from attn_spec.targets.module_adapters import ModuleAdapter

__all__ = ["ModuleAdapter"]
