"""Packed batches (the ``varlen`` convention, attn_spec.targets.serving_varlen): a batch of sequences of different
lengths laid end to end, ``cu_seqlens`` saying where each one starts, attended as if each were alone.

A case is read as a packed batch: its ``segments`` ((n_q, n_kv) of each sequence, drawn from 0 up) cut Q, K and V
along the sequence axis, H = the product of its batch dims heads (H_kv key/value heads where the case has
``kv_heads``, drawn where the kernel takes grouped heads), D = d_k (= d_v). Where the kernel takes ``causal``,
``window_size`` and ``softcap``, each property checks those calls too.
"""
from __future__ import annotations

import math

import torch

from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.cases import _values
from attn_spec.checking.tolerance import budget, softcap_budget
from attn_spec.errors import Uninformative
from attn_spec.failures import because
from attn_spec.reference import repeat_kv
from attn_spec.serving_reference import segment_mask, varlen_reference
from attn_spec.targets.serving_varlen import cu_seqlens

F64 = torch.float64
VARLEN_CASES = {"masks": ("none",), "batch": True, "same_width": True, "segments": True, "grouped": 0}
CAPS = (1.0, 5.0, 20.0, 50.0)  # softcap values (Gemma 2 caps attention logits at 50), one per case from its seed
AT_SCALE = {"segments": True}  # --shapes B,H,N,D: B sequences of up to N tokens (attn_spec.checking.shapes.packed_case)


def packed(q, k, v, segments):
    """The call's arguments for ``segments`` [(n_q, n_k), ...]: (q, k, v, cu_q, cu_k, max_q, max_k)."""
    cu_q, cu_k = (cu_seqlens((s[i] for s in segments), q.device) for i in (0, 1))
    return q, k, v, cu_q, cu_k, max(s[0] for s in segments), max(s[1] for s in segments)


def packed_inputs(case, segments=None):
    """The case as a packed batch: q [T_q, H, D], k, v [T_k, H, D] (the case's [H, T, D] tensors, sequence first)."""
    q, k, v, _ = case.tensors()  # [..., T, D]
    q, k, v = ((t.flatten(0, -3) if t.dim() > 2 else t[None]).transpose(0, 1).contiguous() for t in (q, k, v))  # [T, H, D]
    return packed(q, k, v, segments or case.segments or ((case.n_q, case.n_kv),))


def option_sets(target, case) -> list[dict]:
    """The calls to check: plain, then causal, a window drawn from the case's seed and a softcap where the kernel takes
    them (flash-attn's window_size (left, right), aligned bottom-right per sequence like causal; softcap c: scores
    c tanh(s / c) before the mask, causal too where it takes causal)."""
    calls = [{}]
    if target.takes("causal"):
        calls.append({"causal": True})
    if target.takes("window"):
        gen = torch.Generator().manual_seed(case.seed + 1)
        left, right = (int(x) for x in torch.randint(0, 4, (2,), generator=gen))
        calls.append({"window": (left, -1 if right == 3 else right)})
        if target.takes("causal"):
            calls.append({"window": (left, 0), "causal": True})
    if target.takes("softcap"):
        calls.append({"softcap": CAPS[case.seed % len(CAPS)], **({"causal": True} if target.takes("causal") else {})})
    return calls


def _words(options) -> str:
    return "".join(f", {'window_size' if key == 'window' else key}={value}" for key, value in options.items())


def _call_text(target, args, options) -> str:
    return (f"{target.name}(q, k, v, cu_seqlens_q={args[3].tolist()}, cu_seqlens_k={args[4].tolist()}, "
            f"{args[5]}, {args[6]}{_words(options)})")


