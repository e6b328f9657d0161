"""Paged KV caches (the ``decode`` convention with ``block_table``): what a kernel that reads its cache through a
block table must compute, whatever page size and page order the pool has.

A case is read as decode_inputs reads it (properties/serving/decode.py): B elements, each a sequence of L_b tokens, S_new
of them new. The pool is paged: the case's drawn page size P (``page_size``: page 1, non-divisors and pages longer
than the sequence among them; a multiple of the smallest page size the kernel takes where it refuses page 1, as
flash-attn 2 takes multiples of 256 only), a block table of max_blocks = ceil((n_kv + 2) / P) + 1 columns (so some
listed pages are past every sequence's end), and a pool of B * max_blocks + ``spare_pages`` pages (spare pages no
element lists), the table a random permutation of the pool drawn from the seed. Row r of element b lies in page
block_table[b, r // P], offset r % P.
"""
from __future__ import annotations

import math

import torch

from attn_spec.checking.assertions import assert_close, fail
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.checking.cases import Case, _values
from attn_spec.checking.tolerance import budget
from attn_spec.errors import TargetRaised, Unsupported
from attn_spec.properties.serving.decode import AT_SCALE, DECODE_CASES, decode_inputs, last_rows_reference
from attn_spec.targets.serving_decode import page_granule, unread_fill
from attn_spec.failures import because

F64 = torch.float64


def _paged_only(target):
    if "block_table" not in target.accepts:
        raise Unsupported(f"{target.name} takes no block_table (its caches are contiguous only)", total=True)


# The hand-picked edges every paged property tries first (each also drawn): page 1; a page of 3, which divides no
# length here; a page longer than every sequence; spare pages in the pool; lengths that differ across the batch;
# several queries (so the order of the keys matters under causal) and seeds whose tables are out of physical order.
EXAMPLES = (Case(batch=(2, 1), n_q=3, n_kv=5, d_k=1, d_v=1, cache_lengths=(5, 4), page_size=1, spare_pages=1, seed=11),
            Case(batch=(2, 1), n_q=2, n_kv=7, d_k=2, d_v=2, cache_lengths=(7, 4), page_size=3, spare_pages=2, seed=12),
            Case(batch=(3, 1), n_q=1, n_kv=4, d_k=2, d_v=2, cache_lengths=(4, 1, 2), page_size=9, spare_pages=3,
                 seed=13))
PAGED_CASES = {**DECODE_CASES, "pages": True}
DEFAULT_PAGE = 16  # a case without a page size (one made by hand, or --shapes without page=P): vLLM's default block


