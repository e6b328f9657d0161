"""The log-sum-exp a serving kernel returns beside its output (flash-attn's ``return_softmax_lse`` in decode,
``return_attn_probs`` / varlen_attn's ``return_aux`` in varlen, FlexAttention's ``return_lse`` through a varlen
kernel): merging, cascade attention and the backward pass all rest on it, so it is checked against its definition,
not only through a merge.

A case is read as the decode properties read it (attn_spec.properties.serving.decode) or as a packed batch (varlen), with
H_kv, the key/value heads, the case's own ``kv_heads`` (drawn where the kernel takes grouped heads, as for the
other decode and varlen properties). The LSE is compared in natural log: a kernel
the header found to return base 2 (FlashInfer's ``m + log2(d)``) has its LSE multiplied by ln 2 first.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch

from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.cases import Case
from attn_spec.checking.tolerance import lse_budget
from attn_spec.errors import Uninformative, Unsupported
from attn_spec.failures import because
from attn_spec.properties.serving.decode import decode_inputs
from attn_spec.properties.serving.varlen import AT_SCALE, _call_text, option_sets, packed, packed_inputs, run
from attn_spec.reference import causal_mask, repeat_kv
from attn_spec.serving_reference import decode_reference, segment_mask, varlen_reference

F64 = torch.float64
# grouped from batch dim 1 on: decode's B stays a batch dim, varlen reads every dim as heads either way
LSE_CASES = {"masks": ("none",), "batch": True, "same_width": True, "segments": True, "grouped": 1}
LARGE = 100.0  # the largest score of the stability call: exp overflows float32 past 88.7, float16 past 11.1
EXAMPLES = [Case(batch=(2, 4), kv_heads=2, n_q=3, n_kv=5, d_k=4, d_v=4, dtype="float32", values="normal", seed=1,
                 segments=((2, 3), (1, 0), (0, 2))),
            Case(batch=(1, 2), n_q=4, n_kv=6, d_k=8, d_v=8, dtype="float16", values="normal", magnitude=3.0, seed=2,
                 segments=((3, 2), (1, 4)))]


def ln_base(target) -> float:
    """What the returned LSE is multiplied by to be a natural log: ln 2 for base 2, else 1 (e, or a probe that found
    neither: judged as natural log, the convention of flash-attn, vLLM and FlexAttention)."""
    return math.log(2) if target.behaviour()["lse-base"] == "2" else 1.0


def empty_row_value(target) -> float | None:
    """The LSE a row with no key must have: the header's probed value where it is -inf, +inf or a number (flash-attn's
    +inf, the CPU flash op's 0: behaviours reported there, not punished here), -inf where the probe found NaN; None
    where the probe could not run (the kernel crashes or raises on zero keys): such rows are then not drawn."""
    found = target.behaviour()["lse-empty-row"]
    try:
        value = float(found.split()[0])
    except (ValueError, IndexError):
        return None
    return -math.inf if math.isnan(value) else value


def to_large_scores(q, scores):
    """q rescaled so that the largest score is LARGE (sign included: the score of largest magnitude becomes +LARGE),
    or None where the scores are all 0 or the rescaled q does not fit its dtype."""
    top = scores.flatten()[scores.abs().argmax()].item() if scores.numel() else 0.0
    if top == 0.0:
        return None
    scaled = (q.to(F64) * (LARGE / top)).to(q.dtype)
    return scaled if torch.isfinite(scaled).all() else None


def judge_rows(got, ref, q, k, allowed, *, target, what, call, lse_dtype, softcap=None):
    """got, ref [H, n_q] (natural log) of one sequence: rows with a key within the LSE budget of q [H, n_q, D] over k
    [H, n_k, D] under ``allowed`` [n_q, n_k]; rows with none exactly the empty row's probed value."""
    seen = allowed.any(dim=-1)  # [n_q]
    empty = empty_row_value(target)
    if (~seen).any() and empty is not None:
        wrong = got[:, ~seen] != empty  # [H, n_empty]
        if wrong.any():
            fail(f"{got[:, ~seen][wrong][0].item():g}", what=f"the LSE of a row with no key to attend ({what})",
                 expected=f"{empty:g}, the value the header's probe found for an empty row", call=call,
                 cause=because("lse-empty-row"),
                 got=got.to(F64), expected_tensor=ref)
    if seen.any():
        limit = lse_budget(q[:, seen], k, allowed[seen], ref[:, seen], lse_dtype, softcap=softcap)
        assert_close(got[:, seen].to(F64), ref[:, seen], budget=limit, call=call,
                     what=f"the returned LSE ({what}) vs logsumexp of the scaled scores over the allowed keys",
                     cause=because("lse-differs", target=target, got=got[:, seen], ref=ref[:, seen]), shown=(got.to(F64), ref),
                     labels=("the returned LSE (natural log), one row per head", "logsumexp of the scaled scores"),
                     inputs={"q (the call's, head first)": q, "K (the keys it may attend, head first)": k})


