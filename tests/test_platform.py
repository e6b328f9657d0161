"""The platform control (attn_spec.checking.platform): a failure that the kit's own plain formula shows too,
on exactly the inputs the target got, is the platform's, not the target's.

The defect is injected (``broken_bf16``: matmul and F.linear return NaN for a bfloat16 operand that is a
strided view with gaps, as torch 2.13's oneDNN does on CPUs with AVX512-BF16/AMX for some shapes), so
these tests hold on any CPU; the last one runs the case of the issue on this CPU and skips where the
CPU does not show it."""
import json
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import attn_spec
from attn_spec.checking import platform
from attn_spec.checking.cases import Case
from attn_spec.properties import catalog
from attn_spec.cli import main
from attn_spec.errors import Failure
from attn_spec.targets.conventions import make_target
from attn_spec.targets.loading import load_target

ROOT = Path(__file__).resolve().parents[1]
SEED = f"{ROOT / 'examples' / 'seed_attention.py'}:attention"
BF16 = ["--dtypes", "float32", "bfloat16", "--profile", "quick", "--seed", "3", "--format", "json"]
FIELDS = {"what", "torch", "device", "dtype", "shapes", "reproduce"}


def _with_gaps(t) -> bool:
    """A strided view neither row- nor column-major (a slice of a padded buffer), innermost stride 1."""
    return (isinstance(t, torch.Tensor) and t.dim() >= 2 and not t.is_contiguous()
            and not t.transpose(-2, -1).is_contiguous() and t.stride(-1) == 1)


def _broken(op, everywhere=False):
    def call(a, b, *args, **kwargs):
        out = op(a, b, *args, **kwargs)
        if out.dtype == torch.bfloat16 and (everywhere or _with_gaps(a) or _with_gaps(b)):
            return torch.full_like(out, math.nan)
        return out
    return call


@pytest.fixture
def broken_bf16(monkeypatch):
    """bfloat16 matmul (``@``) and F.linear give NaN when an operand is a strided view with gaps."""
    monkeypatch.setattr(torch.Tensor, "__matmul__", _broken(torch.Tensor.__matmul__))
    monkeypatch.setattr(F, "linear", _broken(F.linear))


def _padded(t):  # the issue's layout: every other row and an inner column range of a NaN buffer
    buf = torch.full((2 * t.shape[0], t.shape[1] + 2), math.nan, dtype=t.dtype)
    view = buf[::2, 1:-1]
    view.copy_(t)
    return view


def _report(capsys, argv) -> tuple[int, dict]:
    code = main(["check", *argv])
    return code, json.loads(capsys.readouterr().out)


def test_the_injected_defect_fails_the_target_itself(broken_bf16):
    """Without the control, the correct seed attention fails non-contiguous: the injection bites."""
    target = make_target(load_target(SEED), "seed", "function")
    with pytest.raises(Failure, match="NaN"):
        catalog()["non-contiguous"].fn(target, Case(n_q=3, n_kv=4, d_k=3, d_v=2, dtype="bfloat16", seed=1))


