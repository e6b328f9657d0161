"""Conventions: behaviours that differ between correct attentions. Probed and reported, never judged,
unless a user requires one (``attn-spec check --require fully-masked=zeros``).

========================  ==================================================================
key                       values
========================  ==================================================================
``fully-masked``          what a query with no allowed key yields: nan, zeros, uniform, other
``mask-polarity``         true-attends (True = may attend), true-ignores, other
``masked-nan``            NaN in K and V at masked positions: ignored or propagates to the output
``causal-alignment``      what ``is_causal=True`` means for n_q != n_kv: top-left or bottom-right;
                          n/a where the caller's mask carries causality (function, module)
``weights-returned``      yes or no: whether the target's own API returns the weights with the
                          output (nn.MultiheadAttention does; the kit reads only the output)
``gqa-grouping``          which KV head query head h reads in grouped-query attention (Hq = g * Hkv):
                          blocked (h // g: ``repeat_interleave``, SDPA's ``enable_gqa``, Llama) or
                          tile (h % Hkv: einops ``repeat(k, 'b h n d -> b (g h) n d')``); n/a without GQA
``finite-fill``           how far a masked key's weight stays exactly 0 as allowed scores fall: exact
                          (-inf, finfo.min), ``exact below 1e6`` (a finite fill: d2l's -1e6), or leaks
                          (even at -10: the mask is wrong, mask-semantics says how)
========================  ==================================================================

A probe reports ``n/a`` when the target does not take what it needs (a mask, ``is_causal``),
``raises`` when its call raises, and ``other`` when its output is unusable (not a tensor of the
right shape). Probing never stops a check.
"""
from __future__ import annotations

import math

import torch

from attn_spec.dtypes import DTYPES
from attn_spec.errors import Failure, KitUsageError, TargetRaised, Unsupported
from attn_spec.targets.capabilities import VALUED, supports
from attn_spec.targets.envelope import declared_refusal

VALUES = {  # the values a user may require; a probe may also report "other" or "raises"
    "fully-masked": ("nan", "zeros", "uniform"),
    "mask-polarity": ("true-attends", "true-ignores"),
    "masked-nan": ("ignored", "propagates"),
    "causal-alignment": ("top-left", "bottom-right", "n/a"),
    "weights-returned": ("yes", "no"),
    "gqa-grouping": ("blocked", "tile"),
    "finite-fill": ("exact",),  # or "exact below 1eN", reported as measured
}

MEANINGS = {  # key -> (the question a probe answers, {value: what it means}); ``attn-spec explain behaviours``
    "fully-masked": ("what a query that may attend no key yields", {
        "nan": "NaN (softmax of a row of -inf: the seed's formula, plain PyTorch)",
        "zeros": "a zero output (flash-attn, SDPA's fused kernels, most serving kernels)",
        "uniform": "the mean of V (the row was masked with a large negative number, not -inf)"}),
    "mask-polarity": ("what True means in a boolean mask", {
        "true-attends": "True = may attend (the seed, SDPA)",
        "true-ignores": "True = masked out (nn.MultiheadAttention's key_padding_mask and attn_mask)"}),
    "masked-nan": ("whether NaN in K and V at masked positions reaches the output", {
        "ignored": "masked keys and values are never read into the output",
        "propagates": "0 * NaN = NaN: the weights are zero but the matmul still reads the values"}),
    "causal-alignment": ("what is_causal=True means when there are more keys than queries", {
        "top-left": "query i sees keys 0..i (SDPA's is_causal, flash-attn < 2.1)",
        "bottom-right": "query i sees keys up to n_kv - n_q + i, the last query sees every key (flash-attn >= "
                        "2.1, decoding with a KV cache)",
        "n/a": "the caller's mask carries causality (function, module)"}),
    "weights-returned": ("whether the target's own API returns the weights beside the output", {
        "yes": "it returns (output, weights), as nn.MultiheadAttention does; the kit reads the output",
        "no": "it returns the output alone"}),
    "gqa-grouping": ("which KV head query head h reads when there are g times fewer KV heads", {
        "blocked": "head h // g (repeat_interleave, SDPA's enable_gqa, Llama, Hugging Face's repeat_kv)",
        "tile": "head h % H_kv (einops repeat(k, 'b h n d -> b (g h) n d'))",
        "n/a": "the target has no grouped-query form"}),
    "finite-fill": ("how far masked keys keep exactly 0 weight as the allowed scores fall (a finite mask fill)", {
        "exact": "at every score the dtype holds (-inf, or finfo.min)",
        "exact below 1eN": "a finite fill: masked keys take weight once allowed scores reach -1eN (masked_fill(-1e6): "
                           "1e6); mask-semantics fails it only below 65504, the scores attention reaches",
        "leaks": "masked keys get weight even at small scores: mask-semantics says how"}),
}
ANSWERS = {"other": "none of the above: the output was unusable or something else",
           "raises": "the probe's call raised", "n/a": "the target does not take what the probe needs"}


