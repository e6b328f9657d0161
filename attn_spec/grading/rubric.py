"""Grading rubrics: TOML files that fix the points, the inputs (profile, seed) and the limits.

``attn-spec grade --print-rubric`` prints :data:`DEFAULT_RUBRIC`; edit a copy and pass it with
``--rubric``. Every key is optional: a missing one takes the default rubric's value. A property
id the rubric does not list gets the convention's ``default_points``, so properties added to the
catalog later are graded too. An unknown id, key or profile is a usage error.
"""
from __future__ import annotations

import importlib
import tomllib
from dataclasses import dataclass, field, replace

from attn_spec.grading.default_rubric import DEFAULT_RUBRIC
from attn_spec.checking.cases import available_devices
from attn_spec.checking.strategies import DTYPES, PROFILES
from attn_spec.errors import KitUsageError


CONVENTIONS = ("function", "module")
_LIMITS = ("import_seconds", "call_seconds", "submission_seconds", "memory_mb", "output_kb", "file_mb", "source_kb",
           "folder_mb")
# How a convention's points count: "required" (in max_score even when missing), "when-defined" (in
# score and max_score only when the submission defines it), "bonus" (its points add to the score,
# never to max_score, so attempting it can only raise a grade).
POLICIES = ("required", "when-defined", "bonus")


class RubricError(KitUsageError):
    """A rubric that cannot be used: its message says which key and why."""


@dataclass(frozen=True)
class ConventionRubric:
    name: str  # the attribute the submission must define
    policy: str  # one of POLICIES
    default_points: float
    points: dict = field(default_factory=dict)  # property id -> points
    mistakes: dict = field(default_factory=dict)  # mistake id -> what it costs, whatever it breaks (else: its
    # heaviest broken property's points)

    @property
    def required(self) -> bool:
        return self.policy == "required"

    @property
    def bonus(self) -> bool:
        return self.policy == "bonus"

    def points_for(self, property_id: str) -> float:
        return float(self.points.get(property_id, self.default_points))


@dataclass(frozen=True)
class Rubric:
    profile: str
    seed: int
    dtypes: tuple
    devices: tuple
    entry: tuple
    limits: dict  # the _LIMITS keys
    forbidden: tuple
    penalty: float
    conventions: dict  # "function"/"module" -> ConventionRubric
    source: str = "default rubric"
    charge_blocked: bool = False  # a failure blocked by an earlier one costs its points too (default: only the root's)

    def with_timeout(self, seconds: float | None) -> "Rubric":
        """--timeout: one limit for the import and for every call."""
        if seconds is None:
            return self
        if seconds <= 0:
            raise RubricError(f"--timeout must be positive, got {seconds}")
        return replace(self, limits=dict(self.limits, import_seconds=seconds, call_seconds=seconds))

    def check_catalog(self) -> None:
        """Every id named must be in the catalog and apply to its convention."""
        from attn_spec.properties import catalog

        known = catalog()
        for conv, section in self.conventions.items():
            for pid in section.points:
                if pid not in known:
                    raise RubricError(f"{self.source}: [{conv}] names unknown property {pid!r}; "
                                      f"known: {', '.join(known)}")
                if conv not in known[pid].conventions:
                    raise RubricError(f"{self.source}: [{conv}] names {pid!r}, which does not apply to the "
                                      f"{conv} convention")
            if section.mistakes:
                from attn_spec.diagnosis import MISTAKES

                unknown = sorted(set(section.mistakes) - set(MISTAKES))
                if unknown:
                    raise RubricError(f"{self.source}: [{conv}.mistakes] names unknown mistake(s) "
                                      f"{', '.join(map(repr, unknown))} (attn-spec list --mistakes)")


def _table(data: dict, key: str, where: str) -> dict:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise RubricError(f"{where}: [{key}] must be a table")
    return value


def _unknown(data: dict, known, where: str) -> None:
    extra = sorted(set(data) - set(known))
    if extra:
        raise RubricError(f"{where}: unknown key(s) {', '.join(extra)}; known: {', '.join(known)}")