def run(target, args, options):
    """One call: out [T_q, H, Dv]. A batch with an empty sequence (no queries or no keys) runs in a forked child,
    where a crash (the CPU flash op's SIGFPE on zero keys) is a failure of this property, not the end of the check."""
    lengths = (args[3][1:] - args[3][:-1]).tolist() + (args[4][1:] - args[4][:-1]).tolist()
    if min(lengths) > 0:
        return target.varlen(*args, **options)
    kind, value = target.forked(*args, **options)
    if kind != "value":
        outcome = {"crashes": f"the process dies ({value})", "hangs": "it does not return within 20 s"}
        fail(outcome.get(kind, f"it raises {value[0]}: {value[1]}" if kind == "raises" else str(value)),
             what="a packed batch with an empty sequence, run in a forked child", call=_call_text(target, args, options),
             expected="a result", cause=because("varlen-empty-sequences"))
    return value


def judge_segments(target, out, args, options, call: str) -> None:
    """Each sequence's rows of ``out`` [T_q, H, Dv] against float64 attention over that sequence alone (rows with no
    key to attend: 0), within the same-dtype budget of that sequence's own rows."""
    q, k, v, cu_q, cu_k = args[:5]
    ref, _ = varlen_reference(q, k, v, cu_q, cu_k, **options)  # [T_q, H, Dv]
    group = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        rows, keys = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        if rows.stop == rows.start:
            continue
        q_b = q[rows].transpose(0, 1)  # [H, n_q, D]
        k_b, v_b = (repeat_kv(t[keys], group, 1).transpose(0, 1) for t in (k, v))  # [H, n_k, D]
        allowed = segment_mask(q_b.shape[1], k_b.shape[1], causal=options.get("causal", False),
                               window=options.get("window"))  # [n_q, n_k]
        seen = allowed.any(dim=-1)  # [n_q]: rows with a key; the others must be 0
        ref_b = ref[rows].transpose(0, 1)  # [H, n_q, Dv]
        limit = 0.0
        if seen.any() and options.get("softcap"):
            limit = softcap_budget(q_b[:, seen], k_b, v_b, allowed[seen], ref_b[:, seen], options["softcap"])
        elif seen.any():
            limit = budget(q_b[:, seen], k_b, v_b, allowed[seen], ref_b[:, seen])
        assert_close(out[rows].transpose(0, 1), ref_b, budget=limit, call=call,
                     what=f"sequence {b} (n_q = {q_b.shape[1]}, n_k = {k_b.shape[1]}) vs attention over it alone",
                     cause=because("varlen-differs", target=target, options=options))


@prop("varlen-equals-per-sequence", family="serving",
      statement="each sequence of a packed batch gives what attention over that sequence alone gives, causal and the "
                "window aligned bottom-right per sequence",
      conventions=("varlen",), cases=VARLEN_CASES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="varlen(Q, K, V, cu_q, cu_k)[cu_q[b]:cu_q[b+1]] = attn(Q_b, K_b, V_b)   for every b",
                    latex=r"\mathrm{varlen}(Q, K, V)_{[cu^q_b, cu^q_{b+1})} = \mathrm{attn}(Q_b, K_b, V_b)\ \forall b",
                    check="Calls the kernel on the packed batch (plain, causal, with a window and a softcap where it "
                          "takes them) and compares each sequence's rows with float64 attention over that sequence "
                          "alone (grouped K/V heads repeated to the query heads), within the same-dtype budget; rows "
                          "with no key to attend must be 0.",
                    example="varlen"))
def varlen_equals_per_sequence(target, case):
    """out[cu_q[b] : cu_q[b + 1]] = softmax(cap(Q_b K_b^T / sqrt(d)) + M_b) V_b for every sequence b, with Q_b the rows
    [cu_q[b], cu_q[b + 1]) of Q (K_b, V_b likewise by cu_k) and M_b causal or windowed around key position
    i + n_k - n_q (bottom-right per sequence), cap(s) = c tanh(s / c) with a softcap c (else s), and K_b, V_b's
    head h // g read by query head h (g = H / H_kv).

    Why: packing removes the padding of a batch; it must not change what any sequence computes, or a model served
    packed answers differently from the same model run one request at a time. Catches: cu_seqlens ignored (one
    softmax over the whole packed batch, HunyuanVideo PR #310; a causal triangle over packed positions, pytorch
    #177378), causal aligned top-left per sequence, segment offsets read one row off, the softcap ignored, grouped
    K/V heads mapped to the wrong query heads (tiled, h % H_kv, where flash-attn reads h // g).
    """
    args = packed_inputs(case)
    if not args[0].shape[0]:
        raise Uninformative("no query in the batch")
    for options in option_sets(target, case):
        out = run(target, args, options)  # [T_q, H, Dv]
        judge_segments(target, out, args, options, _call_text(target, args, options))


