"""A second probe where the first cannot tell mistake models apart.

A probe's numbers can fit several models at once: the scale probe reads V = [[0], [1]], d_v = 1, where
"scaled by 1/sqrt(d_v)" and "not scaled" give the same weights; one failure at one sequence length cannot
tell a scale taken from n_q from a hard-coded d_k. A module's calls have their own blind spots: at
d_model = 4 and 2 heads, 1/sqrt(d_model), 1/d_head and a hard-coded 1/sqrt(4) are one number; one head
cannot tell heads-related models apart; identity projections hide how the heads are split and merged.

When a root's model ties with others on every failing call, the target is called once more on inputs built
from a recorded call with one thing changed, the first such input on which the tied models predict
different outputs: for attention on Q, K, V the shape or the values (d_v, n_q, n_kv, d_k, a batch of two,
fresh values); for a module the number of heads, the projection weights, the width of each head, the values
of x or the number of tokens (``module_variants``). A module is asked as its convention promises, through
the target's own ``multihead`` (built and loaded as every check builds and loads it). The model that predicts
what the target returned is named; if none does, or no input separates them, the root says so and stays
ambiguous.
"""
from __future__ import annotations

import itertools
import math
import re

import torch

from attn_spec.diagnosis import replay
from attn_spec.diagnosis.evidence import one_thread
from attn_spec.diagnosis.model import MISTAKES
from attn_spec.diagnosis.predict import Prediction, predict
from attn_spec.reference import causal_mask
from attn_spec.targets.record import Call
from attn_spec.errors import Failure, Unsupported

F64 = torch.float64


def _randn(like: torch.Tensor, *shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=F64).to(like.dtype)


def variants(call: Call):
    """(words, inputs) of calls like ``call`` with one thing changed, in the order they are tried."""
    x = call.inputs
    q, k, v = x["q"], x["k"], x["v"]
    lead, n_q, n_kv, d_k, d_v = q.shape[:-2], q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    plain = {"q": q, "k": k, "v": v, "mask": None}  # a change of shape drops the mask: None is always allowed
    yield f"d_v = {d_v + 2} instead of {d_v}", {**x, "v": torch.cat([v, _randn(v, *v.shape[:-1], 2, seed=1)], -1)}
    yield f"n_q = {n_q + 2} instead of {n_q}", {**plain, "q": torch.cat([q, _randn(q, *lead, 2, d_k, seed=2)], -2)}
    yield f"n_kv = {n_kv + 2} instead of {n_kv}", {
        **plain, "k": torch.cat([k, _randn(k, *k.shape[:-2], 2, d_k, seed=3)], -2),
        "v": torch.cat([v, _randn(v, *v.shape[:-2], 2, d_v, seed=4)], -2)}
    yield f"d_k = {2 * d_k} instead of {d_k}", {
        **plain, "q": torch.cat([q, _randn(q, *q.shape[:-1], d_k, seed=5)], -1),
        "k": torch.cat([k, _randn(k, *k.shape[:-1], d_k, seed=6)], -1)}
    yield "a batch of two", {"mask": None, **{n: torch.stack([t, _randn(t, *t.shape, seed=7 + i)])
                                              for i, (n, t) in enumerate((("q", q), ("k", k), ("v", v)))}}
    yield "fresh normal values", {**x, **{n: _randn(t, *t.shape, seed=10 + i) for i, (n, t) in
                                          enumerate((("q", q), ("k", k), ("v", v)))}}


def _other_heads(d_model: int, h: int) -> list[int]:
    """The nearest numbers of heads below and above ``h`` that divide d_model (fewer first)."""
    divisors = [n for n in range(1, d_model + 1) if d_model % n == 0]
    return [n for n in (max((n for n in divisors if n < h), default=None),
                        min((n for n in divisors if n > h), default=None)) if n is not None]


def _causal_like(mask, n_q: int, n_kv: int):
    """A causal mask at [n_q, n_kv] in ``mask``'s form if ``mask`` is the causal one of its shape; else None."""
    if mask is None or mask.dim() != 2 or mask.shape[0] < 2:  # a key-padding row [1, Tk] is no causal mask
        return None
    tril = causal_mask(*mask.shape)  # [Tq, Tk]
    if mask.dtype == torch.bool:
        return causal_mask(n_q, n_kv) if torch.equal(mask, tril) else None
    if torch.equal(mask == 0, tril) and bool(torch.isneginf(mask[~tril]).all()):
        return torch.zeros(n_q, n_kv, dtype=mask.dtype).masked_fill(~causal_mask(n_q, n_kv), -math.inf)
    return None


