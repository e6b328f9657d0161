"""The JSON report does not move under a refactor: a few targets at a fixed seed and profile against a snapshot.

The snapshot (tests/data/json_stable.json) was recorded from main before issue 22's moves: a correct
function, a buggy gallery function with its roots, a bshd kernel that transposes heads and sequence, a
module and a serving kernel. It is compared apart from key order, numbers within rounding; the timings
and the versions are left out. Rerecord it only for an intended change of the report:

    .venv/bin/python tests/test_json_stable.py --record
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOT = ROOT / "tests" / "data" / "json_stable.json"
# (target, convention, the properties checked: a few, to keep it fast; diagnose: off, the properties' own causes)
TARGETS = [
    ("examples/seed_attention.py:attention", None, ["rows-sum-to-one", "causal-mask", "scale-sqrt-dk",
                                                    "matches-reference", "mask-semantics"]),
    ("tests/gallery/core.py:no_scale", None, ["rows-sum-to-one", "scale-sqrt-dk", "matches-reference",
                                                "value-linearity"]),
    ("tests/gallery/ecosystem.py:bshd_transposes_heads", "sdpa", ["rows-sum-to-one", "matches-reference"]),
    ("examples/seed_attention.py:MultiHeadAttention", None, ["rows-sum-to-one", "head-concat-equivalence",
                                                             "matches-reference"]),
    ("examples/serving_kernels.py:decode_kernel", None, None),
    ("tests/gallery/serving.py:decode_tail_read", "decode", None),
    ("tests/gallery/trivial_targets.py:returns_zeros", None, ["matches-reference", "permutation-equivariance"]),
]
UNDIAGNOSED = [
    ("tests/gallery/core.py:no_scale", None, ["matches-reference"]),
    ("tests/gallery/core.py:float32_inside", None, ["matches-reference"]),
    ("tests/gallery/ecosystem.py:bshd_transposes_heads", "sdpa", ["matches-reference"]),
    ("tests/gallery/core.py:ignores_mask", None, ["matches-reference"]),
    ("tests/gallery/core.py:softmax_over_queries", None, ["matches-reference"]),
]
LEFT_OUT = {"seconds", "kit_version", "torch_version"}  # timings and versions: not the report's content


def reports() -> list[dict]:
    """The JSON report of each target, checked at seed 0 with the quick profile on the CPU."""
    import torch

    import attn_spec

    torch.set_num_threads(1)
    out = []
    for diagnose, targets in ((True, TARGETS), (False, UNDIAGNOSED)):
        for target, convention, only in targets:
            report = attn_spec.check(target, convention=convention, profile="quick", seed=0, only=only,
                                     devices=["cpu"], diagnose=diagnose)
            out.append(_clean(json.loads(report.to_json())))
    return out


def _clean(value):
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if k not in LEFT_OUT}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    if isinstance(value, str):  # paths in tracebacks and evidence: the same from any checkout
        return value.replace(str(ROOT), "<repo>")
    return value


def _differences(got, want, where="") -> list[str]:
    """Where ``got`` and ``want`` differ: dict keys in any order, floats within rounding."""
    if isinstance(want, dict) and isinstance(got, dict):
        if set(got) != set(want):
            return [f"{where}: keys {sorted(set(got) ^ set(want))} differ"]
        return [d for k in want for d in _differences(got[k], want[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items, snapshot {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in _differences(g, w, f"{where}[{i}]")]
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        if math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12) or (math.isnan(want) and math.isnan(got)):
            return []
    elif got == want:
        return []
    return [f"{where}: {got!r} != snapshot {want!r}"]


@pytest.mark.slow
def test_the_json_report_matches_the_snapshot():
    want = json.loads(SNAPSHOT.read_text(encoding="utf-8"))
    got = reports()
    assert [t["targets"][0]["target"] for t in got] == [t for t, _, _ in TARGETS + UNDIAGNOSED]
    assert _differences(got, want) == []


def test_the_comparison_sees_a_change_but_not_key_order_or_rounding():
    want = {"a": [1.0, {"b": "x", "c": 2}], "d": None}
    assert _differences({"d": None, "a": [1.0 + 1e-9, {"c": 2, "b": "x"}]}, want) == []
    assert _differences({"d": None, "a": [1.1, {"c": 2, "b": "x"}]}, want) == [".a[0]: 1.1 != snapshot 1.0"]
    assert _differences({"d": None, "a": [1.0, {"c": 2, "b": "y"}]}, want) == [".a[1].b: 'y' != snapshot 'x'"]
    assert _differences({"a": [1.0, {"c": 2, "b": "x"}]}, want) == [": keys ['d'] differ"]


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    SNAPSHOT.parent.mkdir(exist_ok=True)
    lines = (json.dumps(r, sort_keys=True, ensure_ascii=False, separators=(",", ":")) for r in reports())
    SNAPSHOT.write_text("[\n" + ",\n".join(lines) + "\n]\n", encoding="utf-8")  # one report a line