def explain() -> str:
    """Every behaviour key, its question and what each value means (``attn-spec explain behaviours``)."""
    lines = ["Behaviours: what a target does where correct attentions differ. Each is probed on tiny inputs",
             "before a check and shown in the header; it is a description, never a failure. Require one with",
             "`attn-spec check ... --require KEY=VALUE` when your code depends on it.", ""]
    for key, (question, values) in MEANINGS.items():
        lines.append(f"{key}: {question}")
        generic = {} if key == "weights-returned" else ANSWERS  # read from the adapter, not probed
        lines += [f"  {value:<13} {meaning}" for value, meaning in {**values, **generic, **values}.items()]
        lines.append("")
    return "\n".join(lines)


def _inputs(dtype, device):
    """Two queries, three distinct keys, values with a nonzero mean."""
    def t(rows):
        return torch.tensor(rows, dtype=dtype, device=device)
    q = t([[1.0, 0.0], [0.0, 1.0]])  # [Tq=2, Dk=2]
    return q, t([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]), t([[1.0, 2.0], [3.0, 5.0], [4.0, -1.0]])  # K, V: [Tk=3, 2]


def fully_masked(target, dtype, device) -> str:
    """Query 0 may attend no key: NaN, zeros, the mean of V (uniform weights) or something else.

    A target that takes no mask is asked through ``is_causal`` with 3 queries over 2 keys: aligned
    bottom-right (flash-attn >= 2.1), query 0 sees no key; aligned top-left it sees key 0, and no
    row is ever empty (``n/a``)."""
    q, k, v = _inputs(dtype, device)
    try:
        mask = torch.tensor([[False, False, False], [True, True, False]], device=device)
        row = target.attend(q, k, v, mask)[0]  # [Dv]
    except Unsupported:
        q3 = torch.cat([q, q.sum(dim=0, keepdim=True)])  # [Tq=3, Dk]
        row = target.attend(q3, k[:2], v[:2], is_causal=True)[0]  # [Dv]; Unsupported: no is_causal either
        v = v[:2]
        if torch.allclose(row.detach().to("cpu", torch.float64), v[0].double().cpu(), rtol=1e-2, atol=1e-2):
            return "n/a"  # top-left: query 0 sees key 0
    row = row.detach().to("cpu", torch.float64)
    return classify_empty_row(row, v)


def classify_empty_row(row, v) -> str:
    """What one output row [Dv] of a query without keys is: nan, zeros, uniform (the mean of V [Tk, Dv]) or other."""
    if torch.isnan(row).any():
        return "nan"
    if (row == 0).all():
        return "zeros"
    if torch.allclose(row, v.double().cpu().mean(dim=0), rtol=1e-2, atol=1e-2):
        return "uniform"
    return "other"