def page_size(case, granule=1) -> int:
    """The case's page size (or DEFAULT_PAGE), rounded up to a multiple of ``granule``, the smallest page size the
    kernel takes (the header's "page sizes")."""
    return -(-(case.page_size or DEFAULT_PAGE) // granule) * granule


def page_layout(case, n_rows, *, granule=1, extra=1):
    """(page size P, block_table int32 [B, max_blocks], num_blocks) for n_rows rows: P the case's (page_size),
    max_blocks = ceil(n_rows / P) + ``extra`` columns, the case's spare pages in the pool; the table a permutation
    drawn from the case's seed."""
    gen = torch.Generator().manual_seed(case.seed + 1)
    P = page_size(case, granule)
    max_blocks = math.ceil(n_rows / P) + extra
    num_blocks = case.batch[0] * max_blocks + case.spare_pages
    table = torch.randperm(num_blocks, generator=gen)[:case.batch[0] * max_blocks]  # distinct pages, scrambled
    return P, table.view(case.batch[0], max_blocks).to(torch.int32), num_blocks


def to_pages(full, P, block_table, pool):
    """``pool`` [num_blocks, P, H, D] (a copy) with the rows of ``full`` [B, n, H, D] written at their slots."""
    B, n = full.shape[:2]
    pool = pool.clone()
    rows = torch.arange(n)  # [n]
    pages = block_table[:, rows // P].long()  # [B, n]
    pool[pages, (rows % P)[None, :].expand(B, n)] = full  # [B, n, H, D] written at their slots
    return pool


def slots(block_table, P, lo, hi):
    """The pool slots (page, offset) of rows [lo_b, hi_b) of each element b."""
    found = []
    for b in range(block_table.shape[0]):
        rows = torch.arange(int(lo[b]), int(hi[b]))
        found += [(int(block_table[b, r // P]), int(r % P)) for r in rows]
    return found


def paged_case(target, case):
    """(q, k_full, v_full, lengths, P, block_table, k_pool, v_pool): the sequences of decode_inputs, paged, the
    pool's other slots stale values of other sequences."""
    q, k_full, v_full, lengths, _ = decode_inputs(case)
    P, table, num_blocks = page_layout(case, k_full.shape[1], granule=page_granule(target))
    gen = torch.Generator().manual_seed(case.seed + 2)
    stale = lambda: _values(gen, (num_blocks, P, *k_full.shape[2:]), case.values, case.magnitude)  # noqa: E731
    pools = [to_pages(t.cpu(), P, table, stale().to(t.dtype)).to(t.device) for t in (k_full, v_full)]
    return q, k_full, v_full, lengths, P, table.to(q.device), *pools


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _new_rows(full, seqlens, S):
    return full[torch.arange(len(seqlens))[:, None], (seqlens[:, None] + torch.arange(S)).long()]  # [B, S, H, D]


@prop("paged-equals-contiguous", family="serving",
      statement="decoding from a paged cache (any page size, pages in any order, spare pages in the pool and the "
                "table) gives the last S_new rows of full causal attention, as the contiguous cache does",
      conventions=("decode",), cases=PAGED_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="decode(q, pool, block_table) = causal(Q, K, V)_{L-S:L},  K_r = pool[table[b, r // P], r % P]",
                    latex=r"\mathrm{decode}(q, \mathrm{pool}, T) = \mathrm{causal}(Q, K, V)_{L-S:L},\ "
                          r"K_r = \mathrm{pool}_{T_{b, \lfloor r/P \rfloor}, r \bmod P}",
                    check="Pages each element's sequence into a scrambled pool (a drawn page size, spare pages), calls "
                          "the kernel with the block table twice (the last S_new tokens appended, then already in the "
                          "cache), and compares each element with the float64 last rows of causal attention over its "
                          "tokens, within the same-dtype budget.",
                    example="decode"))
def paged_equals_contiguous(target, case):
    """decode(q, pool, block_table) = decode(q, cache) where cache[b, r] = pool[block_table[b, r // P], r % P]:
    the block table is only an address map, so the output is the last S rows of causal attention over L_b tokens.

    Why: serving stacks page their caches (vLLM, FlashInfer, flash-attn's block_table) and scramble the pages
    as requests come and go; the kernel must read them in the table's order, whatever the page size. Catches:
    pages read in physical order instead of the table's, a block table indexed off by one, a page size that
    does not divide the length mishandled, page size 1, the last page's tail read, appended rows written into
    the wrong page.
    """
    _paged_only(target)
    q, k_full, v_full, lengths, P, table, k_pool, v_pool = paged_case(target, case)
    S = q.shape[1]
    for appended in (True, False):
        seqlens = lengths - S if appended else lengths
        new = [_new_rows(t, seqlens, S) for t in (k_full, v_full)] if appended else [None, None]
        out = target.decode(q, k_pool.clone(), v_pool.clone(), seqlens.to(q.device), *new, causal=True,
                            block_table=table)  # [B, S, H, D]
        for b, length in enumerate(lengths.tolist()):
            q_b, k_b, v_b, ref = last_rows_reference(q, k_full, v_full, b, 0, length)
            call = (f"{target.name}(q, k_pages, v_pages{', k, v' if appended else ''}, cache_seqlens, block_table, "
                    f"causal=True), element {b}: {length} tokens in pages of {P}, {S} of them new"
                    f"{' (appended)' if appended else ' (in the cache)'}")
            assert_close(out[b].transpose(0, 1), ref,
                         budget=budget(q_b, k_b, v_b, None, ref, causal=True, causal_alignment="bottom-right"),
                         what="the decoded rows from the paged cache vs the last rows of full causal attention",
                         call=call)


@prop("paged-outside-invariance", family="serving",
      statement="pool slots a sequence does not own (the last page's tail past its length, the pages the block "
                "table lists past it, the pool's spare pages) set to NaN change nothing in the output",
      conventions=("decode",), cases=PAGED_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      after=("paged-equals-contiguous",),
      lesson=Lesson(unicode="decode(pool with slots ∉ rows(table, [0, len)) = NaN) = decode(pool)   bitwise",
                    latex=r"\mathrm{decode}(\mathrm{pool}[s \notin \mathrm{rows}(T, [0, \ell))] = \mathrm{NaN}) = "
                          r"\mathrm{decode}(\mathrm{pool})",
                    check="Calls the kernel twice on the same paged sequences, once with stale values in every pool "
                          "slot no element attends and once with NaN there (the last page's tail, the rows to be "
                          "appended to, the table's pages past the end, the spare pages), and requires the two "
                          "outputs bitwise equal and finite.",
                    example="decode"))
def paged_outside_invariance(target, case):
    """out(pool) = out(pool with every slot outside {(table[b, r // P], r % P) : r < seqlens_b} set to NaN), bitwise,
    with k and v appended at rows [seqlens_b, seqlens_b + S).

    Why: a page is filled a row at a time, so the last page of a sequence has an unfilled tail, and the pool holds
    other requests' pages and pages nobody owns; a kernel that reads them is wrong as soon as they hold anything
    (PyTorch #159247: FlexAttention's paged attention attended the unfilled tail of the last page, error 0.76;
    vLLM PR #27753: garbage from partial blocks). NaN makes any read visible, even one weighted by zero (100 where
    the header's ``unread-nan`` probe finds NaN propagates through a zero weight, as cache-outside-invariance does).
    Catches: the last page read whole, every page the table lists read, pages in physical order, a mask applied
    after multiplying stale rows by a zero weight.
    """
    _paged_only(target)
    q, k_full, v_full, lengths, P, table, k_pool, v_pool = paged_case(target, case)
    S = q.shape[1]
    seqlens = lengths - S
    attended = torch.zeros(k_pool.shape[:2], dtype=torch.bool)  # [num_blocks, P]
    for page, offset in slots(table.cpu(), P, torch.zeros_like(seqlens), seqlens):
        attended[page, offset] = True
    new = [_new_rows(t, seqlens, S) for t in (k_full, v_full)]
    stale, shown = unread_fill(target)  # NaN, or 100 where NaN propagates through a zero weight (probed: unread-nan)
    outs = []
    for fill in (None, stale):
        pools = [t.clone() for t in (k_pool, v_pool)]
        if fill is not None:
            for t in pools:
                t[~attended.to(t.device)] = fill  # [num_blocks, P, H, D] slots nobody attends set to NaN (or 100)
        outs.append(target.decode(q, *pools, seqlens.to(q.device), *new, causal=True, block_table=table))
    clean, poisoned = outs
    differ = ~((clean == poisoned) | (clean.isnan() & poisoned.isnan())) | ~torch.isfinite(poisoned)  # [B, S, H, D]
    if differ.any():
        b, i, h, _ = differ.nonzero()[0].tolist()
        end, pages = int(seqlens[b]) + S, math.ceil((int(seqlens[b]) + S) / P)
        fail(f"{poisoned[b, i, h].tolist()} instead of {clean[b, i, h].tolist()}",
             what=f"out[{b}, {i}, {h}] with {shown} in the {int((~attended).sum())} pool slots no element attends "
                  f"(element {b}: {_n(end, 'row')} in {_n(pages, 'page')} of {P}, a tail of {_n(pages * P - end, 'row')} "
                  f"in its last page, {_n(table.shape[1] - pages, 'more page')} in its table)",
             expected="the output of the same call with stale finite values there, bitwise",
             call=f"{target.name}(q, k_pages, v_pages, k, v, cache_seqlens, block_table, causal=True)",
             cause=because("paged-reads-outside"), got=poisoned[b].transpose(0, 1).to(F64),
             expected_tensor=clean[b].transpose(0, 1).to(F64),
             labels=(f"the output with {shown} in the slots nobody attends", "the output with stale values there"))


@prop("paged-append-writes-exactly", family="serving",
      statement="appending k, v to a paged cache writes exactly the slots of rows [cache_seqlens, cache_seqlens + "
                "S_new) through the block table, bitwise, and no other slot of the pool",
      conventions=("decode",), cases=PAGED_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="pool'[table[b, r // P], r % P] = k_new[b, r - len_b] for len_b <= r < len_b + S; "
                            "pool' = pool elsewhere",
                    latex=r"\mathrm{pool}'_{T_{b,\lfloor r/P \rfloor}, r \bmod P} = k_{new,b,r-\ell_b}\ (\ell_b \le r "
                          r"< \ell_b + S),\ \mathrm{pool}\ \text{elsewhere}",
                    check="Calls the kernel with k and v to append into a scrambled pool and compares both pools "
                          "afterwards, slot by slot and bitwise, with the pools it was given with exactly the "
                          "appended rows' slots replaced.",
                    example="decode"))
def paged_append_writes_exactly(target, case):
    """k_pool' = k_pool with slot (table[b, r // P], r % P) := k_new[b, r - seqlens_b] for r in [seqlens_b,
    seqlens_b + S), every other slot unchanged (v likewise), bitwise.

    Why: an append that crosses a page boundary must move to the next page of the table, not the next page of
    the pool; a wrong slot corrupts another request's cache, or this one's next step, with no error. Catches:
    the page of the first new row used for all of them, the pool's next page taken instead of the table's,
    an append off by one. A kernel that does not write the cache (the header's "writes the cache: no") is skipped.
    """
    _paged_only(target)
    if target.behaviour()["writes-cache"] != "yes":
        raise Unsupported(f"{target.name} does not write the cache", total=True)
    q, k_full, v_full, lengths, P, table, k_pool, v_pool = paged_case(target, case)
    S = q.shape[1]
    seqlens = lengths - S
    new = [_new_rows(t, seqlens, S) for t in (k_full, v_full)]  # [B, S, H, D]
    pools = [t.flip(0).clone() for t in (k_pool, v_pool)]  # other values than the ones appended
    expected = [t.clone() for t in pools]
    for b in range(len(lengths)):
        for t in range(S):
            r = int(seqlens[b]) + t
            for want, rows in zip(expected, new):
                want[int(table[b, r // P]), r % P] = rows[b, t]
    target.decode(q, *pools, seqlens.to(q.device), *new, causal=True, block_table=table)
    for name, got, want in zip(("k_pages", "v_pages"), pools, expected):
        wrong = (got != want).flatten(2).any(-1)  # [num_blocks, P] slots that differ
        if wrong.any():
            page, offset = wrong.nonzero()[0].tolist()
            fail(f"{int(wrong.sum())} slots differ, the first page {page} offset {offset}", what=f"{name} after the call",
                 expected=f"the slots (block_table[b, r // {P}], r % {P}) of rows r in [cache_seqlens_b, "
                          f"cache_seqlens_b + {S}) replaced by the new rows, bitwise, and nothing else",
                 call=f"{target.name}(q, k_pages, v_pages, k, v, cache_seqlens, block_table)",
                 cause=because("paged-append-elsewhere"), got=got[page].flatten(1).to(F64),
                 expected_tensor=want[page].flatten(1).to(F64),
                 labels=(f"page {page} of {name} after the call, one row per slot", "the page with exactly the new rows"))


@prop("paged-capacity-contract", family="serving",
      statement="a length past the block table's capacity (max_blocks * page) raises; a length exactly at capacity "
                "does not, and decodes right",
      conventions=("decode",), cases=PAGED_CASES, examples=EXAMPLES, at_scale=AT_SCALE,
      lesson=Lesson(unicode="len_b + S > max_blocks · P  ⇒  raise;   len_b + S = max_blocks · P  ⇒  decode",
                    latex=r"\ell_b + S > n_{blocks} P \Rightarrow \mathrm{raise},\quad \ell_b + S = n_{blocks} P "
                          r"\Rightarrow \mathrm{decode}",
                    check="Fills a block table exactly (every element at capacity), calls the kernel and compares it "
                          "with float64 causal attention; then makes element 0 one row longer than its table holds "
                          "(cache_seqlens, and an append past the end where the kernel writes the cache) and requires "
                          "each call to raise.",
                    example="decode"))
def paged_capacity_contract(target, case):
    """cache_seqlens_b + S <= max_blocks * P for every b: the call decodes; cache_seqlens_0 + S = max_blocks * P + 1:
    the call raises (any exception).

    Why: the block table bounds what a sequence owns; a kernel that takes a length past it reads the entries after
    the table's row (the next element's pages) or whatever memory follows, and returns a plausible wrong answer
    (flash-attn #2709, fixed by raising in PR #2711; flash-attn's own suite checks both sides). A silent output
    for a call it cannot serve is a failure here: nothing tells the caller that its scheduler overran a table.
    Catches: no bounds check (the table read as one flat array), a check off by one that refuses exactly full
    tables.
    """
    _paged_only(target)
    q, k_full, v_full, _, _ = decode_inputs(case)
    S, B = q.shape[1], q.shape[0]
    P, table, num_blocks = page_layout(case, k_full.shape[1], granule=page_granule(target), extra=0)
    capacity = table.shape[1] * P
    gen = torch.Generator().manual_seed(case.seed + 3)
    draw = lambda n: _values(gen, (B, n, *k_full.shape[2:]), case.values, case.magnitude).to(q.dtype)  # noqa: E731
    k_seq, v_seq = draw(capacity), draw(capacity)  # [B, capacity, H, D]: every table full
    empty = torch.zeros(num_blocks, P, *k_full.shape[2:], dtype=q.dtype)  # [num_blocks, P, H, D]
    pools = [to_pages(t, P, table, empty).to(q.device) for t in (k_seq, v_seq)]
    k_seq, v_seq, table = k_seq.to(q.device), v_seq.to(q.device), table.to(q.device)
    full = torch.full((B,), capacity, dtype=torch.int32)
    try:
        out = target.decode(q, *[t.clone() for t in pools], full.to(q.device), causal=True, block_table=table)
    except TargetRaised as exc:
        fail(f"raised {type(exc.exc).__name__}: {exc.exc}", what="a call with every "
             f"element exactly at the block table's capacity ({table.shape[1]} pages of {P} = {capacity} rows)",
             expected="an output: a full block table is a valid call", call=f"{target.name}(q, k_pages, v_pages, "
             f"cache_seqlens={capacity}, block_table)", cause=because("paged-capacity-off-by-one"))
    for b in range(B):
        q_b, k_b, v_b, ref = last_rows_reference(q, k_seq, v_seq, b, 0, capacity)
        assert_close(out[b].transpose(0, 1), ref,
                     budget=budget(q_b, k_b, v_b, None, ref, causal=True, causal_alignment="bottom-right"),
                     what=f"element {b} at capacity ({capacity} rows) vs full causal attention",
                     call=f"{target.name}(q, k_pages, v_pages, cache_seqlens, block_table, causal=True)")
    over = full.clone()
    over[0] += 1  # element 0 one row past its table
    calls = [("cache_seqlens", dict(cache_seqlens=over, k=None, v=None))]
    if target.behaviour()["writes-cache"] == "yes":
        calls.append(("an append", dict(cache_seqlens=over - S, k=k_seq[:, :S], v=v_seq[:, :S])))
    for how, given in calls:
        try:
            target.decode(q, *[t.clone() for t in pools], given["cache_seqlens"].to(q.device), given["k"], given["v"],
                          causal=True, block_table=table)
        except (TargetRaised, Unsupported):
            continue
        fail(f"returned an output for element 0 at {capacity + 1} rows by {how}", what="a length past the block "
             f"table's capacity ({table.shape[1]} pages of {P} = {capacity} rows)",
             expected="an exception: the block table cannot hold that length",
             call=f"{target.name}(q, k_pages, v_pages{', k, v' if how == 'an append' else ''}, cache_seqlens, "
                  f"block_table, causal=True)",
             cause=because("paged-no-capacity-check"))