def _number(value, what: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
        raise RubricError(f"{what} must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
    return float(value)


def _strings(value, what: str, allowed=None, *, empty: bool = False) -> tuple:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value) or not (value or empty):
        raise RubricError(f"{what} must be a {'' if empty else 'non-empty '}list of strings")
    bad = [x for x in value if allowed is not None and x not in allowed]
    if bad:
        raise RubricError(f"{what}: {', '.join(bad)} not among {', '.join(allowed)}")
    return tuple(value)


def check_forbidden(entry: str, where: str) -> None:
    """A forbidden entry must name something importable, so a typo cannot silently allow a call."""
    module_name = entry[:-2] if entry.endswith(".*") else entry
    parts = module_name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                break
            obj = getattr(obj, attr)
        else:
            if entry.endswith(".*") and cut != len(parts):
                raise RubricError(f"{where}: {entry!r}: .* must follow a module name")
            return
    raise RubricError(f"{where}: forbidden call {entry!r} names nothing that can be imported")


def parse(text: str, source: str = "rubric") -> Rubric:
    """A Rubric from TOML text; every key missing from it takes the default rubric's value."""
    try:
        data = tomllib.loads(text)
        base = tomllib.loads(DEFAULT_RUBRIC)
    except tomllib.TOMLDecodeError as exc:
        raise RubricError(f"{source} is not valid TOML: {exc}") from None
    _unknown(data, ("profile", "seed", "dtypes", "devices", "entry", "charge_blocked", "limits", "forbidden")
             + CONVENTIONS, source)
    merged = {**base, **{k: v for k, v in data.items() if not isinstance(v, dict)}}
    if not isinstance(merged["charge_blocked"], bool):
        raise RubricError(f"{source}: charge_blocked must be true or false")
    profile = merged["profile"]
    if profile not in PROFILES:
        raise RubricError(f"{source}: profile={profile!r}, but it must be one of {', '.join(PROFILES)}")
    if type(merged["seed"]) is not int:
        raise RubricError(f"{source}: seed must be an integer")
    limits_in = _table(data, "limits", source)
    _unknown(limits_in, _LIMITS, f"{source} [limits]")
    limits = {k: _number({**base["limits"], **limits_in}[k], f"{source} [limits] {k}", positive=True) for k in _LIMITS}
    forbidden_in = _table(data, "forbidden", source)
    _unknown(forbidden_in, ("calls", "penalty"), f"{source} [forbidden]")
    forbidden = {**base["forbidden"], **forbidden_in}
    calls = _strings(forbidden["calls"], f"{source} [forbidden] calls", empty=True)
    for entry in calls:
        check_forbidden(entry, f"{source} [forbidden]")
    penalty = _number(forbidden["penalty"], f"{source} [forbidden] penalty")
    if penalty > 1:
        raise RubricError(f"{source} [forbidden] penalty is a fraction of the score, at most 1.0")
    conventions = {}
    for conv in CONVENTIONS:
        given = _table(data, conv, source)
        _unknown(given, ("name", "policy", "required", "default_points", "points", "mistakes"), f"{source} [{conv}]")
        section = {**base[conv], **given}
        points_in = section["points"] if "points" in given else base[conv]["points"]
        if not isinstance(points_in, dict):
            raise RubricError(f"{source}: [{conv}.points] must be a table of property id = points")
        mistakes_in = given.get("mistakes", {})
        if not isinstance(mistakes_in, dict):
            raise RubricError(f"{source}: [{conv}.mistakes] must be a table of mistake id = points")
        if not isinstance(section["name"], str) or not section["name"].isidentifier():
            raise RubricError(f"{source} [{conv}] name must be a Python identifier")
        conventions[conv] = ConventionRubric(
            section["name"], _policy(given, base[conv], f"{source} [{conv}]"),
            _number(section["default_points"], f"{source} [{conv}] default_points"),
            {pid: _number(p, f"{source} [{conv}.points] {pid}") for pid, p in points_in.items()},
            {m: _number(p, f"{source} [{conv}.mistakes] {m}") for m, p in mistakes_in.items()})
    return Rubric(profile, merged["seed"], _strings(merged["dtypes"], f"{source}: dtypes", DTYPES),
                  _strings(merged["devices"], f"{source}: devices", available_devices()), _strings(merged["entry"], f"{source}: entry"),
                  limits, calls, penalty, conventions, source, merged["charge_blocked"])


def _policy(given: dict, base: dict, where: str) -> str:
    """The section's policy; ``required = true/false`` (the older key) means "required"/"when-defined"."""
    if "required" in given and not isinstance(given["required"], bool):
        raise RubricError(f"{where} required must be true or false")
    old = None if "required" not in given else ("required" if given["required"] else "when-defined")
    policy = given.get("policy", old or base["policy"])
    if policy not in POLICIES:
        raise RubricError(f"{where} policy={policy!r}, but it must be one of {', '.join(POLICIES)}")
    if old is not None and policy != old:
        raise RubricError(f"{where}: required = {str(given['required']).lower()} contradicts policy = {policy!r}")
    return policy


def load(path: str | None) -> Rubric:
    """The rubric in ``path`` (TOML), or the default one; checked against the catalog."""
    if path is None:
        rubric = parse(DEFAULT_RUBRIC, "default rubric")
    else:
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise RubricError(f"cannot read rubric {path}: {exc.strerror}") from None
        rubric = parse(text, path)
    rubric.check_catalog()
    return rubric