def mask_polarity(target, dtype, device) -> str:
    """A row whose mask is True only at key 0: true-attends reads v_0 alone, true-ignores never reads it."""
    q, k, _ = _inputs(dtype, device)
    eye = torch.eye(3, dtype=dtype, device=device)  # V = I: the output row is the weight row
    w = target.attend(q[:1], k, eye, torch.tensor([[True, False, False]], device=device))[0]
    w = w.detach().to("cpu", torch.float64)  # [Tk]
    if torch.allclose(w, torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), atol=1e-2):
        return "true-attends"
    if abs(w[0].item()) < 1e-2 and abs(w[1:].sum().item() - 1) < 1e-2:
        return "true-ignores"
    return "other"


def masked_nan(target, dtype, device) -> str:
    """NaN in K and V at a key masked for every query: does it reach the output?"""
    q, k, v = _inputs(dtype, device)
    k[2], v[2] = float("nan"), float("nan")
    mask = torch.tensor([[True, True, False], [True, True, False]], device=device)
    out = target.attend(q, k, v, mask)
    return "ignored" if torch.isfinite(out).all() else "propagates"


def causal_alignment(target, dtype, device) -> str:
    """is_causal=True with 2 queries and 3 keys: query 0 sees key 0 (top-left) or keys 0 and 1 (bottom-right)."""
    q, k, _ = _inputs(dtype, device)
    w = target.attend(q, k, torch.eye(3, dtype=dtype, device=device), is_causal=True)  # V = I: [Tq=2, Tk=3] weights
    seen = w.detach().to("cpu", torch.float64).abs() > 1e-3  # [2, 3]
    if seen.tolist() == [[True, False, False], [True, True, False]]:
        return "top-left"
    if seen.tolist() == [[True, True, False], [True, True, True]]:
        return "bottom-right"
    return "other"


def gqa_grouping(target, dtype, device) -> str:
    """Q with 4 heads over K, V with 2, one key each, V of KV head j = j + 1: each query head's output
    names the KV head it reads: [1, 1, 2, 2] is blocked (h // g), [1, 2, 1, 2] is tile (h % Hkv)."""
    if target.traits is None or target.traits.multihead:
        return "n/a"  # multi-head modules take no head dims
    q, k = torch.ones(4, 1, 1, dtype=dtype, device=device), torch.ones(2, 1, 1, dtype=dtype, device=device)
    v = torch.tensor([1.0, 2.0], dtype=dtype, device=device).reshape(2, 1, 1)  # [Hkv=2, Tk=1, Dv=1]
    mask = None if "none" in supports(target, device=device).masks else torch.ones(1, 1, dtype=torch.bool, device=device)
    try:
        heads = target.attend(q, k, v, mask).detach().to("cpu", torch.float64).flatten()  # [4]
    except TargetRaised:  # unequal head counts do not broadcast: no grouped-query attention
        return "n/a"
    for name, expected in (("blocked", [1.0, 1.0, 2.0, 2.0]), ("tile", [1.0, 2.0, 1.0, 2.0])):
        if torch.allclose(heads, torch.tensor(expected, dtype=torch.float64), atol=1e-2):
            return name
    return "other"


