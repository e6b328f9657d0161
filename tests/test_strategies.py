"""The strategies really exercise every dimension the kit promises, profiles are ordered and
documented truthfully, runs are reproducible from a seed, and bad arguments get clear errors."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, seed, settings

import attn_spec
from attn_spec.checking import strategies
from attn_spec.checking.cases import DTYPES, Case, MhaCase, available_devices
from attn_spec.checking.strategies import PROFILES, cases, mha_cases
from attn_spec.errors import KitUsageError

SAMPLES = 300
REPO = Path(__file__).resolve().parents[1]


def draw_many(strategy, n=SAMPLES) -> list:
    """``n`` values drawn the way a property run draws them (generation only, no database, a fixed seed)."""
    drawn = []

    @seed(0)  # the same draws every run: a coverage test that passes once always passes
    @settings(max_examples=n, database=None, deadline=None)
    @given(strategy)
    def record(value):
        drawn.append(value)

    record()
    return drawn


@pytest.fixture(scope="module")
def default_cases() -> list[Case]:
    return draw_many(cases("default"))


@pytest.fixture(scope="module")
def default_mha_cases() -> list[MhaCase]:
    return draw_many(mha_cases("default"))


COVERAGE = {
    "n_q > n_kv": lambda c: c.n_q > c.n_kv,
    "n_q < n_kv": lambda c: c.n_q < c.n_kv,
    "n_q == n_kv": lambda c: c.n_q == c.n_kv,
    "d_v > d_k": lambda c: c.d_v > c.d_k,
    "d_v < d_k": lambda c: c.d_v < c.d_k,
    "one query": lambda c: c.n_q == 1,
    "one key": lambda c: c.n_kv == 1,
    "d_k = 1": lambda c: c.d_k == 1,
    "odd n_q > 1": lambda c: c.n_q > 1 and c.n_q % 2,
    "odd n_kv > 1": lambda c: c.n_kv > 1 and c.n_kv % 2,
    "odd d_k > 1": lambda c: c.d_k > 1 and c.d_k % 2,
    "no batch dims": lambda c: c.batch == (),
    "one batch dim": lambda c: len(c.batch) == 1,
    "two batch dims": lambda c: len(c.batch) == 2,
    "d_k = 256": lambda c: c.d_k == 256,
    "d_v >= 128": lambda c: c.d_v >= 128,
    "n_q > 100": lambda c: c.n_q > 100,
    "n_kv > 100": lambda c: c.n_kv > 100,
    "integer entries": lambda c: c.values == "integers",
    "normal entries": lambda c: c.values == "normal",
    **{f"dtype {d}": (lambda d: lambda c: c.dtype == d)(d) for d in DTYPES},
    **{f"mask {m}": (lambda m: lambda c: c.mask == m)(m) for m in ("none", "random", "causal")},
    **{f"magnitude {x}": (lambda x: lambda c: c.magnitude == x)(x) for x in PROFILES["default"].magnitudes},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", COVERAGE)
def test_default_profile_exercises(name, default_cases):
    assert any(COVERAGE[name](c) for c in default_cases), f"no '{name}' case in {SAMPLES} draws of cases('default')"


def test_default_profile_stays_in_bounds(default_cases):
    prof = PROFILES["default"]
    assert max(c.d_k for c in default_cases) == 256 and max(c.n_kv for c in default_cases) == max(prof.lengths)
    assert all(len(c.batch) <= prof.max_batch_dims and all(1 <= n <= 3 for n in c.batch) for c in default_cases)
    assert {c.device for c in default_cases} == set(available_devices())  # cpu always, cuda/mps when present
    assert {c.magnitude for c in default_cases} == set(prof.magnitudes) and max(prof.magnitudes) >= 8


def test_random_masks_leave_a_key_in_every_row(default_cases):
    """Materialised random masks: bool, the case's shape, at least one True per row, and really random."""
    masked = [c for c in default_cases if c.mask == "random"][:60]
    assert len(masked) >= 20
    some_blocked = False
    for case in masked:
        q, k, v, mask = case.replace(d_k=1, d_v=1).tensors()  # widths do not change the mask
        assert mask.dtype == torch.bool and mask.shape == case.batch + (case.n_q, case.n_kv)
        assert mask.any(dim=-1).all(), f"{case} has a query with no allowed key"
        some_blocked |= bool((~mask).any())
    assert some_blocked, "no random mask ever blocked a key"