def _widened(x: dict) -> dict:
    """The module call with each head one column wider (d_head + 1) and x one zero feature per head: the old
    entries kept in place, the new ones zero, so only the width (and what is split and scaled by it) changes."""
    d, h = x["x_q"].shape[-1], x["n_heads"]
    dh = d // h
    at = torch.tensor([i * (dh + 1) + j for i in range(h) for j in range(dh)])  # [D]: old columns in the new width

    def wide(t, rows: bool):
        out = t.new_zeros(*((d + h,) if rows else t.shape[:-1]), d + h)  # [T, D + h] or [D + h, D + h]
        if rows:
            out[at[:, None], at[None, :]] = t
        else:
            out[..., at] = t
        return out

    x_q = wide(x["x_q"], False)
    x_kv = x_q if x["x_kv"] is x["x_q"] else wide(x["x_kv"], False)
    return {**x, "x_q": x_q, "x_kv": x_kv, "weights": {n: wide(w, True) for n, w in x["weights"].items()}}


def module_variants(call: Call):
    """(words, inputs) of module calls like ``call`` with one thing changed, in the order they are tried.
    Self-attention (x_q equal to x_kv) stays self-attention: a module may take nothing else."""
    x = dict(call.inputs)
    x_q, x_kv, W, h = x["x_q"], x["x_kv"], x["weights"], x["n_heads"]
    if x_q.shape == x_kv.shape and torch.equal(x_q, x_kv):
        x["x_kv"] = x_kv = x_q
    n_q, n_kv, d = x_q.shape[-2], x_kv.shape[-2], x_q.shape[-1]
    for other in _other_heads(d, h):
        yield f"n_heads = {other} instead of {h}", {**x, "n_heads": other}
    yield "random W_Q, W_K, W_V, W_O", {**x, "weights": {n: _randn(w, *w.shape, seed=20 + i) / math.sqrt(d)
                                                         for i, (n, w) in enumerate(W.items())}}
    yield f"d_model = {d + h} instead of {d} (each head one column wider)", _widened(x)
    fresh = _randn(x_q, *x_q.shape, seed=30)  # [Tq, D]
    yield "fresh normal x", {**x, "x_q": fresh, "x_kv": fresh if x_kv is x_q else _randn(x_kv, *x_kv.shape, seed=31)}
    if x_kv is x_q:
        more = torch.cat([x_q, _randn(x_q, 2, d, seed=32)])  # [T + 2, D]
        yield f"n = {n_q + 2} tokens instead of {n_q}", {**x, "x_q": more, "x_kv": more,
                                                           "mask": _causal_like(x.get("mask"), n_q + 2, n_q + 2)}
    else:
        yield f"n_kv = {n_kv + 2} instead of {n_kv}", {**x, "x_kv": torch.cat([x_kv, _randn(x_kv, 2, d, seed=33)]),
                                                       "mask": _causal_like(x.get("mask"), n_q, n_kv + 2)}


def _variants(call: Call):
    return module_variants(call) if call.kind == "multihead" else variants(call)


def _probe_calls(calls) -> list[Call]:
    """The recorded attention and module calls a variant can be built from."""
    names = {"attend": ("q", "k", "v"), "multihead": ("x_q", "x_kv")}
    return [c for c in calls if c.kind in names and c.kept and not c.unsupported and c.error is None
            and all(isinstance(c.inputs.get(n), torch.Tensor) for n in names[c.kind])
            and (c.kind == "attend" or isinstance(c.inputs.get("weights"), dict))]


def _asks(target, kind: str) -> bool:
    return target is not None and hasattr(target, "multihead" if kind == "multihead" else "attend")


def _call_target(target, inputs: dict, kind: str = "attend"):
    """What the target returns on ``inputs`` (a Prediction), or None if it cannot be asked."""
    args = dict(inputs)
    options = {n: args[n] for n in ("scale", "is_causal", "window", "softcap") if args.get(n) not in (None, False)}
    target.fresh_instances()
    try:
        if kind == "multihead":  # built and loaded by the target, as every check builds and loads it
            out = target.multihead(args["x_q"], args["x_kv"], args["weights"], args["n_heads"], args.get("mask"))
        else:
            out = target.attend(args["q"], args["k"], args["v"], args.get("mask"), **options)
    except Unsupported:
        return None
    except Failure as exc:
        inner = getattr(exc, "exc", exc)
        return Prediction(error=(type(inner).__name__, str(inner)))
    except Exception as exc:  # noqa: BLE001 - the target's own crash is an answer too
        return Prediction(error=(type(exc).__name__, str(exc)))
    return Prediction(out.detach().to("cpu") if isinstance(out, torch.Tensor) else out)