def test_a_correct_function_conforms_with_one_platform_note(broken_bf16, capsys):
    code, report = _report(capsys, [SEED, "--only", "non-contiguous", *BF16])
    assert code == 0 and report["conforms"], report["targets"][0]["properties"]
    (note,) = report["platform"]
    assert FIELDS <= set(note) and note["dtype"] == "bfloat16" and note["torch"] == torch.__version__
    assert note["properties"] == ["non-contiguous"] and note["cases"] >= 1
    assert "strided inputs" in note["what"] and note["device"].startswith("cpu")
    assert "goes away with contiguous copies" in note["workaround"]
    assert "stays under torch.backends.mkldnn.flags(enabled=False)" in note["workaround"]  # the injection ignores it
    (prop,) = report["targets"][0]["properties"]
    assert prop["status"] == "pass" and "lost to a platform defect" in prop["message"]
    assert report["targets"][0]["diagnoses"] == []
    # the snippet is torch alone, and shows the defect where the platform has it (here: the injection)
    assert "attn_spec" not in note["reproduce"].replace("attn-spec", "")
    namespace = {}
    with warnings.catch_warnings():  # torch warns about TF32 on oneDNN whenever its flags are set
        warnings.simplefilter("ignore")
        exec(compile(note["reproduce"], "<snippet>", "exec"), namespace)
    assert namespace["broken"] is True
    capsys.readouterr()
    assert main(["check", SEED, "--only", "non-contiguous", *BF16[:-2]]) == 0
    text = capsys.readouterr().out
    assert text.count("platform defect, not the target's") == 1 and "reproduce (torch alone" in text
    assert main(["check", SEED, "--only", "non-contiguous", *BF16[:-1], "markdown"]) == 0
    assert capsys.readouterr().out.count("**platform defect, not the target's") == 1
    html = attn_spec.check(SEED, only=["non-contiguous"], dtypes=["float32", "bfloat16"], profile="quick", seed=3)._repr_html_()
    assert html.count("platform defect, not the target&#x27;s") == 1 and "<pre>" in html


def test_a_module_through_its_projections_conforms_with_a_platform_note(broken_bf16, capsys):
    code, report = _report(capsys, ["torch.nn:MultiheadAttention", "--only", "non-contiguous", *BF16])
    assert code == 0 and report["conforms"], report["targets"][0]["properties"]
    # the injection also bites the heads split as views ([H, T, D/H] with gaps), contiguous inputs or not
    assert {n["what"].split(" gives ")[0] for n in report["platform"]} == {"the kit's own plain bfloat16 multi-head attention"}
    assert any("strided inputs" in n["what"] for n in report["platform"])


@pytest.mark.slow
def test_a_property_that_loses_every_case_is_not_checked(monkeypatch, capsys):
    monkeypatch.setattr(torch.Tensor, "__matmul__", _broken(torch.Tensor.__matmul__, everywhere=True))
    code, report = _report(capsys, [SEED, "--only", "matches-reference", "--dtypes", "bfloat16", *BF16[3:]])
    status = {p["id"]: (p["status"], p["message"]) for p in report["targets"][0]["properties"]}
    assert code == 1 and report["targets"][0]["verdict"].startswith("NOTHING CHECKED")  # never a pass
    assert status["matches-reference"][0] == "skip", status
    assert status["matches-reference"][1].startswith("not checked: ") and "lost to a platform defect" in \
        status["matches-reference"][1]
    # first seen on matches-reference's first example, the [B, H, n, d] heads case laid out as strided views
    assert "strided inputs" in report["platform"][0]["what"] and "stays with contiguous copies" in \
        report["platform"][0]["workaround"]


def test_a_buggy_target_still_fails_with_its_own_root(broken_bf16):
    sys.path.insert(0, str(ROOT / "tests"))
    from gallery.robustness import scales_keys_through_view

    report = attn_spec.check(scales_keys_through_view, convention="function", only=["non-contiguous"],
                             dtypes=["float32", "bfloat16"], profile="quick", seed=3)
    (target,) = report.targets
    assert not target.conforms
    assert [d.mistake for d in target.diagnoses] == ["view-on-strided-keys"]


def test_reproduce_gives_the_platform_note(broken_bf16, capsys):
    case = Case(n_q=3, n_kv=4, d_k=3, d_v=2, dtype="bfloat16", seed=1)
    attn_spec.reproduce("non-contiguous", SEED, case)  # does not raise
    out = capsys.readouterr().out
    assert out.startswith("non-contiguous on ") and "platform defect, not the target's" in out
    assert "reproduce (torch alone, no attn-spec code):" in out


