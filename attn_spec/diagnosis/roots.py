"""One root per bug: group a target's failures by the cause that explains them.

A failure is explained by a root when the evidence says so, in this order:
0. what the calls show before any relation is judged (attn_spec.diagnosis.measured): an output that is
   no tensor (a NumPy array, a list, None) is one root named by its type; K transposed over the wrong
   axes (right on 2-D inputs, crashing where those dims differ) is one root named from the shapes;
1. a crash: the same exception raised at the same line of the target's code is one root;
2. NaN or inf out of finite inputs is one root, found first (no lesson is drawn from NaN vs NaN);
3. randomness: the same input giving different outputs explains every failure that does not replay;
4. a mistake model: the model named for the root reproduces the other failure's calls too;
5. only then the catalog's fixed order (``Property.after``), for failures no model reproduces.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from attn_spec.diagnosis import measured
from attn_spec.diagnosis.evidence import FailureEvidence, judge_randomness


@dataclass
class Diagnosis:
    """One root cause and the failures it explains (``explains`` starts with ``root``)."""

    root: str  # the property whose failure shows the root (its counterexample is printed)
    mistake: str | None  # the mistake model's id, None when no model names it
    sentence: str
    fix: str
    explains: list[str]
    evidence: str
    guess: bool = False  # the nearest model only: it does not reproduce every call
    traceback: str = ""  # the target's own traceback, for a crash
    params: dict = field(default_factory=dict)
    consistent_with_passing: bool = True  # its model predicts what the target returned where properties passed
    ambiguous: list = field(default_factory=list)  # models of other families that tie with it on every failure
    not_judged: list = field(default_factory=list)  # failures whose relation never ran: a crash, no tensor back
    unproven: list = field(default_factory=list)  # failures put here by the catalog's order, with no evidence
    fit: dict | None = None  # a measured fit (attn_spec.diagnosis.fits): quantity, depends_on, formula, values
    measured: bool = False  # named by a measurement of the calls (attn_spec.diagnosis.measured), not a model
    tied: list = field(default_factory=list)  # (mistake id, params) of the other models that fit every failing call
    second_probe: dict | None = None  # the call that told tied models apart (attn_spec.diagnosis.discriminate)
    folded: list = field(default_factory=list)  # roots folded into this one (attn_spec.diagnosis.fold): root, explains, how

    @property
    def evidenced(self) -> list[str]:
        """The failures the evidence puts at this root (``explains`` less those the catalog's order put here)."""
        return [p for p in self.explains if p not in self.unproven]

    @property
    def named(self) -> bool:
        """Does the root name its cause (a model that reproduces the calls, or a measurement)?"""
        return bool(self.mistake and not self.guess) or self.measured

    def to_dict(self) -> dict:
        return {"root": self.root, "mistake": self.mistake, "sentence": self.sentence, "fix": self.fix,
                "explains": self.evidenced, "blocked": [p for p in self.explains if p in self.unproven],
                "evidence": self.evidence, "guess": self.guess,
                "traceback": self.traceback or None, "consistent_with_passing": self.consistent_with_passing,
                "ambiguous": list(self.ambiguous), "not_run": [p for p in self.explains if p in self.not_judged],
                **({"fit": self.fit} if self.fit else {}), **({"folded": list(self.folded)} if self.folded else {}),
                **({"second_probe": dict(self.second_probe)} if self.second_probe else {})}


def _key(fit) -> tuple:
    """Two failures name the same mistake when its id and its chosen parameters agree (a fitted number
    may differ in its last digits from one failure to the next)."""
    if isinstance(fit.mistake.params, dict):
        return fit.mistake.id, ()
    return fit.mistake.id, tuple(sorted(fit.params.items()))


def _plural(n: int, word: str) -> str:
    if n == 1:
        return f"1 {word}"
    return f"{n} {word[:-1]}ies" if word.endswith("y") else f"{n} {word}s"


def _from_fits(fits: list, pids: list[str], order: list[str], evidences) -> Diagnosis:
    """A root named by the fit shared by ``pids``, shown at the first property made to catch it."""
    fit = fits[0]
    m = fit.mistake
    shown = next((p for p in m.caught_by if p in pids), None) or min(pids, key=order.index)
    calls = sum(evidences[p].fit_for(m.id).calls for p in pids if evidences[p].fit_for(m.id))
    evidence = (f"reproduces every call of {_plural(len(pids), 'failing property')} ({_plural(calls, 'call')}) "
                f"within the error budget")
    if fit.messages:
        evidence += "; it raises the very exception the target raised"
    related = [f.mistake.id for f in fits[1:] if f.mistake.family == m.family][:2]
    ambiguous = list(dict.fromkeys(f.mistake.id for f in fits[1:] if f.mistake.family != m.family))
    if related:
        evidence += f"; so does {', '.join(related)} ({m.family}, the same family)"
    if ambiguous:
        evidence += (f"; ambiguous: {', '.join(ambiguous)}, of other families, reproduce every failing call as well "
                     f"(no failure tells them apart)")
    return Diagnosis(shown, m.id, m.describe(fit.params), m.fix_for(fit.params),
                     sorted(pids, key=order.index), evidence, params=dict(fit.params), ambiguous=ambiguous,
                     tied=[(f.mistake.id, dict(f.params)) for f in fits[1:]])


def _rank(fit, pids, evidences):
    m = fit.mistake
    specific = 2 if isinstance(m.params, dict) else 1 if m.params else 0
    messages = sum(getattr(evidences[p].fit_for(m.id), "messages", 0) for p in pids)
    return (not set(m.caught_by) & set(pids), specific, -messages, fit.free)


def _best_cover(left: list[str], evidences, within=()) -> tuple[list, list[str]] | None:
    """The fits that explain the most of ``left`` failures (most specific first), and which failures;
    with ``within``, only fits that explain every failure in it."""
    cover: dict[tuple, list[str]] = {}
    fits: dict[tuple, list] = {}
    for pid in left:
        for fit in evidences[pid].fits:
            cover.setdefault(_key(fit), []).append(pid)
            fits.setdefault(_key(fit), []).append(fit)
    cover = {key: pids for key, pids in cover.items() if set(within) <= set(pids)}
    if not cover:
        return None
    best = max(len(p) for p in cover.values())
    tied = [key for key, p in cover.items() if len(p) == best]
    tied.sort(key=lambda key: _rank(fits[key][0], cover[key], evidences))
    chosen = tied[0]
    alternatives = [fits[key][0] for key in tied[1:] if set(cover[key]) == set(cover[chosen])
                    and _rank(fits[key][0], cover[key], evidences)[2] <= _rank(fits[chosen][0], cover[chosen], evidences)[2]]
    return [fits[chosen][0], *alternatives], cover[chosen]


def group(failures: list[str], evidences: dict[str, FailureEvidence], *, order: list[str], after: dict,
          target=None, mistakes=()) -> list[Diagnosis]:
    """The roots of ``failures`` (property ids, catalog order), each with the failures it explains."""
    left = [p for p in failures if p in evidences]
    roots: list[Diagnosis] = []

    def take(pids):
        for p in pids:
            if p in left:
                left.remove(p)

    # 0. what the calls returned and the shapes they crashed on
    for root in _measured_roots(evidences, left, order, target):
        roots.append(root)
        take(root.explains)

    # 1. crashes: one root per exception type and line of the target's code
    crashes: dict[tuple, list[str]] = {}
    for p in left:
        if evidences[p].crash:
            crashes.setdefault((evidences[p].crash[0], evidences[p].crash[2]), []).append(p)
    for (kind, where), pids in crashes.items():
        shared = _best_cover(left, evidences, within=pids)
        crash = evidences[pids[0]].crash
        if shared:
            root = _from_fits(shared[0], pids, order, evidences)
            root.evidence = f"the target raises {kind} at {where}; " + root.evidence
        else:
            root = Diagnosis(pids[0], None, f"the target raises {kind}: {crash[1]}",
                             "see the traceback: the line of your code that raised", pids,
                             f"{_plural(len(pids), 'failing property')} raise the same {kind} at {where}")
        root.traceback = evidences[pids[0]].traceback
        roots.append(root)
        take(pids)

    # 2. NaN or inf out of finite inputs: one root, whatever else fails
    nonfinite = [p for p in left if evidences[p].nonfinite]
    if nonfinite:
        cover = _best_cover(left, evidences, within=nonfinite)
        if cover:
            root = _from_fits(cover[0], nonfinite, order, evidences)
        else:
            root = Diagnosis(nonfinite[0], None, "the output has NaN or inf although every input is finite",
                             "look for exp without subtracting the row max, 0/0 in a normalisation, or "
                             "reads outside the inputs", nonfinite,
                             f"{_plural(len(nonfinite), 'failing property')} get NaN or inf from finite inputs "
                             f"where the correct formula is finite")
        roots.insert(0, root)
        take(nonfinite)

    # 3. dropout and ALiBi: their calls are read out, not replayed (diagnosis.mistakes_dropout, mistakes_alibi)
    for family, pids in READOUTS.items():
        read_out = [p for p in left if p in pids]
        if read_out and target is not None:
            roots.append(_readout_root(target, family, read_out, order, mistakes))
            take(read_out)

    # 3b. randomness: the same input, different outputs
    random = [p for p in left if evidences[p].nondeterministic or (p == "determinism" and not evidences[p].fits)]
    if random:
        judged = judge_randomness(target, mistakes) if target is not None else None
        # outputs that change from call to call cannot be trusted to show another bug: fix this first
        pids = random + [p for p in left if p not in random]
        unproven = [p for p in pids if p not in random]
        shown = "determinism" if "determinism" in pids else pids[0]
        evidence = (f"the same inputs gave different outputs when {_plural(len(random), 'failing property')} "
                    f"were replayed")
        if judged:
            m, params = judged
            roots.append(Diagnosis(shown, m.id, m.describe(params), m.fix_for(params), sorted(pids, key=order.index),
                                   evidence + f"; repeated readings of one input's weights match {m.id}", params=params,
                                   unproven=unproven))
        else:
            roots.append(Diagnosis(shown, None, "the output changes from call to call on the same input",
                                   "remove randomness and state from inference (dropout, noise, caches)",
                                   sorted(pids, key=order.index), evidence, unproven=unproven, measured=True))
        take(pids)

    # 4. mistake models: roots found so far absorb what their model reproduces, then the best cover
    for root in roots:
        if root.mistake:
            more = [p for p in left if any(f.mistake.id == root.mistake for f in evidences[p].fits)]
            root.explains = sorted(root.explains + more, key=order.index)
            take(more)
    while left:
        cover = _best_cover(left, evidences)
        if cover is None:
            break
        roots.append(_from_fits(cover[0], cover[1], order, evidences))
        take(cover[1])

    # 5. what no model reproduces
    stateful = next((r for r in roots if r.mistake and _is_stateful(r.mistake, mistakes)), None)
    for p in list(left):
        ev = evidences[p]
        if not ev.reproduced and stateful is not None:
            stateful.explains = sorted(stateful.explains + [p], key=order.index)
            continue
        blocker = next((r for r in roots for b in after.get(p, ()) if b in r.explains), None)
        if blocker is not None:  # the catalog's order, not evidence: blocked, not explained
            blocker.explains = sorted(blocker.explains + [p], key=order.index)
            blocker.unproven.append(p)
            continue
        roots.append(_unexplained(p, ev))
    take(left[:])
    return _merged(roots, order, mistakes)


READOUTS = {"dropout": ("dropout-mask", "dropout-mean"), "alibi": ("alibi-slopes",)}  # level -> the properties


def _readout_root(target, level: str, pids: list[str], order: list[str], mistakes) -> Diagnosis:
    """The model of ``level`` that recognises the target's readout (q = 0 or q = k = 0 and V = I: the output is
    the weights), or a measured root that says what the readout showed."""
    from attn_spec.diagnosis import mistakes_alibi, mistakes_dropout

    judge = {"dropout": mistakes_dropout.judge, "alibi": mistakes_alibi.judge}[level]
    found, numbers = judge(target, [m for m in mistakes if m.level == level])
    pids = sorted(pids, key=order.index)
    if found is None:
        return Diagnosis(pids[0], None, f"the {level} readout shows no catalogued {level} mistake", "", pids,
                         f"measured on the readout: {numbers}", measured=True)
    m, params = found
    shown = next((p for p in m.caught_by if p in pids), pids[0])
    return Diagnosis(shown, m.id, m.describe(params), m.fix_for(params), pids,
                     f"the readout matches {m.id}: {numbers}", params=params, measured=True)


def generic(d: Diagnosis) -> bool:
    """A root that names nothing: no model, no measurement, no crash of the target's (a guess included)."""
    return not d.named and not d.traceback


def settle(roots: list[Diagnosis], order: list[str], measure=None) -> list[Diagnosis]:
    """Generic roots last, as one section of unexplained symptoms. Where no root names anything, the target is
    measured (``measure()``: attn_spec.diagnosis.fits.measure) and a fit that finds something names one root."""
    named = [d for d in roots if not generic(d)]
    rest = [d for d in roots if generic(d)]
    if len(rest) < 1 or (named and len(rest) < 2):
        return named + rest
    found = measure() if measure is not None and not named else None
    pids = sorted({p for d in rest for p in d.explains}, key=order.index)
    shown = [d.root for d in rest]
    if found is not None:
        one = Diagnosis(shown[0], None, found.sentence, found.fix, pids,
                        f"measured on purpose-built calls: {found.numbers}", measured=True, fit=found.to_dict())
    else:
        one = Diagnosis(shown[0], None, "unexplained: no mistake model and no measured fit (batch mixing, the "
                                        "normaliser, the scale against the shapes) accounts for these failures", "",
                        pids, "; ".join(f"{d.root}: {d.evidence}" for d in rest))
    one.unproven = [p for p in pids if p not in shown]
    return named + [one]


def _measured_roots(evidences, left, order, target=None) -> list[Diagnosis]:
    """Roots that the recorded calls name by themselves (attn_spec.diagnosis.measured). The transpose is read
    on a function's own calls only (a kernel's in another layout are kept transposed back, in the kit's terms)."""
    mine = {p: evidences[p] for p in left}
    crash = measured.length_crash(mine, target)
    if crash:
        where, pids = crash
        root = Diagnosis(pids[0], "kv-buffer-overflow", f"the target {where}", "size buffers from the input "
                         "(K.shape[-2]); a deliberate limit is declared: raise NotImplementedError past it, or give "
                         "the module a block_size (or max_position_embeddings) of that size", sorted(pids, key=order.index),
                         f"the length probe bisected it; {_plural(len(pids), 'failing property')} "
                         f"{'raises' if len(pids) == 1 else 'raise'} that exception past "
                         f"{target.supported.crash_length} positions",
                         measured=True, params={"slots": target.supported.crash_length})
        root.traceback = mine[pids[0]].traceback
        return [root]
    returned = measured.returned_type(mine)
    if returned:
        words, why, pids = returned
        fit = next((f for p in pids for f in evidences[p].fits if f.mistake.id == "returns-tuple"), None)
        if fit is not None:  # the tuple is (output, weights): the model says so, and explains every failure
            root = _from_fits([fit], pids, order, evidences)
            root.measured = True
            return [root]
        return [Diagnosis(pids[0], None, f"returns {words}: return a torch.Tensor ({why})",
                          "return the output as a torch.Tensor of shape [..., n_q, d_v], computed with torch "
                          "operations (so that autograd reaches Q, K and V)", sorted(pids, key=order.index),
                          f"{_plural(len(pids), 'failing property')} got {words} back from the target where "
                          f"the convention returns a tensor; no property's relation was judged", measured=True)]
    own = getattr(target, "convention", "function") == "function" and getattr(target, "layout", "bhsd") != "bshd"
    wrong = measured.wrong_transpose(mine) if own else None
    if wrong:
        (a, b), pids, pattern = wrong
        return [Diagnosis(pids[0], None, f"K is transposed over the wrong axes: K.transpose({a}, {b}) instead of "
                                         f"K.transpose(-2, -1) on batched inputs",
                          "scores = Q @ K.transpose(-2, -1): swap the last two axes, whatever the leading dims",
                          sorted(pids, key=order.index),
                          f"softmax(Q K.transpose({a}, {b}) scaled) V reproduces every call of "
                          f"{_plural(len(pids), 'failing property')}, crashes included; {pattern}", measured=True)]
    return []


def _merged(roots: list[Diagnosis], order: list[str], mistakes) -> list[Diagnosis]:
    """Roots naming the same mistake are one root; each is shown at the property made to catch it."""
    out: list[Diagnosis] = []
    for root in roots:
        same = next((r for r in out if root.mistake and r.mistake == root.mistake and not (r.guess or root.guess)
                     and r.params == root.params), None)
        if same is None:
            out.append(root)
            continue
        shown = set(same.evidenced) | set(root.evidenced)
        same.explains = sorted(set(same.explains) | set(root.explains), key=order.index)
        same.unproven = [p for p in same.explains if p not in shown]
        same.traceback = same.traceback or root.traceback
        same.evidence = f"{same.evidence}; {root.evidence}"
    for root in out:
        m = next((m for m in mistakes if m.id == root.mistake), None)
        designated = [p for p in (m.caught_by if m else ()) if p in root.explains]
        if designated:
            root.root = designated[0]
        elif root.root not in root.explains:
            root.root = root.explains[0]
    return out


def _is_stateful(mistake_id, mistakes) -> bool:
    m = next((m for m in mistakes if m.id == mistake_id), None)
    return m is not None and (m.stateful or m.recognised)


def _unexplained(pid: str, ev: FailureEvidence) -> Diagnosis:
    if not ev.reproduced:
        return Diagnosis(pid, None, "the failure does not happen again when its input is replayed: the target "
                                    "depends on earlier calls (state kept between calls?)",
                         "keep no state between calls", [pid], "replayed on fresh instances, the property held",
                         measured=True)
    if ev.guess:
        fit, agreed = ev.guess
        m = fit.mistake
        return Diagnosis(pid, m.id, m.describe(fit.params), m.fix_for(fit.params), [pid],
                         f"a guess: no mistake model reproduces every call; the nearest, {m.id}, reproduces "
                         f"{agreed} of {fit.calls}", guess=True, params=dict(fit.params))
    return Diagnosis(pid, None, "no mistake model in the catalog reproduces this failure", "", [pid],
                     f"none of the mistake models reproduces its {_plural(len(ev.calls), 'call')}")