@prop("lse-equals-logsumexp", family="serving",
      statement="the LSE a kernel returns is logsumexp of the scaled scores over the keys each query may attend, in "
                "the base the header found (e or 2), one value per batch element, head and query ([B, H, S_new] in "
                "decode, [H, T_q] in varlen)",
      conventions=("decode", "varlen"), cases=LSE_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      after=("decode-equals-full-causal", "varlen-equals-per-sequence"),
      lesson=Lesson(unicode="lse_i = log Σ_{j allowed} exp(scale · q_i · k_j)   (base 2: / ln 2)",
                    latex=r"\mathrm{lse}_i = \log \sum_{j \in A_i} e^{\mathrm{scale}\, q_i \cdot k_j}",
                    check="Asks the kernel for its LSE on decode calls (appended and not, causal and not, with an "
                          "element of no key where the kernel survives one) or packed batches (plain, causal, "
                          "windowed, with grouped K/V heads), then once more with the scores scaled up to 100, and "
                          "compares it with the float64 logsumexp over the allowed keys within the same-dtype budget; "
                          "a row with no key must have the header's probed empty-row value.",
                    example="merge"))
def lse_equals_logsumexp(target, case):
    """The returned LSE of query i is lse_i = log sum_{j in A_i} exp(s_ij), s_ij = scale * q_i . k_j, A_i the keys
    query i may attend (its element's cache rows up to cache_seqlens + S_new, causal bottom-right; its own segment,
    causal or windowed per sequence), in base e (base 2: lse / ln 2); a row with no key: -inf, or the value the
    header's probe found.

    Why: the LSE is what the kernel hands on: merging split-KV chunks, cascade attention over a shared prefix and
    ring attention combine partial outputs with weights exp(lse_i - lse), and flash-attention's backward recomputes
    the weights as exp(s - lse). An LSE that is wrong while the output is right passes every output check and
    corrupts whatever uses it. Catches: the LSE of unscaled scores (scale forgotten outside the softmax), the LSE
    taken before the causal mask or over all keys, exp without the row max subtracted (inf once a score passes 88.7
    in float32), the LSE returned [B, S_new, H] or viewed [H, T_q] from [T_q, H] memory.
    """
    if target.behaviour()["lse-base"] == "not returned" or target.behaviour()["lse-base"].startswith("n/a"):
        raise Unsupported(f"{target.name} returns no LSE (LSE: {target.behaviour()['lse-base']})", total=True)
    if target.convention == "decode":
        decode_lse(target, case)
    else:
        varlen_lse(target, case)


def decode_lse(target, case):
    """Three decode calls: S_new appended, causal; all in the cache, not causal (one more element with no key where
    the kernel survives zero keys); appended, not causal, the scores scaled up to LARGE."""
    case = replace(case, n_q=max(case.n_q, 1), n_kv=max(case.n_kv, 1))  # a packed case's sums may be 0
    q, k_full, v_full, lengths, _ = decode_inputs(case)  # [B, S, H, D], [B, n + 2, H, D], [B]
    S, group = q.shape[1], q.shape[2] // k_full.shape[2]  # k_full [B, n + 2, H_kv, D]: grouped where the case is
    decode_call(target, q, k_full, v_full, lengths - S, appended=True, causal=True)
    if empty_row_value(target) is not None:  # one more element, with no key, beside the others
        decode_call(target, *(torch.cat([t, t[:1]]) for t in (q, k_full, v_full)),
                    torch.cat([lengths, lengths.new_zeros(1)]), appended=False, causal=False)
    else:
        decode_call(target, q, k_full, v_full, lengths, appended=False, causal=False)
    scores = torch.cat([torch.einsum("shd,lhd->hsl", q[b].to(F64), repeat_kv(k_full[b, :n].to(F64), group, 1))
                        .flatten() for b, n in enumerate(lengths.tolist())]) / math.sqrt(q.shape[-1])  # attended
    large = to_large_scores(q, scores)
    if large is not None:
        decode_call(target, large, k_full, v_full, lengths - S, appended=True, causal=False, label="scores up to 100")


