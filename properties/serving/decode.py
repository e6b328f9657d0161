"""KV-cache decoding (the ``decode`` convention, attn_spec.targets.serving_decode): what a kernel that serves a
model must compute from a cache, whatever it reads and writes to get there.

A case is read as a batch of decode calls: B = the case's first batch dim, H = the product of the others (H_kv
key/value heads where the case has ``kv_heads``: its last dim grouped), D = d_k, S_new = min(n_q, n_kv) new
tokens, and per batch element a sequence of L_b keys, the case's drawn ``cache_lengths`` in [S_new, n_kv] (every
one n_kv where it has none). The cache has n_kv + 2 rows, so every element has spare rows past its end, filled with
stale values (or NaN, where the property says they must not matter).
"""
from __future__ import annotations

import math

import torch

from attn_spec import reference
from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.cases import Case, _values
from attn_spec.checking.tolerance import budget
from attn_spec.errors import KitUsageError, Unsupported
from attn_spec.targets.serving_decode import unread_fill
from attn_spec.failures import because

F64 = torch.float64
DECODE_CASES = {"masks": ("none",), "batch": True, "same_width": True, "cache": True, "grouped": 1}
AT_SCALE = {"cache": True}  # --shapes B,H,[HKV,]S_NEW,S_CACHE,D[,page=P] (attn_spec.checking.shapes.decode_case)
# Tried first: three new tokens after cached ones, in elements of different lengths (where top-left and bottom-right
# causal differ, one element's length used for all is wrong, and a chunk of two must be masked inside).
EXAMPLES = (Case(batch=(2, 1), n_q=3, n_kv=6, d_k=2, d_v=2, cache_lengths=(6, 4), seed=11),)


def kv_heads(case) -> int:
    """H_kv: the product of the case's head dims, its last one ``kv_heads`` where it has them (grouped)."""
    heads = case.batch[1:]
    return math.prod(heads[:-1]) * case.kv_heads if case.kv_heads and heads else math.prod(heads)


def decode_inputs(case, *, leftpad=False):
    """(q [B, S, H, D], k_full, v_full [B, n_kv + 2, H_kv, D], lengths [B], leftpad [B] or None) in the case's dtype.

    Row t < L_b of k_full/v_full is token t of element b's sequence; rows from L_b on are stale values of
    some other sequence. With ``leftpad``, element b's first leftpad_b < L_b - S rows are padding."""
    B, H, H_kv = case.batch[0], math.prod(case.batch[1:]), kv_heads(case)
    S, D, n = min(case.n_q, case.n_kv), case.d_k, case.n_kv
    gen = torch.Generator().manual_seed(case.seed)
    lengths = torch.tensor(case.cache_lengths or (n,) * B, dtype=torch.int32)  # [B], each in [S, n]
    if lengths.shape != (B,) or not bool(((lengths >= S) & (lengths <= n)).all()):
        raise KitUsageError(f"cache_lengths {list(case.cache_lengths)}: expected {B} lengths in [{S}, {n}]")
    draw = lambda *shape: _values(gen, shape, case.values, case.magnitude).to(case.torch_dtype)  # noqa: E731
    q, k_full, v_full = draw(B, S, H, D), draw(B, n + 2, H_kv, D), draw(B, n + 2, H_kv, D)
    pad = None
    if leftpad:
        room = (lengths - S).clamp_min(0)  # [B]: rows that may be padding
        pad = (torch.rand(B, generator=gen) * (room + 1).to(F64)).floor().to(torch.int32).minimum(room)  # [B]
    return tuple(t.to(case.device) for t in (q, k_full, v_full)) + (lengths, pad)


def last_rows_reference(q, k_full, v_full, b, start, end):
    """Element b's S queries as the last S of its sequence over keys [start, end): (q, k, v [H, ., D], out64); grouped
    K/V heads repeated to the query heads (head h reads K/V head h // g)."""
    group = q.shape[2] // k_full.shape[2]
    k_b, v_b = (reference.repeat_kv(t[b, start:end], group, 1).transpose(0, 1) for t in (k_full, v_full))  # [H, L, D]
    q_b = q[b].transpose(0, 1)  # [H, S, D]
    out, _ = reference.attention(q_b, k_b, v_b, causal=True, causal_alignment="bottom-right")  # [H, S, D]
    return q_b, k_b, v_b, out


@prop("decode-equals-full-causal", family="serving",
      statement="decoding S_new tokens from a cache of L - S_new (appended) or L (already filled) rows gives the last "
                "S_new rows of full causal attention over the L tokens",
      conventions=("decode",), cases=DECODE_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="decode(q_{L-S:L}, cache_{<L-S}, k_new, v_new) = causal(Q, K, V)_{L-S:L}  (bottom-right)",
                    latex=r"\mathrm{decode}(q_{L-S:L}, \mathrm{cache}_{<L-S}, k_{new}, v_{new}) = "
                          r"\mathrm{causal}(Q, K, V)_{L-S:L}",
                    check="Builds each element's sequence of L_b tokens, calls the kernel twice (the last S_new tokens "
                          "appended with k and v, then already in the cache), and compares each with the float64 "
                          "last rows of causal attention over the L_b tokens, within the same-dtype budget.",
                    example="decode"))
