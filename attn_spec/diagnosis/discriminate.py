"""A second probe where the first cannot tell mistake models apart.

A probe's numbers can fit several models at once: the scale probe reads V = [[0], [1]], d_v = 1, where
"scaled by 1/sqrt(d_v)" and "not scaled" give the same weights; one failure at one sequence length cannot
tell a scale taken from n_q from a hard-coded d_k. When a root's model ties with others on every failing
call, the target is called once more on inputs built from a recorded call with one shape or the values
changed (d_v, n_q, n_kv, d_k, a batch of two, fresh values), the first such input on which the tied models
predict different outputs. The model that predicts what the target returned is named; if none does, or no
input separates them, the root says so and stays ambiguous. Variants are built from attention calls on Q, K,
V; a module's calls (x and its weights) are left as they are, their tie said as the first pass said it.
"""
from __future__ import annotations

import itertools
import re

import torch

from attn_spec.diagnosis import replay
from attn_spec.diagnosis.evidence import one_thread
from attn_spec.diagnosis.model import MISTAKES
from attn_spec.diagnosis.predict import Prediction, predict
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


def _call_target(target, inputs: dict):
    """What the target returns on ``inputs`` (a Prediction), or None if it cannot be asked."""
    args = dict(inputs)
    options = {n: args[n] for n in ("scale", "is_causal", "window", "softcap") if args.get(n) not in (None, False)}
    target.fresh_instances()
    try:
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
        for words, inputs in variants(call):
            probe = Call("attend", inputs, label=f"the failing call's inputs with {words}")
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
        seen = _call_target(target, probe.inputs)
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
    if len(tied) < 2 or target is None or not hasattr(target, "attend"):
        return
    calls = [c for p in root.evidenced if p in evidences for c in evidences[p].calls
             if c.kind == "attend" and c.kept and not c.unsupported and c.error is None
             and all(isinstance(c.inputs.get(n), torch.Tensor) for n in ("q", "k", "v"))][:4]
    if not calls:
        return  # a module's calls (x and weights): no variant of them is built here, the tie stays as it was said
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
            told.append(f"{probe.label} ({', '.join(m for m, _ in kept) or 'none of them'} reproduces the target)")
            tied = kept
            if len(tied) <= 1:
                break
    if len(tied) != 1:
        ruled = ", ".join(told) if told else "no input built from the failing calls tells them apart"
        left = ", ".join(m for m, _ in tied) or "none"
        root.ambiguous = list(dict.fromkeys([*root.ambiguous, *(m for m in names.split(", ") if m != root.mistake)]))
        root.evidence += f"; ambiguous: {names} fit every failing call; second probe: {ruled}; left: {left}"
        return
    (mid, params), = tied
    m = MISTAKES[mid]
    others = [t for t in names.split(", ") if t != mid]
    if mid != root.mistake:
        root.mistake, root.params = mid, params
        root.sentence, root.fix = m.describe(params), m.fix_for(params)
    root.ambiguous = [a for a in root.ambiguous if a not in others]
    root.evidence += (f"; {', '.join(others)} fit every failing call too, so a second probe was run: "
                      f"{'; '.join(told)}: {mid} is named")
    root.second_probe = {"changed": told, "picked": mid, "ruled_out": others}


def separate_all(roots: list, evidences: dict, target) -> list:
    for root in roots:
        if root.mistake and not root.guess and root.tied:
            separate(root, evidences, target)
    return roots
