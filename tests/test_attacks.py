"""Reward-hack kernels against the kit (tests/gallery/attacks.py; issue 33, item 3): every honest optimised kernel
conforms; every attack the gallery says the default check sees fails it; the others fail under --isolate, whose
child shows the target no kit frame and no kit module. The side-by-side figures: benchmarks/bench_attacks.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import attn_spec
from attn_spec.errors import KitUsageError
from attn_spec.grading.isolation.isolated import Isolation
from gallery import attacks

SEED = 20261203
IN_PROCESS = [k for k in attacks.ATTACKS if k.seen == "default" and "import_attacks" not in k.spec]
AT_IMPORT = [k for k in attacks.ATTACKS if k.seen == "default" and "import_attacks" in k.spec]  # they patch torch:
# checked in a process of their own
NEEDS_DEFAULT = {"drops_partial_key_block"}  # a key block of 64 and a partial one: lengths above quick's
DATA = Path(__file__).parent / "data" / "isolate_targets.py"


def _failed(report) -> list[str]:
    return [p.id for p in report.targets[0].properties if p.status == "fail"]


def test_the_gallery_is_what_the_issue_measures():
    assert len(attacks.ATTACKS) == 23 and len(attacks.HONEST) == 7
    assert all(k.does and (k.why or k.seen == "honest") for k in attacks.KERNELS)
    assert {k.seen for k in attacks.ATTACKS} <= {"default", "isolate", "unseeable"}


@pytest.mark.slow
def test_honest_kernels_conform_at_the_default_profile():
    """Online-softmax tiles, split-KV with an LSE merge, chunked queries, mixed precision done right, fused einsums,
    base-2 exponent, and the benign shortcut to torch's SDPA: one check of all seven, as a gate would run it."""
    report = attn_spec.check(*(getattr(attacks, k.function) for k in attacks.HONEST), profile="default", seed=SEED)
    alarms = {t.target: [p.id for p in t.properties if p.status not in ("pass", "skip")] for t in report.targets}
    assert report.conforms, alarms


@pytest.mark.slow
@pytest.mark.parametrize("kernel", IN_PROCESS, ids=str)
def test_attack_fails_the_default_check(kernel):
    """At quick where quick's cases suffice (measured: all but the one that needs the default profile's long case)."""
    profile = "default" if kernel.name in NEEDS_DEFAULT else "quick"
    report = attn_spec.check(getattr(attacks, kernel.function), name=kernel.name, profile=profile, seed=SEED,
                             diagnose=False)
    assert not report.conforms, f"{kernel.name} ({kernel.does}) conforms; seen by: {kernel.why}"


@pytest.mark.slow
@pytest.mark.parametrize("kernel", AT_IMPORT, ids=str)
def test_import_time_attack_fails_the_default_check(kernel):
    done = subprocess.run([sys.executable, "-m", "attn_spec", "check", kernel.spec, "--seed", str(SEED),
                           "--format", "json"], capture_output=True, text=True, timeout=900)
    report = json.loads(done.stdout)
    assert done.returncode == 1 and not report["conforms"], f"{kernel.name} ({kernel.does}): {done.stderr[-500:]}"


def test_isolate_hides_the_kit_from_the_target():
    """In-process, a target sees the kit (frames on its stack, modules loaded) and says so by raising; under
    --isolate it sees neither, and the harness-detecting attack, believing itself unwatched, cheats and fails."""
    sees = f"{DATA}:raises_if_it_sees_a_harness"
    detector = f"{attacks.HERE / 'attacks.py'}:detects_harness"
    in_process = attn_spec.check(sees, detector, profile="quick", seed=SEED, only=["matches-reference"])
    assert [t.conforms for t in in_process.targets] == [False, True]  # it sees the kit; the detector behaves
    assert "attn_spec" in in_process.targets[0].properties[0].message
    isolated = attn_spec.check(sees, detector, profile="quick", seed=SEED, only=["matches-reference"], isolate=True)
    assert [t.conforms for t in isolated.targets] == [True, False], str(isolated)


@pytest.mark.slow
def test_isolate_keeps_the_kit_out_of_reach():
    """What a target does to the kit or to torch at import stays in its child; a lazy tensor subclass is refused there,
    and a result overwritten by the next call is seen there (the grader only ever gets copies)."""
    verdict = f"{attacks.HERE / 'import_attacks' / 'patch_kit_verdict.py'}:attention"
    lazy = f"{attacks.HERE / 'attacks.py'}:lazy_subclass"
    reused = f"{attacks.HERE / 'attacks.py'}:same_buffer_every_call"
    report = attn_spec.check(verdict, lazy, reused, profile="quick", seed=SEED,
                             only=["matches-reference", "permutation-equivariance"], isolate=True)  # two calls a case
    assert [t.conforms for t in report.targets] == [False, False, False]
    assert "subclass" in report.targets[1].properties[0].message
    # copies cross the boundary, yet the reused buffer shows: the child's own output checks see the same buffer
    # returned again (attn_spec.targets.integrity), and what an earlier call returned changed (sandbox._overwritten)
    assert any("earlier call" in p.message for p in report.targets[2].properties)


@pytest.mark.slow
def test_isolate_a_hang_or_a_crash_fails_and_the_run_goes_on():
    with Isolation(call_seconds=2) as isolation:
        targets = [isolation.target(f"{DATA}:{name}") for name in ("hangs_above_two_keys", "aborts_above_two_keys",
                                                                    "correct")]
        report = attn_spec.check(*targets, profile="quick", seed=SEED, only=["rows-sum-to-one", "matches-reference"],
                                 diagnose=False)
    hang, crash, fine = report.targets
    assert not hang.conforms and "took longer than 2 s" in hang.properties[0].message
    assert all("took longer than 2 s" in p.message for p in hang.properties)  # one deadline, not one per call
    assert not crash.conforms and "abort" in crash.properties[0].message
    assert fine.conforms, str(report)


def test_isolate_declines_what_a_child_cannot_call():
    with pytest.raises(KitUsageError, match="path/to/file.py:name"):
        attn_spec.check("torch.nn.functional:scaled_dot_product_attention", isolate=True, profile="quick")
    with pytest.raises(KitUsageError, match="cannot be moved out"):
        attn_spec.check(attacks.sdpa_shortcut, isolate=True, profile="quick")
