"""Replay one failing property on its minimal case, twice, keeping every call: the evidence of a failure.

The first replay gives the calls the mistake models are fitted on; the second tells whether the
same inputs give the same outputs (a target that does not is nondeterministic, measured rather
than assumed). Modules are rebuilt before each replay, so a module that keeps state between calls
replays the same way each time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from attn_spec.diagnosis import replay
from attn_spec.targets.record import Call, differs, record, same
from attn_spec.errors import Failure, TargetRaised, Unsupported


@dataclass
class FailureEvidence:
    """What replaying one failure showed, and which mistake models reproduce it."""

    property_id: str
    calls: list[Call] = field(default_factory=list)
    reproduced: bool = True  # the replay failed again
    nondeterministic: bool = False  # the second replay's outputs differ from the first's on the same inputs
    crash: tuple | None = None  # (type, message, file:line) when the failure is the target raising
    traceback: str = ""  # the target's own traceback of that crash
    nonfinite: bool = False  # NaN or inf out of finite inputs, where the correct formula is finite
    fits: list = field(default_factory=list)  # replay.Fit, most specific first
    guess: tuple | None = None  # (replay.Fit, calls it reproduces) when nothing fits

    def fit_for(self, mistake_id: str):
        return next((f for f in self.fits if f.mistake.id == mistake_id), None)


def _nonfinite(ev: replay.Evidence) -> bool:
    """A call with finite inputs whose output has NaN or inf where the correct formula's has none."""
    for i, call in enumerate(ev.calls):
        tensors = [t for t in call.inputs.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        out = call.out[0] if isinstance(call.out, tuple) and call.out else call.out
        if call.error or not isinstance(out, torch.Tensor) or not out.is_floating_point():
            continue
        if any(not torch.isfinite(t).all() for t in tensors) or torch.isfinite(out).all():
            continue
        good = ev.correct(i)
        ref = good.out[0] if good is not None and isinstance(good.out, tuple) else getattr(good, "out", None)
        if isinstance(ref, torch.Tensor) and ref.shape == out.shape:
            bad = ~torch.isfinite(out)
            if good.free is not None:
                bad &= ~good.free.expand(out.shape)
            if bad.any() and torch.isfinite(ref[bad]).all():
                return True
    return False


def gather(prop_id: str, fn, target, case, *, mistakes=None, shortlist=()) -> FailureEvidence:
    """Replay ``fn`` (a property's check) on ``case`` twice and fit the mistake models to its calls
    (``shortlist``: the models named for the target's other failures, tried first)."""
    calls, raised = record(fn, target, case)
    again, _ = record(fn, target, case)
    evidence = FailureEvidence(prop_id, calls, reproduced=isinstance(raised, Failure),
                               nondeterministic=differs(calls, again))
    if isinstance(raised, TargetRaised):
        evidence.crash = next((c.error for c in reversed(calls) if c.error), (type(raised.exc).__name__,
                                                                              str(raised.exc), "?"))
        evidence.traceback = raised.user_traceback
    ev = replay.Evidence(calls)
    with one_thread():
        evidence.nonfinite = _nonfinite(ev)
        if evidence.reproduced and not evidence.nondeterministic:
            evidence.fits = replay.fits(ev, mistakes, shortlist)
            if not evidence.fits:
                evidence.guess = replay.nearest(ev, mistakes)
    return evidence


class one_thread:
    """Diagnosis works on tiny tensors: one intra-op thread (a loaded machine makes a thread pool's
    wake-up cost milliseconds per softmax). The caller's setting is restored."""

    def __enter__(self):
        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.threads)


# ------------------------------------------------------------------ randomness, recognised


def weight_samples(target, n: int = 16):
    """(samples, expected): the weights of one fixed input read ``n`` times with V = identity. 16 readings of 9
    weights: dropout at p = 0.1 drops none of the 144 with a chance of 3e-7 (4 readings: 2%, a flaky diagnosis)."""
    from attn_spec import reference
    from attn_spec.checking import probes

    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, 4, generator=gen, dtype=torch.float64) for _ in range(2))  # [3, 4]: 3 queries, 3 keys
    target.fresh_instances()
    samples = []
    try:
        for _ in range(n):
            samples.append(probes.weights(target, q, k).detach().to("cpu", torch.float64))
    except (Failure, Unsupported):
        return None
    return samples, reference.attention(q, k, k)[1]


def judge_randomness(target, mistakes) -> tuple | None:
    """(mistake, params) of the stochastic model that recognises repeated readings, or None."""
    read = weight_samples(target)
    if read is None:
        return None
    samples, expected = read
    if all(same(s, samples[0]) for s in samples):
        return None  # the same readings: deterministic
    with one_thread():
        for m in mistakes:
            if m.level == "stochastic":
                params = m.fn(samples, expected)
                if params is not None:
                    return m, params
    return None
