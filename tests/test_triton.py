"""Triton kernels checked on a CPU (issue 35's runtime): tests/gallery/triton_kernels.py under Triton's interpreter.

With no flags the kit imports a module that imports triton under TRITON_INTERPRET=1 (no CUDA device here), says
so in the header, leaves bfloat16 out where the interpreter's tl.dot gets it wrong, and runs each call in a forked
child, so that a kernel that corrupts the heap fails its case instead of killing the check. The interpreter is
slow (a call is 0.05 s in the kit's process, 0.2 s in a child): each bug is checked with the property that catches
it, at the quick profile. Skipped where triton is not installed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:  # not imported here: Triton reads TRITON_INTERPRET as it imports
    pytest.skip("triton is not installed", allow_module_level=True)
if torch.cuda.is_available():  # the interpreter is what these tests are about
    pytest.skip("a CUDA device is present: Triton kernels run compiled, not under the interpreter",
                allow_module_level=True)

import attn_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KERNELS = ROOT / "tests" / "gallery" / "triton_kernels.py"
EXAMPLE = ROOT / "examples" / "triton_attention.py"
pytestmark = pytest.mark.slow  # each check runs a Triton kernel under the interpreter: tens of seconds


def check(name: str, *only: str, path: Path = KERNELS, **options):
    report = attn_spec.check(f"{path}:{name}", profile="quick", seed=0, only=list(only) or None, **options)
    return report.targets[0]


def failing(target) -> dict:
    return {r.id: r for r in target.properties if r.status == "fail"}


def test_the_example_conforms_under_the_interpreter_and_says_so():
    """No flags: the header names the interpreter and what it does not reproduce; bfloat16 is left out with the
    platform's reason (triton #11584), not charged to the kernel; the verdict is CONFORMS."""
    target = check("attention", "matches-reference", "causal-mask", "is-causal", path=EXAMPLE)
    assert target.conforms, [(r.id, r.message) for r in target.properties if r.status == "fail"]
    notes = "\n".join(target.notes)
    assert "Triton's interpreter (TRITON_INTERPRET=1: no CUDA device)" in notes
    assert "no TF32" in notes and "out-of-bounds loads return host memory" in notes
    assert "bfloat16: left out: Triton's interpreter computes tl.dot on bfloat16 wrongly" in notes
    assert target.behaviours["causal-alignment"] == "bottom-right"


def test_the_gallery_kernel_is_the_example():
    """The gallery's correct kernel and examples/triton_attention.py compute the same numbers (the gallery's copy
    differs only by its bug switches)."""
    os.environ["TRITON_INTERPRET"] = os.environ.get("TRITON_INTERPRET") or "1"  # as the kit sets it, before triton
    modules = []
    for path in (KERNELS, EXAMPLE):
        spec = importlib.util.spec_from_file_location(f"triton_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        modules.append(module)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 19, 5, generator=gen), torch.randn(2, 23, 5, generator=gen),
               torch.randn(2, 23, 3, generator=gen))
    for causal in (False, True):
        assert torch.equal(modules[0].attention(q, k, v, is_causal=causal), modules[1].attention(q, k, v, is_causal=causal))


# variant -> the property that catches it at the quick profile, with no flags
CAUGHT = {
    "drops_tail_rows": "matches-reference",  # every row of a length under BLOCK_M = 16 is never written
    "k_with_v_strides": "matches-reference",  # d_v != d_k: K's rows read d_v apart
    "half_partials": "matches-reference",  # float32 inputs, float16 partial outputs: errors of 1e-4 against 1e-6
}


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_each_bug_fails_the_property_that_exists_for_it(name):
    target = check(name, CAUGHT[name])
    assert CAUGHT[name] in failing(target), [(r.id, r.status, r.message) for r in target.properties]


def test_cross_attention_reading_n_q_keys_is_caught():
    target = check("self_length", "matches-reference", "cross-attention-shapes")
    assert {"matches-reference", "cross-attention-shapes"} & set(failing(target))
    assert [d.mistake for d in target.diagnoses] == ["keys-cut-to-queries"]  # not a hard-coded causal mask


def test_top_left_causal_fails_where_bottom_right_is_required():
    """Causal alignment is a behaviour (probed, reported, never punished) until the user requires one."""
    target = check("top_left_causal", "is-causal", require=["causal-alignment=bottom-right"])
    assert target.behaviours["causal-alignment"] == "top-left"
    assert not target.conforms
    assert "causal-alignment" in " ".join(r.id + r.message for r in target.properties if r.status == "fail")


def test_an_out_of_bounds_store_fails_its_case_and_the_report_comes_out():
    """The unmasked tail store corrupts the heap: its child dies (SIGABRT at a later free), the failure names it,
    the other property is still reported, and the command exits 1 (a finding), not by a signal."""
    done = subprocess.run([sys.executable, "-m", "attn_spec", "check", f"{KERNELS}:unmasked_store", "--profile",
                           "quick", "--seed", "0", "--only", "matches-reference", "rows-sum-to-one"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT,
                          env={key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"})
    assert done.returncode == 1, done.stderr[-2000:]
    assert "the process died: SIG" in done.stdout and "likely an out-of-bounds store" in done.stdout
    assert "DOES NOT CONFORM" in done.stdout and "rows-sum-to-one" in done.stdout
    assert "free(): " not in done.stderr  # glibc's last words are in the failure, not on the terminal


def test_a_kernel_that_asserts_its_head_dims_conforms_within_them():
    target = check("pow2_head_dims", "matches-reference")
    assert target.conforms, [(r.id, r.message) for r in target.properties if r.status == "fail"]
    assert "within head dims 16/32/64/128/256" in [e["phrase"] for e in target.envelope]  # its assert, in a child
