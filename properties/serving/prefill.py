"""Chunked prefill (the ``decode`` convention with S_new > 1): a prompt appended in chunks, each chunk one call,
must give what one call over the whole prompt gives, in a contiguous cache and, for a kernel that takes a block
table, in a paged one. A case is read as decode_inputs reads it (properties/serving/decode.py).
"""
from __future__ import annotations

import torch

from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.tolerance import budget
from attn_spec.errors import Unsupported
from attn_spec.properties.serving.decode import AT_SCALE, EXAMPLES, decode_inputs, last_rows_reference
from attn_spec.properties.serving.paged import PAGED_CASES, page_layout, to_pages
from attn_spec.targets.serving_decode import page_granule
from attn_spec.failures import because

F64 = torch.float64


def chunk_sizes(case, total: int) -> list[int]:
    """A random split of ``total`` new tokens into chunks (two or more where total > 1), drawn from the case's seed."""
    gen = torch.Generator().manual_seed(case.seed + 4)
    cuts = sorted(set(torch.randperm(max(total - 1, 1), generator=gen)[:max(1, total // 2)].add(1).tolist()) - {total})
    edges = [0, *cuts, total] if total > 1 else [0, total]
    return [b - a for a, b in zip(edges, edges[1:])]


@prop("chunked-prefill-equals-one-shot", family="serving",
      statement="appending S_new tokens in chunks, one call each (the cache growing between calls), gives the "
                "rows and the cache of one call over all S_new tokens",
      conventions=("decode",), cases=PAGED_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      after=("decode-equals-full-causal",),
      lesson=Lesson(unicode="concat_c decode(q_c, cache + chunks_{<c}) = decode(q, cache) = causal(Q, K, V)_{L-S:L}",
                    latex=r"\mathrm{concat}_c\,\mathrm{decode}(q_c, \mathrm{cache} + k_{<c}) = "
                          r"\mathrm{causal}(Q, K, V)_{L-S:L}",
                    check="Appends each element's last S_new tokens in a drawn split of chunks, calling the kernel "
                          "once per chunk with cache_seqlens advanced by the chunks before it (in a contiguous cache, and "
                          "in a paged one where the kernel takes block_table); compares the rows with the float64 "
                          "last rows of causal attention (within the same-dtype budget), and the caches afterwards "
                          "with those of one call appending every token, bitwise.",
                    example="decode"))
def chunked_prefill_equals_one_shot(target, case):
    """out_c = decode(q[:, a_c:b_c], cache, k[:, a_c:b_c], cache_seqlens = L - S + a_c) for chunks [a_c, b_c) of the
    S new tokens; concat_c out_c = the last S rows of causal attention over the L_b tokens, and the cache after the
    last chunk = the cache after one call appending all S, bitwise.

    Why: serving stacks split a long prompt into chunks so that decode steps of other requests run between them
    (chunked prefill); each chunk is a decode call with S_new > 1 whose queries must see every earlier chunk and,
    causally, their own. Catches: a chunk that ignores the chunks before it or the mask inside itself, a kernel
    that keeps its own count of tokens instead of reading cache_seqlens, an append that depends on how the
    tokens were split (nano-vllm PR #213, kekzl/imp PRs #114, #117). A kernel that does not write the cache
    (the header's "writes the cache: no") is skipped.
    """
    if target.behaviour()["writes-cache"] != "yes":
        raise Unsupported(f"{target.name} does not write the cache: it cannot be fed chunk by chunk", total=True)
    q, k_full, v_full, lengths, _ = decode_inputs(case)
    S = q.shape[1]
    start = lengths - S  # [B]: rows already cached before the prompt's chunks
    index = (torch.arange(len(lengths))[:, None], (start[:, None] + torch.arange(S)).long())  # [B, S] rows
    k_new, v_new, sizes = k_full[index], v_full[index], chunk_sizes(case, S)  # [B, S, H, D]
    for layout, table, caches in _layouts(target, case, k_full, v_full):
        one_shot, chunked = [t.clone() for t in caches], [t.clone() for t in caches]
        _prefill(target, q, one_shot, start, k_new, v_new, [S], table)
        out = _prefill(target, q, chunked, start, k_new, v_new, sizes, table)  # [B, S, H, D]
        paged = ", block_table" if table is not None else ""
        call = (f"{target.name}(q_c, k_cache, v_cache, k_c, v_c, cache_seqlens{paged}, causal=True), chunks {sizes}, "
                f"{layout}")
        for b, length in enumerate(lengths.tolist()):
            q_b, k_b, v_b, ref = last_rows_reference(q, k_full, v_full, b, 0, length)
            assert_close(out[b].transpose(0, 1), ref,
                         budget=budget(q_b, k_b, v_b, None, ref, causal=True, causal_alignment="bottom-right"),
                         what=f"element {b}'s rows, prefilled in chunks of {sizes}, vs causal attention's last rows",
                         call=call)
        for name, got, want in zip(("k_cache", "v_cache"), chunked, one_shot):
            wrong = (got != want).flatten(2).any(-1)  # [B, S_c] (or [num_blocks, page]) rows that differ
            if wrong.any():
                i, r = wrong.nonzero()[0].tolist()
                fail(f"{int(wrong.sum())} rows differ, the first row {r} of {'page' if paged else 'element'} {i}",
                     what=f"{name} after the chunks", expected=f"the {name} of one call appending all {S} tokens, bitwise",
                     call=call, cause=because("prefill-depends-on-chunks"),
                     got=got[i].flatten(1).to(F64), expected_tensor=want[i].flatten(1).to(F64),
                     labels=(f"{name}[{i}] after the chunks", f"{name}[{i}] after one call"))


def _layouts(target, case, k_full, v_full):
    """(name, block_table or None, (k_cache, v_cache)): the contiguous cache, and a paged copy of it where the kernel
    takes a block table (the case's page size, the order drawn as properties/serving/paged.py draws it)."""
    yield "contiguous", None, (k_full, v_full)
    if "block_table" in target.accepts:
        P, table, num_blocks = page_layout(case, k_full.shape[1], granule=page_granule(target))
        empty = torch.zeros(num_blocks, P, *k_full.shape[2:], dtype=k_full.dtype)  # [num_blocks, P, H, D]
        pools = tuple(to_pages(t.cpu(), P, table, empty).to(t.device) for t in (k_full, v_full))
        yield f"paged (pages of {P})", table.to(k_full.device), pools


def _prefill(target, q, caches, start, k_new, v_new, sizes, table):
    """q's rows decoded one chunk of ``sizes`` per call, each chunk appended in place after the ones before it."""
    outs, done = [], 0
    for size in sizes:
        part = slice(done, done + size)
        outs.append(target.decode(q[:, part], *caches, (start + done).to(q.device), k_new[:, part], v_new[:, part],
                                  causal=True, block_table=table))  # [B, size, H, D]
        done += size
    return torch.cat(outs, dim=1)
