"""Agreement across devices: the same inputs give the same outputs on CPU, CUDA and MPS."""
from __future__ import annotations

from attn_spec import reference
from attn_spec.checking.assertions import assert_close
from attn_spec.checking.cases import Case, available_devices
from attn_spec.checking.catalog import Lesson, prop
from attn_spec.errors import Unsupported
from attn_spec.checking.tolerance import budget
from attn_spec.properties.informative import require_responsive
from attn_spec.failures import because


@prop("devices-agree", family="devices",
      statement="outputs on every available device agree with the CPU output within the error budget",
      after=("matches-reference",),
      at_scale="it compares with a run on the CPU of the same inputs; checked at the drawn sizes",
      examples=[Case(n_q=2, n_kv=3, d_k=4, d_v=2, device="cuda"),
                                              Case(n_q=2, n_kv=3, d_k=4, d_v=2, device="mps")],
      lesson=Lesson(unicode="|attn_dev(Q, K, V) − attn_cpu(Q, K, V)| ≤ 2 · budget",
                    latex=r"\left|\mathrm{attn}_{\mathrm{dev}}(Q,K,V) - \mathrm{attn}_{\mathrm{cpu}}(Q,K,V)\right| \le 2\,\mathrm{budget}",
                    check="Draws inputs on each non-CPU device, copies them to the CPU, and compares the two outputs.",
                    example="output"))
def devices_agree(target, case):
    """|attn_dev(Q, K, V) - attn_cpu(Q, K, V)| <= 2 * budget, for inputs drawn on a non-CPU device.

    Why: a model trained on a GPU and served on a CPU (or tested on one) must compute the same
    function. Catches: a device-specific kernel path with a different mask convention or
    precision, fused kernels that read out of bounds, NaN for finfo.min masks on one backend
    only (pytorch/pytorch#110213). Skipped on machines with the CPU alone.
    """
    if case.device == "cpu":
        alone = available_devices() == ["cpu"]
        raise Unsupported("this machine has the CPU alone: no other device to agree with" if alone else
                          "only inputs on a non-CPU device are compared with the CPU", total=alone)
    require_responsive(target, case)
    q, k, v, mask = case.tensors()
    on_device = target.attend(q, k, v, mask)  # [..., Tq, Dv]
    on_cpu = target.attend(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu())
    allowed = 2 * budget(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(),
                         reference.attention(q, k, v, mask)[0])
    assert_close(on_device, on_cpu, budget=allowed, what=f"the output on {case.device} against the CPU output",
                 call=f"attention(Q, K, V{', mask' if mask is not None else ''}) on {case.device} and on the CPU",
                 cause=because("device-differs", device=case.device),
                 labels=(f"the output on {case.device}", "the target's own output on the CPU, same inputs"))