def decode_call(target, q, k_full, v_full, seqlens, *, appended, causal, label=""):
    """One decode call asking for the LSE, judged element by element; k_full, v_full [B, S_c, H_kv, D] hold every
    element's tokens (the last S_new appended with k and v where ``appended``)."""
    S, H = q.shape[1], q.shape[2]
    rows = (torch.arange(len(seqlens))[:, None], seqlens[:, None].long() + torch.arange(S))  # [B, S]: the new rows
    new = [k_full[rows], v_full[rows]] if appended else [None, None]  # [B, S, H_kv, D]
    words = ", ".join(w for w in ("k, v appended" if appended else "", "causal=True" if causal else "", label) if w)
    call = f"{target.name}(q, k_cache, v_cache, {'k, v, ' if appended else ''}cache_seqlens={seqlens.tolist()}, " \
           f"{'causal=True, ' if causal else ''}return_softmax_lse=True)"
    _, lse = target.decode(q, k_full.clone(), v_full.clone(), seqlens.to(q.device), *new, causal=causal, lse=True)
    expected = (q.shape[0], H, S)
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != expected:
        fail(f"{list(lse.shape) if isinstance(lse, torch.Tensor) else type(lse).__name__}", what="the returned LSE",
             expected=f"a tensor of shape {list(expected)}: [B, H, S_new], as flash_attn_with_kvcache returns it",
             call=call, cause=because("lse-layout"))
    _, ref, _, _ = decode_reference(q, k_full, v_full, seqlens, *new, causal=causal)  # [B, H, S], natural log
    got = lse.to("cpu", F64) * ln_base(target)  # [B, H, S]
    ends = seqlens + (S if appended else 0)
    for b, L in enumerate(ends.tolist()):
        keys = repeat_kv(k_full[b, :L].to("cpu"), H // k_full.shape[2], 1).transpose(0, 1)  # [H, L, D]
        allowed = torch.ones(S, L, dtype=torch.bool) if not causal else \
            causal_mask(S, L, alignment="bottom-right")  # [S, L]
        judge_rows(got[b], ref[b], q[b].to("cpu").transpose(0, 1), keys, allowed, target=target, call=call,
                   what=f"element {b}: {L} keys, {S} queries{', ' + words if words else ''}", lse_dtype=lse.dtype)


def varlen_lse(target, case):
    """The packed batch with each option set varlen-equals-per-sequence uses (plain, causal, a window), then plain
    with the scores scaled up to LARGE; sequences with no query or no key left out where the kernel does not
    survive zero keys."""
    q, k, v, cu_q, cu_k, *_ = packed_inputs(case)  # [T_q, H, D], [T_k, H, D]
    segments = list(zip(cu_q.diff().tolist(), cu_k.diff().tolist()))
    if empty_row_value(target) is None:
        kept = [b for b, s in enumerate(segments) if min(s) > 0]
        if not kept:
            raise Uninformative("every sequence has no query or no key, and the kernel does not survive zero keys")
        pick = lambda cu, t: torch.cat([t[int(cu[b]):int(cu[b + 1])] for b in kept])  # noqa: E731
        q, k, v, segments = pick(cu_q, q), pick(cu_k, k), pick(cu_k, v), [segments[b] for b in kept]
    args = packed(q, k, v, segments)
    if not q.shape[0]:
        raise Uninformative("no query in the batch")
    for options in option_sets(target, case):
        varlen_call(target, args, options)
    scores = torch.cat([_segment_scores(args, b).flatten() for b in range(len(segments))])
    large = to_large_scores(q, scores)
    if large is not None:
        varlen_call(target, (large, *args[1:]), {}, label="scores up to 100")


def _segment_scores(args, b):
    """The scaled float64 scores [H, n_q, n_k] of sequence b."""
    q, k, _, cu_q, cu_k = args[:5]
    q_b = q[int(cu_q[b]):int(cu_q[b + 1])].to(F64).transpose(0, 1)  # [H, n_q, D]
    k_b = repeat_kv(k[int(cu_k[b]):int(cu_k[b + 1])].to(F64), q.shape[1] // k.shape[1], 1).transpose(0, 1)
    return q_b @ k_b.transpose(1, 2) / math.sqrt(q.shape[-1])


def varlen_call(target, args, options, label=""):
    """One packed call asking for the LSE ([H, T_q] once read back), judged sequence by sequence."""
    q, k, v, cu_q, cu_k = args[:5]
    call = _call_text(target, args, options)[:-1] + ", with its LSE)"
    _, lse = run(target, args, {**options, "lse": True})  # [H, T_q]
    _, ref = varlen_reference(q, k, v, cu_q, cu_k, **options)  # [H, T_q], natural log
    got = lse.to("cpu", F64) * ln_base(target)
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start:
            continue
        k_b = repeat_kv(k[keys].to("cpu"), q.shape[1] // k.shape[1], 1).transpose(0, 1)  # [H, n_k, D]
        allowed = segment_mask(rows.stop - rows.start, k_b.shape[1], causal=options.get("causal", False),
                               window=options.get("window"))  # [n_q, n_k]
        words = ", ".join(w for w in (", ".join(f"{key}={value}" for key, value in options.items()), label) if w)
        judge_rows(got[:, rows], ref[:, rows], q[rows].to("cpu").transpose(0, 1), k_b, allowed, target=target,
                   call=call, lse_dtype=lse.dtype, softcap=options.get("softcap"),
                   what=f"sequence {b}: {rows.stop - rows.start} queries over {k_b.shape[1]} keys"
                        f"{', ' + words if words else ''}")