def decode_equals_full_causal(target, case):
    """decode(q, cache[:L - S], k = K[L - S:L], v = V[L - S:L]) = softmax(q K^T / sqrt(d) + M) V with M the causal
    mask aligned bottom-right: new token i (0 <= i < S) is token L - S + i of the sequence and sees keys j <= L - S + i.

    Why: a decode step must give exactly what the full forward pass would give for those tokens, or generation
    drifts from the model that was trained. Catches: causal aligned top-left (the new token sees only the first
    key), keys past cache_seqlens read (the stale tail of a cache or page), the appended rows ignored or written
    one row off, the cache length of element 0 used for every element.
    """
    q, k_full, v_full, lengths, _ = decode_inputs(case)
    S = q.shape[1]
    for appended in (True, False):
        k_cache, v_cache = k_full.clone(), v_full.clone()
        seqlens = lengths - S if appended else lengths
        new = [t[torch.arange(len(lengths))[:, None], (seqlens[:, None] + torch.arange(S)).long()]
               for t in (k_full, v_full)] if appended else [None, None]  # [B, S, H, D]
        out = target.decode(q, k_cache, v_cache, seqlens.to(q.device), *new, causal=True)  # [B, S, H, D]
        for b, length in enumerate(lengths.tolist()):
            q_b, k_b, v_b, ref = last_rows_reference(q, k_full, v_full, b, 0, length)
            call = (f"{target.name}(q, k_cache, v_cache{', k, v' if appended else ''}, cache_seqlens, causal=True), "
                    f"element {b}: {length} tokens, {S} of them new{' (appended)' if appended else ' (in the cache)'}")
            assert_close(out[b].transpose(0, 1), ref,
                         budget=budget(q_b, k_b, v_b, None, ref, causal=True, causal_alignment="bottom-right"),
                         what="the decoded rows vs the last rows of full causal attention", call=call,
                         inputs={f"q[{b}]": q_b, f"K[{b}] (all {length} tokens)": k_b, f"V[{b}] (all {length} tokens)": v_b},
                         cause=because("decode-differs", target=target))


@prop("cache-outside-invariance", family="serving",
      statement="cache rows outside [cache_leftpad, cache_seqlens), and the rows the append overwrites, set to NaN "
                "change nothing in the output",
      conventions=("decode",), cases=DECODE_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      after=("decode-equals-full-causal",),
      lesson=Lesson(unicode="decode(cache with rows ∉ [pad, len) = NaN) = decode(cache)   bitwise",
                    latex=r"\mathrm{decode}(\mathrm{cache}[r \notin [pad, len)] = \mathrm{NaN}) = \mathrm{decode}"
                          r"(\mathrm{cache})",
                    check="Calls the kernel twice with the same attended rows, once with stale values everywhere else "
                          "and once with NaN there (left padding, the rows to be appended to, the spare tail), and "
                          "requires the two outputs bitwise equal and finite.",
                    example="decode"))