def test_causal_cases_materialise_a_causal_mask(default_cases):
    case = next(c for c in default_cases if c.mask == "causal" and c.n_q > 1 and c.n_kv > 1)
    mask = case.replace(d_k=1, d_v=1).tensors()[3].cpu()  # [Tq, Tk], drawn on any available device
    assert torch.equal(mask, torch.ones(case.n_q, case.n_kv, dtype=torch.bool).tril())


MHA_COVERAGE = {
    **{f"{h} heads": (lambda h: lambda c: c.n_heads == h)(h) for h in (1, 2, 3, 4)},
    "n_q > n_kv": lambda c: c.n_q > c.n_kv,
    "n_q < n_kv": lambda c: c.n_q < c.n_kv,
    "one query": lambda c: c.n_q == 1,
    "d_head >= 32": lambda c: c.d_model // c.n_heads >= 32,
    **{f"dtype {d}": (lambda d: lambda c: c.dtype == d)(d) for d in DTYPES},
    **{f"mask {m}": (lambda m: lambda c: c.mask == m)(m) for m in ("none", "random", "causal")},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", MHA_COVERAGE)
def test_default_mha_profile_exercises(name, default_mha_cases):
    assert any(MHA_COVERAGE[name](c) for c in default_mha_cases), f"no '{name}' case in mha_cases('default')"


def test_mha_cases_split_d_model_into_heads(default_mha_cases):
    assert all(c.d_model % c.n_heads == 0 for c in default_mha_cases)
    for case in [c for c in default_mha_cases if c.mask == "random"][:20]:
        mask = case.tensors()[3]
        assert mask.shape == (case.n_q, case.n_kv) and mask.any(dim=-1).all()


OPTIONS = [  # (options of cases(), what every drawn case must satisfy)
    ({"cross": True}, lambda c: c.n_q != c.n_kv and c.d_v != c.d_k),
    ({"cross": False}, lambda c: c.n_q == c.n_kv and c.d_v == c.d_k),
    ({"batch": False}, lambda c: c.batch == ()),
    ({"batch": True}, lambda c: 1 <= len(c.batch)),
    ({"min_n_kv": 2}, lambda c: c.n_kv >= 2),
    ({"dtypes": ("float32",)}, lambda c: c.dtype == "float32"),
    ({"masks": ("causal",)}, lambda c: c.mask == "causal"),
]


@pytest.mark.parametrize("options, holds", OPTIONS, ids=[str(o) for o, _ in OPTIONS])
def test_case_options_are_honoured(options, holds):
    drawn = draw_many(cases("quick", **options), n=50)
    assert all(holds(c) for c in drawn)


# -- reproducibility ----------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [Case(batch=(2, 3), n_q=5, n_kv=3, d_k=7, d_v=2, values="normal", magnitude=3.0,
                                       mask="random", seed=41),
                                  Case(n_q=4, n_kv=4, dtype="bfloat16", mask="causal", seed=7),
                                  MhaCase(n_q=3, n_kv=5, d_model=6, n_heads=3, mask="random", seed=9)],
                         ids=["case", "causal-bf16", "mha"])
def test_tensors_are_a_function_of_the_case(case):
    def flat(tensors):
        out = []
        for t in tensors:
            out.extend(t.values() if isinstance(t, dict) else [t])
        return out

    first, again, other = flat(case.tensors()), flat(case.tensors()), flat(case.replace(seed=case.seed + 1).tensors())
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(first, again))
    assert any(not torch.equal(a, b) for a, b in zip(first, other))


def _without_timings(data):
    if isinstance(data, dict):
        return {k: _without_timings(v) for k, v in data.items() if k != "seconds"}
    if isinstance(data, list):
        return [_without_timings(x) for x in data]
    return data


@pytest.mark.parametrize("target, only", [
    ("examples/seed_attention.py:attention", ["permutation-equivariance", "matches-reference"]),
    ("examples/buggy_attention.py:attention", ["rows-sum-to-one", "scale-sqrt-dk", "matches-reference"]),
])
def test_same_seed_reproduces_a_run(target, only, monkeypatch):
    from attn_spec.targets.conventions import make_target
    from attn_spec.targets.loading import load_target

    monkeypatch.chdir(REPO)

    def run(seed):
        report = attn_spec.check(make_target(load_target(target), target), profile="quick", seed=seed, only=only)
        return _without_timings(report.to_dict())

    first = run(1234)
    assert run(1234) == first
    assert [p["examples"] for p in first["targets"][0]["properties"]] and first["seed"] == 1234


# -- profiles --------------------------------------------------------------------------------------

