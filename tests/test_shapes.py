"""Checking a target at fixed shapes (``--shapes``, ``shapes=``, ``--attn-shapes``, the scale profile):
shape parsing, which properties apply there, a blocked kernel whose bug only a long sequence shows,
and the kit's own memory at 4k keys."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch.nn.functional as F

import attn_spec
from attn_spec import properties
from attn_spec.checking import chunked, shapes
from attn_spec.checking.cases import Case, MhaCase
from attn_spec.checking.shapes import Rung, Shape
from attn_spec.cli import main
from attn_spec.diagnosis.run import replayable
from attn_spec.errors import Failure, KitUsageError

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = f"{ROOT / 'examples' / 'blocked_attention.py'}"
SDPA = "torch.nn.functional:scaled_dot_product_attention"
sys.path.insert(0, str(ROOT / "examples"))
import blocked_attention  # noqa: E402


def test_shapes_parse_in_every_form():
    assert Shape.parse("1,8,4096,128") == Shape(1, 8, 8, 4096, 4096, 128)
    assert Shape.parse("1,8,1,4096,128") == Shape(1, 8, 8, 1, 4096, 128)  # B,H,NQ,NKV,D: cross attention
    assert str(Shape.parse("1,8,1,4096,128")) == "1,8,1,4096,128"
    assert Shape.parse("2,32,8,1,32768,128") == Shape(2, 32, 8, 1, 32768, 128)
    assert Shape.parse((1, 2, 3, 4)) == Shape(1, 2, 2, 3, 3, 4)
    assert str(Shape.parse("1,8,4096,128")) == "1,8,4096,128"
    assert str(Shape.parse("2,32,8,1,32768,128")) == "2,32,8,1,32768,128"


@pytest.mark.parametrize("text", ["1,8,4096", "1,8,0,64", "1,a,4,4", "1,8,3,16,16,64", "", "1,2,3,4,5,6,7",
                                  "1,2,3,4,page=0"])
def test_bad_shapes_are_usage_errors_naming_the_shape(text):
    with pytest.raises(KitUsageError) as info:
        Shape.parse(text)
    assert repr(text) in str(info.value)


def test_rungs_default_to_the_preferred_device_and_its_dtypes():
    rungs = shapes.rungs(["1,2,64,8"])
    assert [str(r) for r in rungs] == [f"1,2,64,8 {d} {shapes.preferred_device()}"
                                       for d in shapes.DEVICE_DTYPES[shapes.preferred_device()]]
    assert [r.dtype for r in shapes.rungs(["1,2,64,8"], dtypes=["float64", "bfloat16"], devices=["cpu"])] == \
        ["float64", "bfloat16"]


def test_the_scale_ladder_on_the_cpu():
    ladder = shapes.ladder("cpu")
    assert sorted({s.n_kv for s in ladder}) == [1024, 4096, 16384]
    assert sorted({s.d for s in ladder}) == [64, 128, 256]
    assert all(s.n_q == s.n_kv for s in ladder) and len(ladder) == 9
    assert max(s.n_kv for s in shapes.ladder("cuda")) == 131072
    assert shapes.rungs(None, devices=["cpu"]) == [Rung(s, "float32", "cpu") for s in ladder]


def test_each_property_either_has_cases_at_fixed_shapes_or_says_why_not():
    rung = Rung(Shape.parse("1,4,2,8,16,4"), "float32", "cpu")
    for prop in properties.catalog().values():
        made = shapes.fixed_cases(prop, "function", rung, seed=1)
        if isinstance(made, str):
            assert len(made) > 20, prop.id
            continue
        for case in made:
            if case.segments:  # a varlen property: B = 1 packed sequence of 8 queries over 16 keys, 4 heads over 2
                assert (case.batch, case.segments, case.kv_heads, case.d_k) == ((4,), ((8, 16),), 2, 4), prop.id
                continue
            assert (case.batch, case.n_q, case.n_kv, case.d_k, case.dtype) == ((1, 4), 8, 16, 4, "float32")
            if case.cache_lengths:  # a decode property: 1 sequence of 16 tokens, the last 8 decoded, 4 heads over 2
                assert (case.cache_lengths, case.kv_heads) == ((16,), 2), prop.id
                continue
            assert case.kv_heads == (2 if prop.id == "gqa-equivalence" else 0)
    grouped = properties.catalog()["gqa-equivalence"]
    assert "HKV < H" in shapes.fixed_cases(grouped, "sdpa", Rung(Shape.parse("1,4,8,4"), "float32", "cpu"), 1)
    module = shapes.fixed_cases(properties.catalog()["determinism"], "module", rung, 1)
    assert module == [MhaCase(n_q=8, n_kv=16, d_model=16, n_heads=4, dtype="float32", seed=1)]


def test_past_a_gibibyte_per_mask_no_square_mask_is_built_at_a_fixed_shape():
    """At 64k keys a causal [n, n] bool mask is 4 GiB (16 GiB as a target's float bias): the kit keeps O(n d) memory,
    so causal-mask says why it is not checked there and gradients keeps its unmasked case; at 16k both are built."""
    causal, grads = properties.catalog()["causal-mask"], properties.catalog()["gradients"]
    long = Rung(Shape.parse("1,1,65536,64"), "float32", "cpu")
    reason = shapes.fixed_cases(causal, "sdpa", long, 1)
    assert isinstance(reason, str) and "[65536, 65536], 4 GiB of bool" in reason and "is-causal" in reason
    assert [c.mask for c in shapes.fixed_cases(grads, "sdpa", long, 1)] == ["none"]
    rung = Rung(Shape.parse("1,1,16384,64"), "float32", "cpu")
    assert [c.mask for c in shapes.fixed_cases(causal, "sdpa", rung, 1)] == ["causal"]
    assert [c.mask for c in shapes.fixed_cases(grads, "sdpa", rung, 1)] == ["none", "causal"]


def test_grouped_case_draws_fewer_key_value_heads():
    q, k, v, mask = Case(batch=(2, 4), kv_heads=2, n_q=3, n_kv=5, d_k=2, d_v=3, mask="padding").tensors()
    assert (q.shape, k.shape, v.shape, mask.shape) == ((2, 4, 3, 2), (2, 2, 5, 2), (2, 2, 5, 3), (2, 4, 1, 5))
    assert "K [2, 2, 5, 2]" in Case(batch=(2, 4), kv_heads=2, n_q=3, n_kv=5, d_k=2, d_v=3).summary()


def test_a_check_at_fixed_shapes_runs_the_properties_that_apply_and_skips_the_rest():
    report = attn_spec.check(F.scaled_dot_product_attention, shapes=["1,4,2,48,300,16"], seed=3)
    target = report.targets[0]
    status = {p.id: p for p in target.properties}
    assert report.conforms, str(report)
    assert report.shapes == ["1,4,2,48,300,16"] and report.devices == [shapes.preferred_device()]
    assert json.loads(report.to_json())["shapes"] == ["1,4,2,48,300,16"]
    for pid in ("matches-reference", "causal-mask", "gqa-equivalence", "numerical-stability", "gradients",
                "is-causal", "determinism", "dtype-device", "inputs-unchanged", "scale-sqrt-dk"):
        assert status[pid].status == "pass" and status[pid].examples >= 1, pid
    assert status["matches-reference"].examples == 2  # no mask and a padding mask
    for pid in ("mask-semantics", "long-sequences", "value-linearity"):
        assert (status[pid].status, status[pid].message) == ("skip", properties.catalog()[pid].at_scale)
    assert "shapes 1,4,2,48,300,16" in str(report)


@pytest.mark.slow
def test_a_bug_only_long_sequences_expose_is_caught_at_a_long_shape_with_its_cause():
    """The blocked kernel drops a last partial block of 1024 keys: every case the default profile draws (up to 640
    keys, in long-sequences) fits in one block, but not matches-reference's long example (1531 keys, issue 33),
    and a --shapes case of any length finds it too, with its cause."""
    drawn = attn_spec.check(blocked_attention.drops_last_block, profile="default", seed=5,
                            only=["matches-reference", "long-sequences"])
    results = {p.id: p for p in drawn.targets[0].properties}
    assert results["long-sequences"].status == "pass", str(drawn)
    assert results["matches-reference"].status == "fail"
    assert results["matches-reference"].cause.startswith("keys beyond the first 1024 are silently dropped")
    long = attn_spec.check(blocked_attention.drops_last_block, shapes=["1,1,1,256,2600,64"], seed=5,
                           only=["matches-reference"])
    result = long.targets[0].properties[0]
    assert result.status == "fail" and "K [1, 1, 2600, 64]" in result.message
    # 2600 = 2 x 1024 + 552: the diagnosis's one case cannot tell a loop that skips the partial block of
    # 1024 from a buffer of 2048 key slots, and names what both do
    assert result.cause.startswith("keys beyond the first 2048 are silently dropped") and "partial block" in result.cause
    correct = attn_spec.check(blocked_attention.attention, shapes=["1,1,1,256,2600,64"], seed=5,
                              only=["matches-reference"])
    assert correct.conforms, str(correct)


def test_the_reproduction_of_a_fixed_shape_failure_rebuilds_its_case(capsys):
    code = main(["check", f"{BLOCKED}:drops_last_block", "--shapes", "1,1,1,8,1100,4", "--only", "matches-reference",
                 "--seed", "2", "--format", "json"])
    assert code == 1
    ce = json.loads(capsys.readouterr().out)["targets"][0]["properties"][0]["counterexample"]
    assert ce["case"]["n_kv"] == 1100 and ce["case"]["batch"] == [1, 1]
    assert "kv_heads" not in ce["reproduce"]  # a default field is left out of the snippet
    with pytest.raises(Failure, match="last 76 keys are ignored"):
        exec(ce["reproduce"], {})  # the snippet as printed: the same case, the same failure


def test_a_failure_too_long_to_replay_keeps_its_property_cause():
    """The diagnosis's mistake models replay a case with all its scores at once: beyond one chunk of scores
    (2048 x 1100 here) the failure is not replayed and keeps the cause found on a few of its rows."""
    assert replayable(Case(batch=(1, 1), n_q=256, n_kv=2600)) and not replayable(Case(batch=(1, 1), n_q=2048, n_kv=1100))
    report = attn_spec.check(blocked_attention.drops_last_block, shapes=["1,1,1,2048,1100,4"], seed=2,
                             only=["matches-reference"])
    result = report.targets[0].properties[0]
    assert result.status == "fail" and report.targets[0].diagnoses == []
    assert result.cause.startswith("the last 76 keys are ignored: the loop over key blocks of")  # 128 or 1024


def test_bad_shapes_on_the_command_line_exit_2(capsys):
    assert main(["check", SDPA, "--shapes", "1,8,64"]) == 2
    assert "'1,8,64'" in capsys.readouterr().err


def test_the_scale_profile_checks_its_ladder(monkeypatch):
    monkeypatch.setitem(shapes.SCALE_LENGTHS, "cpu", (40, 70))
    monkeypatch.setattr(shapes, "SCALE_HEAD_DIMS", (8,))
    report = attn_spec.check(F.scaled_dot_product_attention, profile="scale", seed=1, devices=["cpu"],
                             only=["matches-reference", "gqa-equivalence"])
    assert report.conforms and report.shapes == ["1,2,1,40,40,8", "1,2,1,70,70,8"] and report.dtypes == ["float32"]
    assert [p.examples for p in report.targets[0].properties] == [4, 2]


MEMORY = """
import json, resource, sys
import torch
from attn_spec.checking import chunked, shapes
from attn_spec.cli import main
from attn_spec.properties import catalog

def peak():  # bytes: the process's high-water mark of resident memory (every allocator: torch, Python, glibc)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

shape, only = sys.argv[1], sys.argv[2:]
target = torch.nn.functional.scaled_dot_product_attention
args = ["check", "torch.nn.functional:scaled_dot_product_attention", "--only", *only, "--seed", "0", "--device", "cpu"]
main(args + ["--shapes", "1,2,1,8,64,16"])  # warm: every import, every kernel's first call
for pid in only:  # the target's own work on every case it gets: inputs, output, workspace, gradients
    for case in shapes.fixed_cases(catalog()[pid], "sdpa", shapes.Rung(shapes.Shape.parse(shape), "float32", "cpu"), 0):
        q, k, v, mask = (t if t is None else t.requires_grad_(t.is_floating_point()) for t in case.tensors())
        out = target(q, k, v, attn_mask=mask)
        out.sum().backward()
        del q, k, v, mask, out
base = peak()
code = main(args + ["--shapes", shape])
print(json.dumps({"code": code, "added": peak() - base, "chunk": chunked.CHUNK_BYTES["cpu"]}))
"""


@pytest.mark.slow
def test_a_4k_key_check_adds_memory_linear_in_n_times_d():
    """The kit's added peak memory at 4096 keys stays within O(chunk x n_kv + n x d).

    Measured in a fresh process as the rise of ru_maxrss (the high-water mark of resident memory,
    which sees torch's CPU allocations as well as Python's: tracemalloc sees only Python's) over a
    baseline that already holds the target's own peak on the same inputs. The bound: a few chunks
    (scores, weights and the naive forms' buffers) plus some float64 copies of [B, H, n, d]
    (Q, K, V, the reference, the outputs compared) and 32 MiB of slack. The one-shot float64
    reference alone would hold [n, n] scores and weights per head: 256 MiB per head at 4k keys."""
    b, h, n, d = 1, 1, 4096, 64
    result = subprocess.run([sys.executable, "-c", MEMORY, f"{b},{h},{n},{d}", "matches-reference", "gradients"],
                            capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["code"] == 0, result.stdout
    bound = 8 * measured["chunk"] + 24 * b * h * n * d * 8 + 32 * 2**20
    assert measured["added"] <= bound, f"added {measured['added'] / 2**20:.0f} MiB, bound {bound / 2**20:.0f} MiB"
    assert bound < 2 * 8 * n * n * h  # the bound would not let the one-shot scores and weights through
    assert not chunked.fits(*Case(batch=(b, h), n_q=n, n_kv=n, d_k=d, d_v=d).tensors())  # the chunked path ran