def finite_fill(target, dtype, device) -> str:
    """Query 0 with one allowed key scoring -s and a masked key scoring 0 (scaled scores, d_k = 2, V = I): the
    smallest s = 10^e at which the masked key gets weight, found by bisection on e up to what the dtype holds.

    A fill that replaces masked scores by -f, or adds -f to them, hands that key weight once s nears f;
    -inf and finfo.min never do. Under a causal mask key 1 is query 0's future (a key-padding-only
    target gets the same key masked for both queries)."""
    top = int(math.log10(torch.finfo(dtype).max / (64 if target.traits is not None and target.traits.multihead
                                                    else 2) / math.sqrt(2)))
    padding = "padding" in supports(target, device=device).masks
    mask = torch.tensor([[True, False]] if padding else [[True, False], [True, True]], device=device)
    eye = torch.eye(2, dtype=dtype, device=device)  # V = I: the output rows are the weight rows

    def leaks(e) -> bool:
        a = math.sqrt(10.0**e * math.sqrt(2))  # q . k_0 = -a^2 = -10^e sqrt(2): the scaled score -10^e
        q = torch.tensor([[a, 0.0], [a, 0.0]], dtype=dtype, device=device)  # [Tq=2, Dk=2]
        k = torch.tensor([[-a, 0.0], [0.0, 0.0]], dtype=dtype, device=device)  # [Tk=2, Dk=2]: key 1 scores 0
        return target.attend(q, k, eye, mask)[0, 1].item() != 0  # query 0's weight on its masked key
    if not leaks(top):
        return "exact"
    if leaks(1):
        return "leaks"
    lo, hi = 1, top  # exact at 10^lo, leaks at 10^hi
    while hi - lo > 1:
        lo, hi = (lo, (lo + hi) // 2) if leaks((lo + hi) // 2) else ((lo + hi) // 2, hi)
    return f"exact below 1e{hi}"


PROBES = {"fully-masked": fully_masked, "mask-polarity": mask_polarity, "masked-nan": masked_nan,
          "causal-alignment": causal_alignment, "gqa-grouping": gqa_grouping, "finite-fill": finite_fill}


def _safely(probe, target, dtype, device) -> str:
    try:
        return probe(target, dtype, device)
    except Unsupported:  # the target takes no mask (or no is_causal): the convention does not arise
        return "n/a"
    except TargetRaised as exc:  # a refusal of its own: these inputs are outside its envelope
        return "n/a" if declared_refusal(exc) else "raises"
    except Failure:  # the adapter rejected the output (not a tensor, wrong shape)
        return "other"


def probe_behaviours(target, dtype: str = "float32", device: str = "cpu") -> dict[str, str]:
    """The behaviours of ``target`` (an adapter), probed on tiny inputs of one dtype and device, inside its envelope
    (the header's base dtype where it declines ``dtype``; widths fitted by attn_spec.targets.envelope); kept on it."""
    taken = supports(target, device=device)
    torch_dtype = DTYPES[dtype if dtype in taken.dtypes else taken.base_dtype]
    found = {key: _safely(probe, target, torch_dtype, device) for key, probe in PROBES.items()}
    found["weights-returned"] = "yes" if target.returns_weights else "no"  # the others return only out
    found = {key: found[key] for key in VALUES}  # the documented order
    target.behaviours = found
    return found


def behaviour(target, key: str, dtype: str = "float32", device: str = "cpu") -> str:
    """One behaviour of ``target``, probed on first use (unless a check probed them all already), then kept."""
    if getattr(target, "behaviours", None) is None:
        target.behaviours = {}
    if key not in target.behaviours:
        target.behaviours[key] = _safely(PROBES[key], target, DTYPES[dtype], device)
    return target.behaviours[key]


def parse_requirements(items) -> dict[str, str]:
    """``["fully-masked=zeros", ...]`` -> ``{"fully-masked": "zeros"}``; anything unknown is a usage error.

    Items without ``=`` name capabilities (attn_spec.targets.capabilities) and are left to that module."""
    valid = "; ".join(f"{key}={'|'.join(values)}" for key, values in VALUES.items())
    required = {}
    for item in items or ():
        if "=" not in item or item.partition("=")[0] in VALUED:  # capabilities, and length=N, head-dims=, dtypes=
            continue
        key, _, value = item.partition("=")
        if key not in VALUES or value not in VALUES[key]:
            problem = f"unknown behaviour {key!r}" if key not in VALUES else f"unknown value {value!r} for {key}"
            raise KitUsageError(f"{item!r}: {problem}; valid: {valid}")
        required[key] = value
    return required