def test_profiles_are_ordered_quick_default_thorough():
    quick, default, thorough = (PROFILES[n] for n in ("quick", "default", "thorough"))
    for lo, hi in ((quick, default), (default, thorough)):
        assert lo.max_examples < hi.max_examples
        assert lo.small <= hi.small and lo.max_batch_dims <= hi.max_batch_dims
        assert max(lo.lengths, default=0) <= max(hi.lengths) and max(lo.dims, default=0) <= max(hi.dims)
        assert set(lo.magnitudes) <= set(hi.magnitudes)
        assert max(lo.pages, default=0) <= max(hi.pages) and lo.max_splits <= hi.max_splits
    assert max(default.lengths) > 100 and max(default.dims) >= 256


def _docstring_table() -> dict[str, list[str]]:
    """The profile table of the strategies module docstring: profile -> its cells (wrapped lines joined)."""
    lines = strategies.__doc__.splitlines()
    borders = [i for i, line in enumerate(lines) if re.fullmatch(r"=+( +=+)+", line)]
    assert len(borders) == 3, "the profile table is an RST simple table with three border lines"
    starts = [m.start() for m in re.finditer("=+", lines[borders[0]])]
    rows: dict[str, list[str]] = {}
    last = None
    for line in lines[borders[1] + 1:borders[2]]:
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [None])]
        if cells[0]:
            last = rows[cells[0]] = cells
        else:  # a wrapped continuation line
            rows[last[0]] = [" ".join(filter(None, (a, b))) for a, b in zip(rows[last[0]], cells)]
    return rows


def _sizes(cell: str, small: int, large: tuple[int, ...]) -> None:
    """Check '1..N' or '1..N, or a, b, c' or '1..N, or up to M' against a profile."""
    m = re.fullmatch(r"1\.\.(\d+)(?:, or (up to )?([\d, ]+))?", cell)
    assert m, f"cannot read {cell!r}"
    assert int(m[1]) == small, cell
    listed = tuple(int(x) for x in m[3].split(",")) if m[3] else ()
    if m[2]:
        assert max(large) == listed[0], cell
    else:
        assert listed == large, cell


def test_docstring_profile_table_matches_profiles():
    table = _docstring_table()
    assert list(table) == [name for name, prof in PROFILES.items() if not prof.ladder]
    for name, (_, examples, lengths, dims, batch, pages, splits) in table.items():
        prof = PROFILES[name]
        assert int(examples) == prof.max_examples, name
        _sizes(lengths, prof.small, prof.lengths)
        _sizes(dims, prof.small, prof.dims)
        assert batch == f"up to {prof.max_batch_dims}", name
        _sizes(pages, prof.small, prof.pages)
        assert splits == f"0..{prof.max_splits}", name


# -- argument validation ------------------------------------------------------------------------------

ABSENT_DEVICE = next(d for d in ("cuda", "mps", "xla") if d not in available_devices())

BAD_CALLS = {
    "cases: unknown profile": (lambda: cases("huge"), "huge"),
    "mha_cases: unknown profile": (lambda: mha_cases("fast"), "fast"),
    "cases: unknown dtype": (lambda: cases("quick", dtypes=("float32", "float8")), "float8"),
    "mha_cases: unknown dtype": (lambda: mha_cases("quick", dtypes=("int8",)), "int8"),
    "cases: no dtype": (lambda: cases("quick", dtypes=()), "dtypes=[]"),
    "cases: unknown device": (lambda: cases("quick", devices=("tpu",)), "tpu"),
    "cases: absent device": (lambda: cases("quick", devices=(ABSENT_DEVICE,)), ABSENT_DEVICE),
    "mha_cases: unknown device": (lambda: mha_cases("quick", devices=("gpu0",)), "gpu0"),
    "cases: unknown mask kind": (lambda: cases("quick", masks=("triangular",)), "triangular"),
    "mha_cases: unknown mask kind": (lambda: mha_cases("quick", masks=("none", "padding")), "padding"),
    "check: unknown profile": (lambda: attn_spec.check(lambda Q, K, V, mask=None: V, profile="slow"), "slow"),
    "check: unknown dtype": (lambda: attn_spec.check(lambda Q, K, V, mask=None: V, profile="quick",
                                                     only=["cross-attention-shapes"], dtypes=["half"]), "half"),
    "check: unknown device": (lambda: attn_spec.check(lambda Q, K, V, mask=None: V, profile="quick",
                                                      only=["cross-attention-shapes"], devices=["tpu"]), "tpu"),
}


@pytest.mark.parametrize("name", BAD_CALLS)
def test_bad_arguments_raise_a_usage_error_naming_the_value(name):
    call, bad = BAD_CALLS[name]
    with pytest.raises(KitUsageError) as info:
        call()
    assert bad in str(info.value)
