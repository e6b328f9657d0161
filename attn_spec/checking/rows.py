"""Judging long cases row by row: the float64 reference on chosen query rows, a same-dtype one on all.

Each output row of attention depends only on its own query row, the keys and values it may see
and its mask row:

    out[b, i] = softmax(scale * Q[b, i] K[b]^T + mask[b, i]) V[b]

so the float64 reference of k chosen rows costs O(k n d), not O(n^2 d), and its rows are exactly
those of the whole reference. On a long case (the whole float64 score tensor does not fit in one
chunk, ``chunked.fits``) a target's output is judged in two stages:

1. on the chosen rows of every batch element and head, against the float64 reference, within the
   calibrated budget computed on those same rows (``tolerance.budget`` on the sub-problem);
2. on every row, against torch's fused attention in the target's own dtype and device (one kernel,
   about the price of one call of the target; the kit's naive formula where it does not take the
   inputs), within twice the rows' budget with its floor over all rows: |target - fused| <=
   |target - ref| + |fused - ref|, and the fused attention's error on the chosen rows is one of those
   the budget is earned from (with the two naive forms of ``checking.tolerance``), so at most a
   quarter of it.

The rows are chosen where kernel bugs live (:func:`choose`): the first and last rows, rows at and
around tile boundaries (multiples of 16, 32, 64, 128 and their neighbours), the last partial tile,
rows whose causal edge (last key allowed) is at a key-tile boundary in either alignment, powers of
two and their neighbours, and a random sample of the others, drawn by the kit's own generator (seeded from the
OS) each time rows are chosen, after the target's call returned: a kernel exact only on the rows it expects to
be looked at is judged where it did not expect. A failure names the row and why it was
chosen. A short case is judged as before: the whole float64 reference.

A case's reference is computed once and shared by the properties that judge it (:func:`reference`
keeps a per-case cache, by exact input values, bounded in bytes).
"""
from __future__ import annotations

import math
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from attn_spec.checking import chunked
from attn_spec.reference import causal_mask, fold, key_offset, visible
from attn_spec.checking.assertions import assert_close, fail, number
from attn_spec.checking.tolerance import budget, by_rows, earned, floor_unit, max_error, naive_attention, \
    seed_attention

TILES = (16, 32, 64, 128)
RANDOM_ROWS = 24
# The random rows' generator: the kit's own, seeded from the OS, drawn from each time rows are chosen (after the
# target's call returned): a target cannot reseed it, and cannot learn which rows will be judged by calling choose
_PRIVATE = torch.Generator().manual_seed(secrets.randbits(63))
FUSED = "torch's fused attention in the same dtype"  # what every row of a long case is compared with
CACHE_BYTES = {"cpu": 2**30, "cuda": 2**31}  # what the cache may hold per device (inputs, outputs, rows)


