"""Split-KV decoding (``num_splits``, flash_attn_with_kvcache's argument): splitting the keys is invisible.

A decode kernel may split each row's keys into chunks, attend each chunk on its own and merge the partial
results by their log-sum-exp (flash-decoding). How many splits it uses is a performance setting, never a
change of the output.
"""
from __future__ import annotations

from attn_spec.checking.assertions import assert_close
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.cases import Case
from attn_spec.checking.tolerance import budget
from attn_spec.errors import Unsupported
from attn_spec.properties.serving.decode import AT_SCALE, DECODE_CASES, decode_inputs, last_rows_reference

SPLITS = (1, 2, 3, 0)  # 0: the kernel's own choice (flash-attn's default); a case without num_splits tries each
# Each of SPLITS tried first, on a batch whose sequences (5 and 3 tokens) no split count divides evenly.
EXAMPLES = tuple(Case(batch=(2, 1), n_q=1, n_kv=5, d_k=2, d_v=2, values="normal", cache_lengths=(5, 3), num_splits=n,
                      seed=21) for n in SPLITS)


@prop("split-kv-agree", family="serving",
      statement="every num_splits (drawn; 1, 2, 3 and the kernel's own choice, 0, first) decodes the same rows: the "
                "last rows of full causal attention",
      conventions=("decode",), cases={**DECODE_CASES, "splits": True}, examples=EXAMPLES, at_scale=AT_SCALE,
      after=("decode-equals-full-causal",),
      lesson=Lesson(unicode="decode(…, num_splits = n) = causal(Q, K, V)_{L-S:L}  for every n",
                    latex=r"\mathrm{decode}(\ldots, n_{splits}=n) = \mathrm{causal}(Q,K,V)_{L-S:L}\ \forall n",
                    check="Decodes the cache with the case's num_splits (drawn; 1, 2, 3 and 0 first) and compares the "
                          "rows with the float64 last rows of causal attention, within the same-dtype budget.",
                    example="merge"))
def split_kv_agree(target, case):
    """out(num_splits = n) = softmax(q K^T / sqrt(d) + M) V for every n: the partial results of the key chunks
    (o_c, lse_c) merge as sum_c exp(lse_c - lse) o_c with lse = log sum_c exp(lse_c).

    Why: the number of splits is chosen per GPU and batch size, so a merge bug shows only on some machines or
    loads. Catches: partial outputs averaged instead of weighted by their LSE, a chunk's keys dropped at a
    split boundary, num_splits ignored where it is wrong for one setting only.
    """
    if "num_splits" not in target.accepts:
        raise Unsupported(f"{target.name} takes no num_splits argument", total=True)
    q, k_full, v_full, lengths, _ = decode_inputs(case)
    S = q.shape[1]
    for splits in (SPLITS if case.num_splits is None else (case.num_splits,)):
        out = target.decode(q, k_full.clone(), v_full.clone(), lengths.to(q.device), causal=True,
                            num_splits=splits)  # [B, S, H, D]: every token already in the cache
        for b, length in enumerate(lengths.tolist()):
            q_b, k_b, v_b, ref = last_rows_reference(q, k_full, v_full, b, 0, length)
            assert_close(out[b].transpose(0, 1), ref,
                         budget=budget(q_b, k_b, v_b, None, ref, causal=True, causal_alignment="bottom-right"),
                         what=f"the decoded rows with num_splits={splits} vs the last rows of full causal attention",
                         call=f"{target.name}(q, k_cache, v_cache, cache_seqlens, causal=True, num_splits={splits}), "
                              f"element {b}: {length} tokens, the last {S} decoded")
