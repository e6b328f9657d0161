"""Whether a target's signature can take the calls its convention makes, before anything runs.

A convention is a promise about how the kit calls the target: ``function`` calls ``attention(Q, K, V)``,
``mask-mod`` calls ``mask_mod(b, h, q_idx, kv_idx)``, ``decode`` calls ``fn(q, k_cache, v_cache, ...)``, ``module`` builds ``Cls(d_model, n_heads)``. A target
forced into a convention whose call its signature cannot bind (``--convention function`` on a function of two
parameters) would raise a TypeError on every property, rooted in the kit's own frame; that is the caller's
mistake, so it is a usage error here, with the signature and the call side by side.

Only the arguments every call passes are bound (optional ones, such as function's mask or sdpa's
``is_causal``, are probed capabilities). A signature Python cannot read (a builtin, an extension
kernel) is taken on trust.
"""
from __future__ import annotations

import inspect

from attn_spec.errors import KitUsageError

# convention -> (the call in words, positional placeholders, keywords): what every call of the kit passes.
CALLS = {
    "function": ("attention(Q, K, V), and attention(Q, K, V, mask) when it takes a fourth argument", 3, ()),
    "sdpa": ("fn(query, key, value, ...), the options by name (attn_mask=, is_causal=, scale=)", 3, ()),
    "flex": ("flex_attention(query, key, value, block_mask=..., score_mod=..., ...)", 3, ()),
    "hf": ("fn(module, query, key, value, attention_mask, dropout=0.0, scaling=...)", 5, ("dropout", "scaling")),
    "mask-mod": ("mask_mod(b, h, q_idx, kv_idx)", 4, ()),
    "score-mod": ("score_mod(score, b, h, q_idx, kv_idx)", 5, ()),
    "decode": ("fn(q, k_cache, v_cache, ...), the rest by name (cache_seqlens=, k=, v=, block_table=, causal=, ...)", 3, ()),
    "merge": ("merge_state(v_a, s_a, v_b, s_b)", 4, ()),
    "varlen": ("fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, ...), the options by name", 7, ()),
}
BUILD = "Cls(d_model, n_heads)"
FORWARD = "module(x_q, x_kv), and module(x_q, x_kv, mask) with a mask"


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _refuse(signature, n_args: int, keywords=(), skip_self: bool = False) -> str | None:
    """Why ``signature`` cannot bind ``n_args`` positional arguments and ``keywords``; None when it can."""
    if signature is None:
        return None
    args = (None,) * (n_args + skip_self)
    try:
        signature.bind(*args, **dict.fromkeys(keywords))
    except TypeError as exc:
        return str(exc)
    return None


def _usage(name: str, convention: str, shown: str, call: str, why: str) -> KitUsageError:
    return KitUsageError(f"{name} cannot follow the {convention} convention: the {convention} convention calls "
                         f"{call}; {shown} cannot take that call ({why}). Pick the convention that fits it (--convention; "
                         f"attn-spec check --help lists them), or wrap it in a function of that call.")


def check_call_shape(obj, convention: str, name: str) -> None:
    """A KitUsageError when ``obj``'s signature cannot take ``convention``'s call (see the module docstring)."""
    if convention in CALLS:
        call, n_args, keywords = CALLS[convention]
        signature = _signature(obj)
        why = _refuse(signature, n_args, keywords)
        if why:
            raise _usage(name, convention, f"{getattr(obj, '__name__', name)}{signature}", call, why)
    elif convention == "module":  # a class, or a factory called as one
        signature = _signature(obj)
        why = _refuse(signature, 2)
        if why:
            raise _usage(name, convention, f"{getattr(obj, '__name__', name)}{signature}", BUILD, why)
        forward = getattr(obj, "forward", None) if inspect.isclass(obj) else None
        signature = _signature(forward) if inspect.isfunction(forward) else None
        why = _refuse(signature, 2, skip_self=True)
        if why:
            raise _usage(name, convention, f"{obj.__name__}.forward{signature}", FORWARD, why)
    elif convention == "torch-mha" and inspect.isfunction(obj):  # a factory (d_model, n_heads) -> MultiheadAttention
        signature = _signature(obj)
        why = _refuse(signature, 2)
        if why:
            raise _usage(name, convention, f"{obj.__name__}{signature}", f"the factory as {BUILD}", why)
