"""The correct serving kernels on one recorded call: the float64 references every serving mistake model departs
from (attn_spec.diagnosis.serving, serving_paged), each returning the outputs a call's record names (decode: out,
k_after, v_after, and the LSE where the call returned one; merge: v, s; varlen: out, lse)."""
from __future__ import annotations

import torch

from attn_spec.serving_reference import decode_reference, merge_reference, varlen_reference


def decoded(out, lse, k_after, v_after) -> dict:
    """decode_reference's four results as a decode call's outputs (the LSE compared only where a call returned one)."""
    return {"out": out, "k_after": k_after, "v_after": v_after, "lse": lse}


def correct_decode(c, **change) -> dict:
    """decode_reference on one recorded call, with ``change`` (cache_seqlens, causal, causal_alignment) made to it."""
    args = {"cache_seqlens": c["cache_seqlens"], "causal": c["causal"], **change}
    return decoded(*decode_reference(c["q"], c["k_cache"], c["v_cache"], args.pop("cache_seqlens"), c["k"], c["v"],
                                     c["cache_leftpad"], scale=c["scale"], block_table=c.get("block_table"), **args))


def element(c, b: int) -> dict:
    """The decode call ``c`` restricted to its batch element ``b`` (its caches included)."""
    one = {name: None if c[name] is None else c[name][b:b + 1]
           for name in ("q", "k_cache", "v_cache", "k", "v", "cache_leftpad")}
    return {**c, **one, "cache_seqlens": torch.as_tensor(c["cache_seqlens"])[b:b + 1]}


def correct_merge(c) -> dict:
    v, s = merge_reference(*c["inputs"], base=c["base"])
    return {"v": v, "s": s}


def correct_varlen(c, **change) -> dict:
    """varlen_reference on one recorded call, with ``change`` (cu_q, cu_k, softcap, alignment, key_shift, grouping)
    made to it."""
    args = {"cu_q": c["cu_q"], "cu_k": c["cu_k"], "softcap": c["softcap"], **change}
    out, lse = varlen_reference(c["q"], c["k"], c["v"], args.pop("cu_q"), args.pop("cu_k"), causal=c["causal"],
                                window=c["window"], scale=c["scale"], **args)
    return {"out": out, "lse": lse}


CORRECT = {"decode": correct_decode, "merge": correct_merge, "varlen": correct_varlen}