def _separating(tied: list, calls: list):
    """(Call, predictions) of each variant of ``calls`` on which the tied models' predictions are not all alike."""
    for call in calls:
        for words, inputs in _variants(call):
            probe = Call(call.kind, inputs, label=f"the failing call's inputs with {words}")
            preds = [predict(MISTAKES[mid], probe, params) for mid, params in tied]
            if any(p is None for p in preds):
                continue
            budgets = replay._budgets(probe, None)
            if any(replay.mismatch(a, b, budgets) > 1 for i, a in enumerate(preds) for b in preds[i + 1:]):
                yield probe, preds


def _asked(target, tied: list, calls: list, tries: int = 6):
    """(Call, predictions, what the target returned) of the first separating variant the target answers with
    an output (a variant it declines or crashes on says nothing of the tied models: the next is tried)."""
    for probe, preds in itertools.islice(_separating(tied, calls), tries):
        seen = _call_target(target, probe.inputs, probe.kind)
        if seen is not None and seen.error is None:
            return probe, preds, seen
    return None


def _still_tied(root, evidences: dict) -> list:
    """The root's model and the others that reproduce every failure the root explains now (folds included)."""
    from attn_spec.diagnosis.fold import reproduced

    tied = [(root.mistake, dict(root.params)), *((mid, dict(p)) for mid, p in root.tied)]
    tied = list({mid: (mid, p) for mid, p in tied if mid in MISTAKES}.values())
    pids = [p for p in root.evidenced if p in evidences]
    return tied[:1] + [(mid, p) for mid, p in tied[1:] if all(reproduced(mid, p, evidences[q]) is not None
                                                               for q in pids)]


def separate(root, evidences: dict, target, probes: int = 3) -> None:
    """Run targeted calls where ``root``'s model ties with others, and name the one they pick (or say none does)."""
    tied = _still_tied(root, evidences)
    root.tied = []
    if len(tied) < 2:
        return
    calls = [c for c in _probe_calls(c for p in root.evidenced if p in evidences for c in evidences[p].calls)
             if _asks(target, c.kind)][:4]
    if not calls:
        return  # no call to build a variant from (or no target to ask): the tie stays as the first pass said it
    names, told = ", ".join(mid for mid, _ in tied), []
    root.evidence = re.sub(r"; (so does|ambiguous:) [^;]*", "", root.evidence)  # the tie is settled below
    with one_thread():
        for _ in range(probes):
            found = _asked(target, tied, calls)
            if found is None:
                break
            probe, preds, seen = found
            budgets = replay._budgets(probe, None)
            kept = [t for t, pred in zip(tied, preds) if replay.mismatch(pred, seen, budgets) <= 1]
            verb = "reproduce" if len(kept) > 1 else "reproduces"
            told.append(f"{probe.label} ({', '.join(m for m, _ in kept) or 'none of them'} {verb} the target)")
            tied = kept
            if len(tied) <= 1:
                break
    survivors = [m for m, _ in tied]
    if tied and root.mistake not in survivors:  # the first pass's pick is ruled out: name one the probe kept, on a
        #                                         module's calls a model of its own plumbing before one of the
        #                                         attention inside it
        module = calls[0].kind == "multihead"
        _rename(root, *min(tied, key=lambda t: module and MISTAKES[t[0]].level != "module"))
    if len(tied) != 1:
        ruled = ", ".join(told) if told else "no input built from the failing calls tells them apart"
        out = [m for m in names.split(", ") if survivors and m not in survivors]  # ruled out by the probe
        root.ambiguous = list(dict.fromkeys(m for m in [*root.ambiguous, *names.split(", ")]
                                            if m != root.mistake and m not in out))
        root.evidence += f"; ambiguous: {names} fit every failing call; second probe: {ruled}; left: " \
                         f"{', '.join(survivors) or 'none'}"
        return
    mid = root.mistake
    others = [t for t in names.split(", ") if t != mid]
    root.ambiguous = [a for a in root.ambiguous if a not in others and a != mid]
    root.evidence += (f"; {', '.join(others)} fit every failing call too, so a second probe was run: "
                      f"{'; '.join(told)}: {mid} is named")
    root.second_probe = {"changed": told, "picked": mid, "ruled_out": others}


def _rename(root, mid: str, params: dict) -> None:
    m = MISTAKES[mid]
    root.mistake, root.params = mid, params
    root.sentence, root.fix = m.describe(params), m.fix_for(params)


def separate_all(roots: list, evidences: dict, target) -> list:
    for root in roots:
        if root.mistake and not root.guess and root.tied:
            separate(root, evidences, target)
    return roots
