"""What is checked: loading a TARGET path, calling it through its calling convention
(``base``: the Target interface; ``conventions``: which one a target follows; ``functions``: function,
sdpa; ``modules``: module, torch-mha, adapter; ``hf``, ``flex``, ``mask_mods``: the
library conventions, each in a module of its own; ``serving_decode``, ``serving_merge``, ``serving_varlen``: KV-cache decode, LSE-merge and packed-batch kernels; ``layouts``: [B, H, S, D] or [B, S, H, D]), the user's
``ModuleAdapter``s (``module_adapters``), and what the target can do and how it behaves, probed on tiny
inputs (``capabilities``, ``behaviours``). Every call into the user's code runs under ``guard`` (the global
state it changes is restored and noted) and its ``deadline``; its output is captured per phase (``capture``); a detached
output is diagnosed by ``detached``; while a failure is replayed, every call is recorded (``record``).
Nothing here imports ``checking/`` or anything above it (tests/test_layout.py)."""
from attn_spec.targets import functions, modules, mask_mods, flex, hf, serving_decode, serving_merge, serving_varlen  # noqa: F401,E402 - registers the kit's conventions
