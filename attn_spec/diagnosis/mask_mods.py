"""The wrong mask_mods: the classic mistakes in writing an --expect-mask statement as a mask_mod
(:class:`attn_spec.targets.mask_mods.MaskStatement`), each a dense mask beside the sentence that names it. The
property mask-mod-statement compares the mask_mod with the statement; when they differ, the cause is the near miss
the mask_mod computes (:mod:`attn_spec.diagnosis.causes`)."""
from __future__ import annotations

import torch

DIAGONAL = "the diagonal is masked: kv_idx < q_idx where kv_idx <= q_idx was meant (each query must see itself)"


def _mistakes(name, arg, i, j):
    if name == "causal":
        yield DIAGONAL, j < i
        yield "the triangle is transposed: kv_idx >= q_idx lets each query see the keys after it", j >= i
    elif name == "sliding-window":
        for wrong in (arg + 1, arg - 1):
            if wrong >= 1:
                yield (f"the window keeps {wrong} keys, not {arg}: sliding-window:{arg} is q_idx - {arg} < kv_idx <= "
                       f"q_idx (off by one: {'<=' if wrong > arg else '<'} where {'<' if wrong > arg else '<='} "
                       f"was meant)", (j <= i) & (j > i - wrong))
        yield DIAGONAL, (j < i) & (j > i - arg)
        yield "the window is not causal: keys after the query are allowed", (j - i).abs() < arg
        yield "the window is missing: every earlier key is allowed (plain causal)", j <= i
    elif name == "prefix-lm":
        for wrong in (arg + 1, arg - 1):
            if wrong >= 0:
                yield f"the prefix has {wrong} keys, not {arg} (off by one in kv_idx < P)", (j <= i) | (j < wrong)
        yield DIAGONAL, (j < i) | (j < arg)
        yield "the prefix is missing: plain causal", j <= i
    else:
        yield "documents are not separated: keys of other documents are allowed", torch.ones_like(j <= i)


def near_misses(statement, n_q, n_kv):
    """(cause, dense) of the classic mistakes in writing ``statement`` (a MaskStatement) as a mask_mod."""
    i, j = torch.arange(n_q)[:, None], torch.arange(n_kv)[None, :]
    yield "the mask_mod allows every pair", torch.ones(n_q, n_kv, dtype=torch.bool)
    for index, (name, arg) in enumerate(statement.parts):
        for cause, stand_in in _mistakes(name, arg, i, j):
            yield cause, statement.dense(n_q, n_kv, (index, stand_in))