def cache_outside_invariance(target, case):
    """out(cache) = out(cache with every row r < leftpad_b or r >= seqlens_b set to NaN), bitwise, with k and v
    appended at rows [seqlens_b, seqlens_b + S).

    Why: a cache is a pool: rows past a sequence's length hold another request's keys, a page's unfilled tail,
    or nothing at all; a kernel that reads them at all is wrong as soon as they are not zero (PyTorch #159247:
    FlexAttention's paged attention read the unfilled tail of the last page; flash-attn #2709). NaN makes any
    read visible, even one multiplied by a zero weight; where the header's probe finds that NaN in an unread row
    propagates through a zero weight (``unread-nan``: FlexAttention's eager path), those rows hold 100 instead, which
    only a read with nonzero weight shows. Catches: a tail read (cache_seqlens ignored), left padding attended, the old contents of the appended rows read before they are written, a read one row
    past the end.
    """
    q, k_full, v_full, lengths, pad = decode_inputs(case, leftpad="cache_leftpad" in target.accepts)
    S = q.shape[1]
    seqlens = lengths - S
    rows = torch.arange(k_full.shape[1])[None, :]  # [1, S_c]
    outside = (rows >= seqlens[:, None]) | (rows < (pad if pad is not None else 0 * lengths)[:, None])  # [B, S_c]
    new = [t[torch.arange(len(lengths))[:, None], (seqlens[:, None] + torch.arange(S)).long()] for t in (k_full, v_full)]
    stale, shown = unread_fill(target)  # NaN, or 100 where NaN propagates through a zero weight (probed: unread-nan)
    outs = []
    for fill in (None, stale):
        k_cache, v_cache = k_full.clone(), v_full.clone()
        if fill is not None:
            for t in (k_cache, v_cache):
                t[outside.to(t.device)] = fill  # [B, S_c, H, D] rows outside set to NaN (or 100)
        outs.append(target.decode(q, k_cache, v_cache, seqlens.to(q.device), *new,
                                  None if pad is None else pad.to(q.device), causal=True))
    clean, poisoned = outs
    differ = ~((clean == poisoned) | (clean.isnan() & poisoned.isnan()))  # [B, S, H, D]
    if differ.any() or not torch.isfinite(poisoned).all():
        b, i, h, _ = (differ | ~torch.isfinite(poisoned)).nonzero()[0].tolist()
        fail(f"{poisoned[b, i, h].tolist()} instead of {clean[b, i, h].tolist()}",
             what=f"out[{b}, {i}, {h}] with {shown} in the {int(outside[b].sum())} cache rows outside "
                  f"[{0 if pad is None else int(pad[b])}, {int(seqlens[b])}) of element {b}",
             expected="the output of the same call with stale finite values there, bitwise",
             call=f"{target.name}(q, k_cache, v_cache, k, v, cache_seqlens{', cache_leftpad' if pad is not None else ''}, "
                  f"causal=True)",
             cause=because("decode-reads-outside-cache"), got=poisoned[b].transpose(0, 1).to(F64), expected_tensor=clean[b].transpose(0, 1).to(F64),
             labels=(f"the output with {shown} outside the attended rows",
                     "the target's own output with stale finite values there"))


@prop("append-writes-exactly", family="serving",
      statement="appending k, v writes exactly cache rows [cache_seqlens, cache_seqlens + S_new) of each element, "
                "bitwise, and no other row",
      conventions=("decode",), cases=DECODE_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="cache'[b, r] = k_new[b, r - len_b] if len_b <= r < len_b + S else cache[b, r]",
                    latex=r"\mathrm{cache}'_{b,r} = k_{new,b,r-\ell_b}\ \text{if}\ \ell_b \le r < \ell_b + S,\ "
                          r"\mathrm{cache}_{b,r}\ \text{otherwise}",
                    check="Calls the kernel with k and v to append and compares both caches afterwards, row by row and "
                          "bitwise, with the caches it was given with exactly the appended rows replaced.",
                    example="decode"))
def append_writes_exactly(target, case):
    """k_cache' = k_cache with rows [seqlens_b, seqlens_b + S) of element b replaced by k_new[b] (v likewise), bitwise.

    Why: the next decode step reads what this one wrote; a row written one off, rounded through another dtype, or
    written into another element's slot corrupts every later token without any error (flash-attn #772, #638).
    Catches: an append off by one row, new rows written at the same position for every element, the cache
    overwritten beyond the new rows, k written into v. A kernel that does not write the cache (probed: the
    header's "writes the cache: no") is skipped.
    """
    if target.behaviour()["writes-cache"] != "yes":
        raise Unsupported(f"{target.name} does not write the cache (writes the cache: "
                          f"{target.behaviour()['writes-cache']})", total=True)
    q, k_full, v_full, lengths, _ = decode_inputs(case)
    S = q.shape[1]
    seqlens = lengths - S
    index = (torch.arange(len(lengths))[:, None], (seqlens[:, None] + torch.arange(S)).long())  # [B, S] rows
    k_new, v_new = k_full[index], v_full[index]  # [B, S, H, D]
    k_cache, v_cache = k_full.flip(1).clone(), v_full.flip(1).clone()  # other values than the ones appended
    expected = [t.clone() for t in (k_cache, v_cache)]
    expected[0][index], expected[1][index] = k_new, v_new
    target.decode(q, k_cache, v_cache, seqlens.to(q.device), k_new, v_new, causal=True)
    for name, got, want in (("k_cache", k_cache, expected[0]), ("v_cache", v_cache, expected[1])):
        wrong = (got != want).flatten(2).any(-1)  # [B, S_c] rows that differ
        if wrong.any():
            b, r = wrong.nonzero()[0].tolist()
            fail(f"{int(wrong.sum())} rows differ, the first row {r} of element {b}", what=f"{name} after the call",
                 expected=f"rows [{int(seqlens[b])}, {int(seqlens[b]) + S}) of element {b} replaced by the new rows, "
                          f"bitwise, and nothing else", call=f"{target.name}(q, k_cache, v_cache, k, v, cache_seqlens)",
                 cause=because("decode-append-elsewhere"), got=got[b].flatten(1).to(F64), expected_tensor=want[b].flatten(1).to(F64),
                 labels=(f"{name}[{b}] after the call, one row per cache row", "the cache with exactly the new rows"))