def choose(n_q: int, n_kv: int) -> dict[int, str]:
    """{row: why it was chosen} for a case with n_q query rows over n_kv keys (the first reason kept)."""
    rows: dict[int, str] = {}

    def add(row, why):
        if 0 <= row < n_q:
            rows.setdefault(int(row), why)

    for row in (0, 1):
        add(row, "first rows")
    for row in (n_q - 1, n_q - 2):
        add(row, "last rows")
    for tile in TILES:
        last = (n_q - 1) // tile * tile  # the start of the last tile of rows
        if last and n_q % tile:
            for row in (last, last + 1, (last + n_q - 1) // 2, n_q - 1):
                add(row, f"in the last partial tile of {tile} rows (rows {last}..{n_q - 1})")
        middle = (n_q // tile // 2) * tile
        for start in dict.fromkeys(s for s in (tile, 2 * tile, middle, last - tile, last) if s > 0):
            for row in (start - 1, start, start + 1):
                add(row, f"at or next to the tile boundary {start} (a multiple of {tile})")
    for offset in dict.fromkeys(key_offset(n_q, n_kv, a) for a in ("top-left", "bottom-right")):
        for tile in (64, 128):
            ends = [m * tile for m in (1, 2, n_kv // tile // 2, n_kv // tile - 1, n_kv // tile) if m > 0]
            for end in dict.fromkeys(ends):  # row i's last allowed key is i + offset: at end - 1 or end
                for row in (end - 1 - offset, end - offset):
                    add(row, f"its causal edge (key {row + offset}, offset {offset}) is at the key tile boundary {end}")
    power = 1
    while power < n_q:
        for row in (power - 1, power):
            add(row, f"at a power of two ({power})")
        power *= 2
    rest = torch.ones(n_q, dtype=torch.bool)
    rest[list(rows)] = False
    rest = rest.nonzero().squeeze(1)  # the rows not chosen above
    for row in rest[torch.randperm(len(rest), generator=_PRIVATE)[:RANDOM_ROWS]].tolist():
        add(row, "drawn at random")
    return dict(sorted(rows.items()))


def rule(n_q: int, n_kv: int, batch: int = 1) -> str:
    """The header's sentence for one shape: ``rows judged exactly: k of n, chosen ...``."""
    k = len(choose(n_q, n_kv))
    where = f" in each of the {batch} batch elements x heads" if batch > 1 else ""
    return (f"rows judged exactly: {k} of {n_q}{where}, chosen as the first and last rows, rows at and next to tile "
            f"boundaries ({', '.join(map(str, TILES))}), the last partial tile, rows whose causal edge is at a key "
            f"tile boundary, powers of two, and {RANDOM_ROWS} others drawn afresh for each call, after it returned, "
            f"by a generator of the kit's own; every row is also judged against {FUSED}")


def rules(rungs) -> dict[str, str]:
    """{shape: its rule} for the rungs whose cases are long (the same test as :func:`sampled`, on the case the
    shape makes: its batch and head dims, no mask); a shorter rung's rows are all judged exactly."""
    out = {}
    for rung in rungs:
        s = rung.shape
        n = s.batch * s.heads * s.n_q * s.n_kv
        if 8 * n > chunked.chunk_bytes_for(torch.device("cpu" if rung.device == "mps" else rung.device)):
            out[str(s)] = rule(s.n_q, s.n_kv, s.batch * s.heads)
    return out


def sampled(q, k, v, mask=None) -> bool:
    """True when a case is judged on chosen rows: its whole float64 score tensor does not fit in one chunk."""
    return not chunked.fits(q, k, v, mask)


def _rows_mask(mask, index, n_q, n_kv, causal, causal_alignment, device):
    """The mask of the chosen rows [..., k, Tk] (a padding mask [..., 1, Tk] as it is), the causal triangle's
    rows folded in as a bool mask; None without either."""
    sub = None if mask is None else mask if mask.shape[-2] == 1 else mask.index_select(-2, index.to(mask.device))
    if not causal:
        return sub
    positions = index.to(device) + key_offset(n_q, n_kv, causal_alignment)  # [k]
    return fold(sub, visible(positions, n_kv))  # [..., k, Tk]


@dataclass
class Reference:
    """One case's reference: the float64 rows (all of them for a short case), their budget, and on a long
    case the fast same-dtype output of every row (computed when first asked for)."""
    inputs: tuple
    options: dict
    why: dict[int, str] | None  # {row: reason}; None: every row is judged exactly
    exact: torch.Tensor  # [..., k or Tq, Dv] float64
    budget: float
    naive_rows_error: float = 0.0
    _fast: torch.Tensor | None = field(default=None, repr=False)

    @property
    def index(self):
        return None if self.why is None else torch.tensor(list(self.why), dtype=torch.long)

    def rows_of(self, out):
        """``out`` [..., Tq, D] at the chosen rows [..., k, D] (all of them for a short case)."""
        return out if self.why is None else out.index_select(-2, self.index.to(out.device))

    def fast(self):
        """[..., Tq, Dv]: every row in the inputs' dtype and device, by torch's fused attention (one kernel; the
        kit's naive formula, a chunk of rows at a time, costs 4 to 12 times as much), or by the naive formula
        where the fused one does not take the inputs. A row with no key allowed is zeros, as the reference's."""
        if self._fast is None:
            q, k, v, mask = self.inputs
            try:
                out = _fused(q, k, v, mask, **self.options)
            except (RuntimeError, ValueError, TypeError):
                out = by_rows(naive_attention, q, k, v, mask, **self.options)
            self._fast = out.nan_to_num(nan=0.0)
        return self._fast

    def fast_budget(self) -> float:
        """What every row may differ from the fast reference by: twice the rows' budget with its floor over all rows."""
        q, k, v, mask = self.inputs
        return 2 * earned(self.naive_rows_error, floor_unit(q, k, v, mask, **self.options))

    def error(self, got) -> float:
        """max |got - ref64| on the judged rows."""
        return max_error(self.rows_of(got), self.exact)

    def holds(self, got, factor: float = 1.0) -> bool:
        """``got`` is within ``factor`` budgets of the reference (and, on a long case, of the fast one on every row)."""
        err = self.error(got)
        if not (math.isfinite(err) and err <= factor * self.budget):
            return False
        return self.why is None or max_error(got, self.fast()) <= factor * self.fast_budget()

    def check(self, got, *, what: str, call: str = "", cause="", factor: float = 1.0, inputs=None) -> None:
        """Fail unless ``got`` [..., Tq, Dv] matches: the whole reference on a short case; on a long one the chosen
        rows against float64 (the failure names the row and why it was chosen), then every row against the fast
        reference in the target's dtype. ``inputs``: the call's tensors, where they are not the case's."""
        if self.why is None:
            assert_close(got, self.exact, budget=factor * self.budget, what=what, call=call, cause=cause,
                         inputs=inputs)
            return
        mine = self.rows_of(got)  # [..., k, Dv]
        err = max_error(mine, self.exact)
        if not err <= factor * self.budget:
            at, position = _worst(mine, self.exact)
            row = list(self.why)[position]
            fail(f"max error {number(err)} at query row {row}{at} (chosen: {self.why[row]}; {len(self.why)} rows "
                 f"judged exactly)", what=what, budget=factor * self.budget, call=call, cause=cause, got=mine,
                 expected_tensor=self.exact, labels=("the target's result at the chosen rows",
                                                     "the float64 reference at those rows"), inputs=inputs)
        fast = self.fast()
        err = max_error(got, fast)
        if not err <= factor * self.fast_budget():
            at, row = _worst(got, fast)
            fail(f"max error {number(err)} at query row {row}{at}, not one of the {len(self.why)} rows judged "
                 f"exactly", what=f"{what.replace('the float64 reference', FUSED)} (every row)",
                 budget=factor * self.fast_budget(), call=call, cause=cause,
                 got=got, expected_tensor=fast, labels=("the target's result", "torch's fused attention, same dtype"),
                 inputs=inputs)


def _fused(q, k, v, mask, *, scale, causal, causal_alignment):
    """torch.nn.functional.scaled_dot_product_attention under the same mask and causal triangle."""
    n_q, n_kv = q.shape[-2], k.shape[-2]
    if not causal and mask is not None and mask.dim() == 2 and mask.dtype == torch.bool and \
            torch.equal(mask, causal_mask(n_q, n_kv, device=mask.device)):
        causal, mask = True, None  # a causal mask written out: is_causal skips the future (3x faster on the CPU)
    top_left = causal and (causal_alignment == "top-left" or n_q == n_kv)
    if causal and not top_left:
        mask = fold(mask, causal_mask(n_q, n_kv, alignment="bottom-right", device=q.device))
    if top_left and mask is not None:
        mask = fold(mask, causal_mask(n_q, n_kv, device=q.device))
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=None if mask is None else mask.to(q.device), is_causal=top_left and mask is None,
        scale=scale)


def _worst(got, expected) -> tuple[str, int]:
    """(' of batch element (b, h)' or '', the row index in the judged tensor) of the largest difference."""
    diff = (got.detach().to("cpu", torch.float64) - expected.detach().to("cpu", torch.float64)).abs()
    diff = torch.where(torch.isfinite(diff), diff, torch.full_like(diff, math.inf)).amax(dim=-1)  # [..., rows]
    flat = int(diff.flatten().nan_to_num(math.inf).argmax())
    where = [int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)]
    batch = f" of batch element {tuple(where[:-1])}" if len(where) > 1 else ""
    return batch, where[-1]


def _build(q, k, v, mask, options) -> Reference:
    n_q, n_kv = q.shape[-2], k.shape[-2]
    if not sampled(q, k, v, mask):
        exact = chunked.reference_output(q, k, v, mask, **options)
        return Reference((q, k, v, mask), options, None, exact, budget(q, k, v, mask, exact, **options))
    why = choose(n_q, n_kv)
    index = torch.tensor(list(why), dtype=torch.long, device=q.device)
    q_rows = q.index_select(-2, index)  # [..., k, Dk]
    m_rows = _rows_mask(mask, index, n_q, n_kv, options["causal"], options["causal_alignment"], q.device)
    exact = chunked.reference_output(q_rows, k, v, m_rows, scale=options["scale"])  # [..., k, Dv]
    ref = Reference((q, k, v, mask), options, why, exact, 0.0)
    naive_rows = ref.rows_of(ref.fast())  # the fast reference's own rows: its error sampled where it is judged
    errors = [max_error(naive_rows, exact)] + [max_error(by_rows(impl, q_rows, k, v, m_rows, scale=options["scale"]),
                                                         exact) for impl in (naive_attention, seed_attention)]
    finite = [e for e in errors if math.isfinite(e)]
    ref.naive_rows_error = max(finite) if finite else 0.0
    ref.budget = earned(ref.naive_rows_error, floor_unit(q_rows, k, v, m_rows, scale=options["scale"]))
    return ref


_CACHE: OrderedDict = OrderedDict()  # key -> (input copies, Reference), least recently used first


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    return a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b)


def reference(q, k, v, mask=None, *, scale=None, causal=False, causal_alignment="top-left") -> Reference:
    """The case's :class:`Reference`, computed once: a long case's is kept (with copies of its inputs, so that
    a target writing into them cannot change what is found) and given again for the same input values. Inputs
    larger than half the cache's bound (a causal [n_q, n_kv] mask at 64k keys is 4 GiB) are not copied or kept."""
    options = dict(scale=scale, causal=causal, causal_alignment=causal_alignment)
    if not sampled(q, k, v, mask):
        return _build(q, k, v, mask, options)
    key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), None if mask is None else tuple(mask.shape), q.dtype,
           str(q.device), tuple(sorted(options.items())))
    for (found_key, i), (copies, ref) in list(_CACHE.items()):
        if found_key == key and all(_same(a, b) for a, b in zip(copies, (q, k, v, mask))):
            _CACHE.move_to_end((found_key, i))
            return ref
    limit = CACHE_BYTES.get(q.device.type, CACHE_BYTES["cpu"])
    if 2 * _nbytes(q, k, v, mask) > limit:
        return _build(q, k, v, mask, options)
    copies = tuple(None if t is None else t.detach().clone() for t in (q, k, v, mask))
    ref = _build(*copies, options)
    _CACHE[(key, id(ref))] = (copies, ref)
    while len(_CACHE) > 1 and sum(_nbytes(*c, r.exact, r._fast) for c, r in _CACHE.values()) > limit:
        _CACHE.popitem(last=False)
    return ref


def clear() -> None:
    """Forget every cached reference (tests; a long-running process between checks)."""
    _CACHE.clear()