def test_the_control_is_silent_where_the_platform_is_sound_or_the_dtype_overflows():
    q, k, v = (torch.randn(5, 8, dtype=torch.bfloat16) for _ in range(3))
    assert platform.control([("attend", {"q": _padded(q), "k": _padded(k), "v": v, "mask": None})]) is None
    big = torch.full((4, 8), 300.0, dtype=torch.float16)  # scores of 720000: float16's own overflow, no defect
    assert platform.control([("attend", {"q": big, "k": big, "v": big[:, :2], "mask": None})]) is None


def test_the_issues_case_on_this_cpu_is_a_platform_note(capsys):
    """The issue's minimal case, on this CPU's torch: a platform note where the CPU shows the defect, also
    through attn_spec.reproduce (non-contiguous lays Q and K out as the issue's padded_view does)."""
    Q, K = torch.ones(17, 59, dtype=torch.bfloat16), torch.ones(5, 59, dtype=torch.bfloat16)
    if not (_padded(Q) @ _padded(K).T).isnan().any():
        pytest.skip(f"this CPU ({torch.backends.cpu.get_cpu_capability()}) does not show the defect")
    V = torch.ones(5, 4, dtype=torch.bfloat16)
    found = platform.control([("attend", {"q": _padded(Q), "k": _padded(K), "v": V, "mask": None})])
    assert found is not None and found[3] == "the output" and found[4].startswith("NaN")
    attn_spec.reproduce("non-contiguous", SEED, Case(n_q=17, n_kv=5, d_k=59, d_v=4, dtype="bfloat16",
                                                     values="normal", seed=1))
    assert "platform defect, not the target's" in capsys.readouterr().out


@pytest.mark.parametrize("form", ["Q scaled first", "scores scaled"])
def test_the_snippets_own_formula_is_the_reference_s_rules(form):
    """The reproduce snippet runs without the kit, so it writes attention out; its text (and the control's formula,
    which reads grouped heads through views to keep the target's layout) is checked here against reference.py's
    rules: grouped K/V heads (query head h reads K/V head h // g, reference.repeat_kv) and a bool
    mask with a row that sees no key (the snippet's NaN there is judged as the reference's free row)."""
    from attn_spec.checking import platform_snippet as snippet
    from attn_spec.reference import attention, repeat_kv

    scale = 0.5
    scores = f"(q * {scale!r}) @ k.transpose(-2, -1)" if form == "Q scaled first" else \
        f"q @ k.transpose(-2, -1) * {scale!r}"
    code = snippet.HEAD + snippet.ATTENTION.format(form=form, scores=scores, cap="",
                                                   tail=snippet.TAILS["exp" if form == "Q scaled first" else "softmax"])
    namespace = {}
    exec(compile(code, "<snippet>", "exec"), namespace)  # noqa: S102 - the kit's own template
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 3, 2, generator=g, dtype=torch.float64)  # [B, H = 4, Tq, D]
    k, v = (torch.randn(1, 2, 5, 2, generator=g, dtype=torch.float64) for _ in range(2))  # H_kv = 2
    mask = torch.rand(1, 4, 3, 5, generator=g) > 0.4  # [B, H, Tq, Tk]
    mask[..., 0, :] = False  # row 0 sees no key
    got = namespace["attention"](q, k, v, mask)
    want = attention(q, repeat_kv(k, 2), repeat_kv(v, 2), mask, scale=scale)[0]
    assert got[..., 0, :].isnan().all()  # the plain formula's 0/0, where the reference gives 0
    torch.testing.assert_close(got[..., 1:, :], want[..., 1:, :], rtol=0, atol=1e-12)
    tiled = attention(q, k.repeat(1, 2, 1, 1), v.repeat(1, 2, 1, 1), mask, scale=scale)[0]
    assert (got[..., 1:, :] - tiled[..., 1:, :]).abs().max() > 1e-3  # the check tells blocked from tiled
    kits = platform.formula(form)(q, k, v, mask, scale=scale)  # the control's formula: grouped through views
    torch.testing.assert_close(kits[..., 1:, :], want[..., 1:, :], rtol=0, atol=1e-12)