def _perturbed(t, rows: slice, magnitude: float):
    """``t`` with rows ``rows`` changed (every entry moved by the case's magnitude)."""
    t = t.clone()
    t[rows] += magnitude
    return t


@prop("segment-isolation", family="serving",
      statement="changing one sequence of a packed batch (its queries, keys and values) leaves every other sequence's "
                "output bitwise unchanged",
      conventions=("varlen",), cases=VARLEN_CASES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="out'_b = out_b  bitwise  for b ≠ c,   where (Q, K, V)' differ from (Q, K, V) in sequence c",
                    latex=r"\mathrm{out}'_b = \mathrm{out}_b\ (b \ne c),\ (Q, K, V)'\ \text{differs only in sequence}\ c",
                    check="Calls the kernel twice (plain, and causal where it takes it), once with one sequence's "
                          "queries, keys and values moved, and requires every other sequence's rows bitwise equal.",
                    example="varlen"))
def segment_isolation(target, case):
    """varlen(Q', K', V')[rows of b] = varlen(Q, K, V)[rows of b] bitwise, for every b ≠ c, when Q', K', V' differ
    from Q, K, V only in the rows of sequence c.

    Why: no arithmetic may mix sequences, not even a key weighted by a tiny amount; a bitwise comparison sees a leak
    that a tolerance would forgive, and a kernel that reduces each sequence on its own (flash-attn with one split,
    as FA4's batch-invariance tests require) passes it exactly. Catches: attention bleeding across segments
    (HunyuanVideo PR #310: a fallback path ignored cu_seqlens), a segment reading one key of the next, a
    reduction shared across the batch.
    """
    args = packed_inputs(case)
    segments = case.segments or ((case.n_q, case.n_kv),)
    gen = torch.Generator().manual_seed(case.seed + 2)
    others = [b for b in range(len(segments)) if segments[b][0]]
    changed = [c for c in range(len(segments)) if sum(segments[c]) and any(b != c for b in others)]
    if not changed:
        raise Uninformative("no sequence to change with queries elsewhere to watch")
    c = changed[int(torch.randint(len(changed), (1,), generator=gen))]
    q, k, v, cu_q, cu_k = args[:5]
    rows, keys = slice(int(cu_q[c]), int(cu_q[c + 1])), slice(int(cu_k[c]), int(cu_k[c + 1]))
    moved = (_perturbed(q, rows, case.magnitude), _perturbed(k, keys, case.magnitude),
             _perturbed(v, keys, case.magnitude), *args[3:])
    watched = torch.ones(q.shape[0], dtype=torch.bool)
    watched[rows] = False  # [T_q]: the rows of every other sequence
    for options in [{}] + ([{"causal": True}] if target.takes("causal") else []):
        before, after = run(target, args, options), run(target, moved, options)  # [T_q, H, Dv]
        same = (before == after) | (before.isnan() & after.isnan())  # [T_q, H, Dv]
        if not same[watched.to(same.device)].all():
            t = int((~same.flatten(1).all(-1) & watched.to(same.device)).nonzero()[0])
            b = int((cu_q[1:] > t).nonzero()[0])
            fail(f"row {t} (sequence {b}) changed: {after[t, 0, :4].tolist()} instead of {before[t, 0, :4].tolist()}"
                 f"{' (head 0, first 4 entries)' if after.shape[-1] > 4 else ' (head 0)'}",
                 what=f"the output of the other sequences after changing sequence {c} ({segments[c][0]} queries, "
                      f"{segments[c][1]} keys)", expected="every row outside sequence c bitwise unchanged",
                 call=_call_text(target, args, options), cause=because("varlen-mixes-sequences"),
                 got=after[:, 0].to(F64), expected_tensor=before[:, 0].to(F64),
                 labels=(f"out[:, head 0] with sequence {c} changed", "out[:, head 0] before"))


