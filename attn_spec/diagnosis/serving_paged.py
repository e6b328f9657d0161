"""Mistake models of paged decode kernels (the decode convention with ``block_table``: ``paged=True``), registered
after attn_spec.diagnosis.serving's own and found the same way: each is the correct float64 kernel with the bug
put in, replayed on every call a failing property made.

Each model takes a recorded call, paged or not: a contiguous cache [B, S_c, H_kv, D] is read as a pool of B pages of
S_c rows, element b's one page being page b (its block table [[0], [1], ...]), which is what a paged kernel called
without a block table does.
"""
from __future__ import annotations

import torch

from attn_spec.diagnosis.model import mistake
from attn_spec.diagnosis.serving_correct import correct_decode, decoded, element
from attn_spec.reference import repeat_kv
from attn_spec.serving_reference import decode_reference


def paged_mistake(id: str, **words):
    """A decode model of paged caches: a catalog entry of level decode that sees the block table itself."""
    return mistake(id, level="decode", family="serving", paged=True, **words)


def _as_paged(c) -> dict:
    """The call with a block table: a contiguous cache is a pool of one page per element."""
    if c.get("block_table") is not None:
        return c
    return {**c, "block_table": torch.arange(c["k_cache"].shape[0], dtype=torch.int32)[:, None]}  # [B, 1]


def _ends(c):
    """Each element's number of keys after the append, [B]."""
    return torch.as_tensor(c["cache_seqlens"]).cpu() + (0 if c["k"] is None else c["q"].shape[1])


def _read(c, after, lengths, table) -> dict:
    """The caches of ``after`` (the append done), read as ``lengths`` keys through ``table``."""
    out, _, _, _ = decode_reference(c["q"], after["k_after"], after["v_after"], lengths, None, None, c["cache_leftpad"],
                                    causal=c["causal"], scale=c["scale"], block_table=table)
    return {**after, "out": out}


@paged_mistake("page-tail-read",
               sentence="the last page is read whole: the rows of its unfilled tail, past cache_seqlens + S_new, are "
                        "attended as keys (PyTorch #159247)",
               fix="attend only rows [0, cache_seqlens + S_new) of each element: mask (or slice) the last page at the "
                   "sequence's length, not at the page's end",
               caught_by=("paged-outside-invariance", "paged-equals-contiguous", "cache-outside-invariance",
                          "decode-equals-full-causal"))
def page_tail_read(c):
    c = _as_paged(c)
    P, table = c["k_cache"].shape[1], c["block_table"]
    whole = (_ends(c) + P - 1) // P * P  # [B]: the length rounded up to whole pages
    return _read(c, correct_decode(c), whole, table)


@paged_mistake("paged-physical-order",
               sentence="each element's pages are read in the pool's (physical) order, not the block table's: the "
                        "rows are right, their positions scrambled",
               fix="gather page block_table[b, j] for logical page j, in that order (a boolean mask over the pool "
                   "returns pages sorted by their index: index with the table instead)",
               caught_by=("paged-equals-contiguous", "paged-outside-invariance"))
def paged_physical_order(c):
    c = _as_paged(c)
    P, table = c["k_cache"].shape[1], c["block_table"].clone()
    for b, end in enumerate(_ends(c).tolist()):
        n = -(-end // P)  # the pages element b reaches
        table[b, :n] = table[b, :n].sort().values
    return _read(c, correct_decode(c), _ends(c), table)


@paged_mistake("paged-append-first-page",
               sentence="every new row is written into the page of the first one, at offset (cache_seqlens + t) % "
                        "page: an append that crosses a page boundary wraps around inside that page",
               fix="find each new row's page on its own: block_table[b, (cache_seqlens_b + t) // page]",
               caught_by=("paged-append-writes-exactly", "paged-equals-contiguous", "paged-outside-invariance"))
def paged_append_first_page(c):
    c = _as_paged(c)
    if c["k"] is None:
        return correct_decode(c)
    P, table = c["k_cache"].shape[1], c["block_table"]
    k_pool, v_pool = (c[name].to(torch.float64).clone() for name in ("k_cache", "v_cache"))
    for b, start in enumerate(torch.as_tensor(c["cache_seqlens"]).tolist()):
        page = int(table[b, start // P])
        for t in range(c["q"].shape[1]):
            k_pool[page, (start + t) % P], v_pool[page, (start + t) % P] = c["k"][b, t], c["v"][b, t]
    return _read(c, {"k_after": k_pool, "v_after": v_pool}, _ends(c), table)


@paged_mistake("block-table-overrun",
               sentence="the length is not checked against the block table: the table is read as one flat array, so a "
                        "sequence longer than its row reads (and writes) the next element's pages (flash-attn #2709)",
               fix="raise when cache_seqlens + S_new exceeds max_blocks * page (flash-attn PR #2711)",
               caught_by=("paged-capacity-contract",))
def block_table_overrun(c):
    c = _as_paged(c)
    P, table = c["k_cache"].shape[1], c["block_table"]
    flat, width = table.flatten(), table.shape[1]
    k_pool, v_pool, outs = c["k_cache"], c["v_cache"], []
    for b, end in enumerate(_ends(c).tolist()):  # one element after the other, as a kernel over the batch does
        row = flat[b * width:b * width + -(-end // P)]  # [pages reached]: past the row, the next element's
        if row.numel() < -(-end // P):
            raise IndexError("the flat block table ends before the sequence does")
        got = correct_decode({**element(c, b), "k_cache": k_pool, "v_cache": v_pool, "block_table": row[None]})
        outs.append(got["out"])
        k_pool, v_pool = got["k_after"], got["v_after"]
    return decoded(torch.cat(outs), None, k_pool, v_pool)


@paged_mistake("masked-slots-times-zero",
               sentence="the scores are materialised over the whole pool, the slots outside each sequence given weight "
                        "0, and every slot's value multiplied in: NaN or inf in a slot no sequence attends (a page's "
                        "unfilled tail, a free page) gives NaN (0 * NaN = NaN); finite stale values give the right "
                        "answer",
               fix="gather (or slice) the slots a sequence attends before the product with V, or skip the masked "
                   "blocks (FlexAttention's compiled kernels skip whole blocks; its eager path multiplies them all)",
               caught_by=("paged-outside-invariance", "cache-outside-invariance"))
def masked_slots_times_zero(c):
    c = _as_paged(c)
    right = correct_decode(c)
    values = right["v_after"]  # [num_blocks, page, H_kv, D]: the whole pool, appended rows included
    group = c["q"].shape[2] // values.shape[2]
    poison = 0 * repeat_kv(values.sum((0, 1)), group, 0)  # [H, D]: NaN where any slot's value is NaN
    return {**right, "out": right["out"] + poison}