def degenerate_batches(case) -> list[tuple]:
    """The case's sequences with an empty one (0, 0), one without keys and one without queries inserted where the
    seed says, and the same batch with every length cut to at most 1 (max_seqlen = 1)."""
    gen = torch.Generator().manual_seed(case.seed + 3)
    segments = list(case.segments or ((case.n_q, case.n_kv),))
    for empty in ((0, 0), (int(torch.randint(1, 4, (1,), generator=gen)), 0),
                  (0, int(torch.randint(1, 4, (1,), generator=gen)))):
        segments.insert(int(torch.randint(len(segments) + 1, (1,), generator=gen)), empty)
    return [tuple(segments), tuple((min(n_q, 1), min(n_k, 1)) for n_q, n_k in segments)]


@prop("varlen-degenerate-lengths", family="serving",
      statement="sequences with no queries, no keys or neither, and batches of max_seqlen = 1, run (no crash, no "
                "error) and give what each sequence alone gives: 0 for a query with no key",
      conventions=("varlen",), cases=VARLEN_CASES, at_scale=AT_SCALE, after=("varlen-equals-per-sequence",),
      lesson=Lesson(unicode="n_k(b) = 0  ⇒  out_b = 0;   n_q(b) = 0  ⇒  no rows;   max_seqlen = 1 works",
                    latex=r"n^k_b = 0 \Rightarrow \mathrm{out}_b = 0,\quad n^q_b = 0 \Rightarrow \text{no rows}",
                    check="Inserts the sequences (0, 0), (n, 0) and (0, n) into the case's batch, cuts every length "
                          "to 1 in a second batch, calls the kernel in a forked child (a crash is reported by its "
                          "signal) and compares each sequence with attention over it alone.",
                    example="varlen"))
def varlen_degenerate_lengths(target, case):
    """varlen(...) on a batch with sequences of lengths (0, 0), (n, 0), (0, n) gives the per-sequence result, the
    rows of a sequence with no key equal to 0; so does a batch whose longest sequence is 1 (max_seqlen = 1).

    Why: a serving batch has empty requests (FlashInfer's test_mlc_failed_case: indptr [0, 0, 9]) and decode steps
    of one token each; a kernel that divides by a length, or launches a grid of max_seqlen blocks, fails there
    only. Catches: NaN from a softmax over no keys, bogus shape errors at max_seqlen = 1 or with fewer tokens than
    sequences (flash-attn #1537, #1619), a crash on zero keys (the CPU flash op of torch 2.13 dies with SIGFPE,
    pytorch #141219): each call runs in a forked child, so a crash is a finding, not the end of the check.
    """
    gen = torch.Generator().manual_seed(case.seed + 4)
    H, D = max(1, math.prod(case.batch)), case.d_k
    H_kv = H // case.batch[-1] * case.kv_heads if case.kv_heads else H  # grouped: the last head dim's kv_heads
    for segments in degenerate_batches(case):
        T_q, T_k = (sum(s[i] for s in segments) for i in (0, 1))
        q, k, v = (_values(gen, (n, heads, D), case.values, case.magnitude).to(case.torch_dtype).to(case.device)
                   for n, heads in ((T_q, H), (T_k, H_kv), (T_k, H_kv)))  # [T, H, D], [T_k, H_kv, D]
        args = packed(q, k, v, segments)
        for options in [{}] + ([{"causal": True}] if target.takes("causal") else []):
            judge_segments(target, run(target, args, options), args, options, _call_text(target, args, options))
