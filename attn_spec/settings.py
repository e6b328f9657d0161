"""Every setting of attn-spec, defined once: name, type, choices, default and help.

From this one table come the ``attn-spec check`` flags, the environment variables
(``ATTN_SPEC_PROFILE``, ...), the ``[tool.attn-spec]`` table of ``pyproject.toml``, the pytest
plugin's ``--attn-*`` options and ini keys (``attn_profile``, ...), and ``attn-spec config``.
Layers, highest first: command line > environment > pytest ini keys (pytest only) >
``pyproject.toml`` > defaults; the pytest marker's keywords sit above them all for its test.
A bad value names where it came from::

    profile='huge' from pyproject.toml [tool.attn-spec]: must be one of quick, default, thorough

This module imports no torch: ``attn-spec --help``, ``attn-spec config`` and the pytest plugin's
option registration stay cheap. The conventions' names come from the torch-free registry
(``attn_spec.vocabulary``: a convention registered there is accepted by ``--convention``); the other
choices below are checked against the kit's own lists by ``tests/test_settings.py``, and a new dtype or
capability is added here too.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from attn_spec import vocabulary
from attn_spec.errors import KitUsageError

TABLE = "[tool.attn-spec]"
PRECEDENCE = "command line > environment > pyproject.toml > defaults"
PROFILES = ("quick", "default", "thorough", "scale")
DTYPES = ("float64", "float32", "float16", "bfloat16")
CAPABILITIES = ("mask", "unmasked", "batch", "cross", "dv-ne-dk", "scale", "is-causal", "dropout", "autograd", "gqa",
                "head-dims", "length", "float64", "float32", "float16", "bfloat16")
BEHAVIOURS = ("fully-masked", "mask-polarity", "masked-nan", "causal-alignment", "weights-returned", "gqa-grouping",
              "finite-fill")


class SettingError(KitUsageError):
    """A setting's value is invalid; the message names the setting, the value and where it came from."""


def _shape(item: str) -> str | None:
    fields = [f.strip() for f in item.split(",")]
    paged = fields[-1].startswith("page=")  # a decode kernel's page size
    if paged:
        fields[-1] = fields[-1][len("page="):]
    if len(fields) - paged not in (4, 5, 6) or not all(f.isdigit() and int(f) > 0 for f in fields):
        return (f"{item!r} is not B,H,N,D, B,H,NQ,NKV,D or B,H,HKV,NQ,NKV,D, nor a decode kernel's "
                f"B,H,[HKV,]S_NEW,S_CACHE,D[,page=P] (positive integers)")
    return None


def _module_attr(item: str) -> str | None:
    if not re.fullmatch(r"(config\.)?[A-Za-z_]\w*=.+", item):
        return f"{item!r} is not NAME=VALUE or config.NAME=VALUE (VALUE a Python literal, e.g. config.rope_theta=10000.0)"
    return None


@dataclass(frozen=True)
class Setting:
    name: str  # the key in [tool.attn-spec]; flags, variables and ini keys derive from it
    help: str
    kind: str = "str"  # str | int | bool | list | seconds (a number >= 0; none: 0)
    choices: tuple[str, ...] | Callable[[], tuple[str, ...]] = ()  # or a function giving them when a value is parsed
    default: Any = None
    metavar: str = ""
    flags: tuple[str, ...] = ()  # attn-spec check's flags (default: --NAME)
    positional: bool = False  # attn-spec check takes it as positional arguments (TARGET ...)
    plugin_flag: str = ""  # the pytest plugin's flag (default: --attn-NAME)
    split: str = r"[,\s]+"  # how one string becomes a list
    item: Callable[[str], str | None] | None = None  # why one list item is invalid, or None
    paths: str = ""  # "file": a path; "targets": TARGET specs (file paths in them are paths)
    pending: str = ""  # the issue that brings the feature: until it lands, the setting is not offered
    unset: str = "none"  # what no value means, as `attn-spec config` shows it

    @property
    def dest(self) -> str:  # the API keyword and the argparse dest of `attn-spec check`
        return self.name.replace("-", "_")

    @property
    def cli_flags(self) -> tuple[str, ...]:
        return self.flags or (f"--{self.name}",)

    @property
    def pytest_flag(self) -> str:
        return self.plugin_flag or f"--attn-{self.name}"

    @property
    def ini(self) -> str:  # the pytest ini key: the plugin flag without dashes, e.g. attn_profile
        return self.pytest_flag[2:].replace("-", "_")

    @property
    def env(self) -> str:
        return "ATTN_SPEC_" + self.name.upper().replace("-", "_")


_SETTINGS = (
    Setting("targets", "attention to check: path/to/file.py:name or package.module:name; several allowed",
            kind="list", metavar="TARGET", positional=True, plugin_flag="--attn-target", paths="targets", unset="none"),
    Setting("convention", f"force the targets' calling convention: {', '.join(vocabulary.BUILTIN)} (default: "
            f"detected; attn-spec list --conventions)", choices=vocabulary.names, metavar="NAME", unset="detected"),
    Setting("profile", f"how hard to look: {', '.join(PROFILES)} (default: default; scale: a fixed ladder of "
            f"long shapes)", choices=PROFILES,
            default="default", metavar="NAME"),
    Setting("seed", "seed for a reproducible run (default: random, printed in the report)", kind="int", metavar="N", unset="random"),
    Setting("only", "run only these property ids (attn-spec list)", kind="list", metavar="ID", unset="all"),
    Setting("skip", "skip these property ids", kind="list", metavar="ID"),
    Setting("dtypes", f"check only these dtypes: {', '.join(DTYPES)} (default: all)", kind="list",
            choices=DTYPES, metavar="DTYPE", unset="all"),
    Setting("devices", "check on these devices: cpu, cuda, mps, or all available ones (default: all; at fixed "
            "shapes, the accelerator if there is one); with several, outputs must also agree across devices", kind="list", choices=("cpu", "cuda", "mps", "all"),
            metavar="DEVICE", flags=("--device", "--devices"), unset="all available"),
    Setting("require", f"fail unless the target has this capability ({', '.join(CAPABILITIES)}) or behaviour "
            f"(KEY=VALUE as in the report header; keys: {', '.join(BEHAVIOURS)}), or length=N: the target must take "
            f"sequences of N positions (a module's probed max length), head-dims=LO-HI: every probed head dim "
            f"between, dtypes=A,B: these dtypes (a kernel's envelope)", kind="list",
            metavar="CAPABILITY|KEY=VALUE"),
    Setting("call-timeout", "seconds a call into a target may take on a small case (proportionally more on larger "
            "ones; an import 6 times as long) before it fails its property as a hang; 0 or none: no deadline",
            kind="seconds", default=10.0, metavar="SECONDS"),
    Setting("expect", "file of properties known to fail or skip, one id per line with a # comment: they do not "
            "fail the run, and stale lines are reported", metavar="FILE", paths="file"),
    Setting("masks", "mask forms the targets take: bool (True = may attend; every convention) and additive "
            "(float masks added to the scores; part of the sdpa, torch-mha and flex conventions, and of hf where "
            "Hugging Face builds float masks), e.g. bool,additive (default: the convention's)", kind="list", choices=("bool", "additive"), metavar="FORMS",
            unset="the convention's"),
    Setting("inference-only", "the targets are inference kernels: an output without autograd makes gradients a "
            "skip, not a failure (function, module and adapter targets must otherwise be differentiable)",
            kind="bool", default=False),
    Setting("isolate", "run each target in a process of its own (the one `attn-spec grade` runs a submission in): it "
            "cannot reach the kit's reference, budgets, RNG or verdict, sees no kit frame on its stack nor kit module "
            "in sys.modules, and a crash or hang fails the property that made the call; for path/to/file.py:name "
            "targets in the function or seed-module convention", kind="bool", default=False),
    Setting("layout", "input layout of function and sdpa targets: bhsd = [B, H, S, D] (PyTorch) or bshd = "
            "[B, S, H, D] (flash-attn, xformers) (default: detected where unambiguous, else bhsd)",
            choices=("bhsd", "bshd"), metavar="LAYOUT", unset="detected"),
    Setting("expect-mask", "what a FlexAttention mask_mod(b, h, q_idx, kv_idx) computes: causal, sliding-window:W, "
            "prefix-lm:P or document:IDS, joined with + (implies the mask-mod convention)", metavar="STATEMENT"),
    Setting("expect-score", "what a FlexAttention score_mod(score, b, h, q_idx, kv_idx) computes: alibi, softcap:C "
            "or relative-bias (implies the score-mod convention)", metavar="STATEMENT"),
    Setting("hf-module-attr", "an attribute of the stand-in module hf targets are called with, NAME=VALUE or "
            "config.NAME=VALUE (VALUE a Python literal), for a function that reads one the kit does not offer",
            kind="list", split=r"\s+", item=_module_attr, metavar="NAME=VALUE"),
    Setting("hf-config", "a Hugging Face model's config.json for hf targets: its fields join module.config, and "
            "num_key_value_heads < num_attention_heads makes grouped-query attention required", metavar="FILE",
            paths="file"),
    Setting("shapes", "check at these fixed shapes instead of drawn ones: B,H,N,D or B,H,[HKV,]NQ,NKV,D "
            "(grouped-query or cross attention; a varlen kernel: B packed sequences of up to NQ, NKV tokens; a decode "
            "kernel: B,H,[HKV,]S_NEW,S_CACHE,D[,page=P], B sequences of up to S_CACHE cached tokens, the last S_NEW "
            "decoded, in pages of P), on the accelerator if there is one, in the dtypes asked (default: "
            "float32 on the CPU, bfloat16 and float16 on a GPU), with every property that applies at that size",
            kind="list", split=r"\s+", item=_shape, metavar="SHAPE", unset="drawn"),
)
SETTINGS: dict[str, Setting] = {s.name: s for s in _SETTINGS}


def offered() -> list[Setting]:
    """The settings this version takes (a pending one is listed above but not yet offered)."""
    return [s for s in SETTINGS.values() if not s.pending]


# -- one value from one source ---------------------------------------------------------------------

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parse(s: Setting, raw: Any) -> Any:
    """``raw`` (a string, or a TOML/Python value) as the setting's type; KitUsageError(why) otherwise."""
    choices = s.choices() if callable(s.choices) else s.choices
    if s.kind == "bool":
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
        raise KitUsageError("must be true or false")
    if s.kind == "int":
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and re.fullmatch(r"\s*-?\d+\s*", raw):
            return int(raw)
        raise KitUsageError("must be an integer")
    if s.kind == "seconds":  # a number >= 0; 0, "none" or "off": no limit
        if isinstance(raw, str) and raw.strip().lower() in ("none", "off"):
            return 0.0
        try:
            seconds = math.nan if isinstance(raw, bool) else float(raw)
        except (TypeError, ValueError):
            seconds = math.nan
        if not 0 <= seconds < math.inf:
            raise KitUsageError("must be a number of seconds (0 or none: no limit)")
        return seconds
    if s.kind == "list":
        items = [raw] if isinstance(raw, str) else raw
        if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
            raise KitUsageError("must be a list of strings, or one string")
        values = [v for i in items for v in re.split(s.split, i.strip()) if v]
        bad = [v for v in values if choices and v not in choices]
        if bad:
            raise KitUsageError(f"{bad[0]!r} is not one of {', '.join(choices)}")
        for v in values:
            if s.item and s.item(v):
                raise KitUsageError(s.item(v))
        if "all" in values and len(values) > 1:
            raise KitUsageError("'all' stands alone")
        return values
    if not isinstance(raw, str) or not raw.strip():
        raise KitUsageError("must be a non-empty string")
    if choices and raw.strip() not in choices:
        raise KitUsageError(f"must be one of {', '.join(choices)}")
    return raw.strip()


def _relative(path: str, base: Path | None) -> str:
    """A path written relative to ``base`` (a config file's folder), as seen from the current directory."""
    if base is None or os.path.isabs(os.path.expanduser(path)):
        return path
    return os.path.relpath(base / path)


def _is_file_spec(where: str) -> bool:  # as attn_spec.targets.loading decides
    return where.endswith(".py") or os.sep in where or "/" in where


def _rebase(s: Setting, value: Any, base: Path | None) -> Any:
    if s.paths == "file":
        return _relative(value, base)
    if s.paths == "targets":
        specs = []
        for spec in value:
            where, sep, attr = spec.rpartition(":")
            specs.append(f"{_relative(where, base)}:{attr}" if sep and _is_file_spec(where) else spec)
        return specs
    return value


# -- layers ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layer:
    """Values from one source: ``values`` maps a setting name to its raw value, ``where(setting)``
    names the source of one of them, and relative paths are relative to ``base`` (None: the cwd)."""

    values: Mapping[str, Any]
    where: Callable[[Setting], str]
    base: Path | None = None


def command_line(args, *, pytest_flags: bool = False) -> Layer:
    """The settings given as flags: ``args`` is the parsed namespace (``attn-spec check``, or pytest's
    ``config.option`` with ``pytest_flags``); unset flags are None or []."""
    values = {}
    for s in offered():
        value = getattr(args, s.ini if pytest_flags else s.dest, None)
        if value not in (None, []):
            values[s.name] = value

    def where(s: Setting) -> str:
        flag = s.pytest_flag if pytest_flags else s.metavar if s.positional else s.cli_flags[0]
        return f"the command line ({flag})"

    return Layer(values, where)


def environment(environ: Mapping[str, str] | None = None) -> Layer:
    environ = os.environ if environ is None else environ
    values = {s.name: environ[s.env] for s in SETTINGS.values() if environ.get(s.env, "").strip()}
    return Layer(values, lambda s: f"environment {s.env}")


def find_pyproject(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest pyproject.toml with a [tool.attn-spec] table, from ``start`` (default: cwd) up."""
    folder = Path(start or os.getcwd()).resolve()
    for candidate in (folder, *folder.parents):
        path = candidate / "pyproject.toml"
        if path.is_file() and "tool" in (data := _read_toml(path)) and "attn-spec" in data["tool"]:
            return path
    return None


def _read_toml(path: Path) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        if "attn-spec" in path.read_text(encoding="utf-8", errors="replace"):
            raise SettingError(f"{os.path.relpath(path)}: not valid TOML: {exc}") from None
        return {}  # another tool's broken file: not ours to judge


def did_you_mean(word: str, known) -> str:
    """`` (did you mean 'the-closest'?)`` for a misspelt key or id among ``known``, or "" when none is close."""
    close = difflib.get_close_matches(word, list(known), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def pyproject(path: Path | None) -> Layer:
    """The ``[tool.attn-spec]`` table of ``path``; an unknown key is an error that suggests the right one."""
    if path is None:
        return Layer({}, lambda s: "")
    table = _read_toml(path).get("tool", {}).get("attn-spec", {})
    label = f"{os.path.relpath(path)} {TABLE}"
    if not isinstance(table, dict):
        raise SettingError(f"{label} must be a table")
    for key in table:
        if key not in SETTINGS:
            hint = did_you_mean(key.replace("_", "-"), SETTINGS)
            raise SettingError(f"{label}: unknown key {key!r}{hint}; known keys: {', '.join(SETTINGS)}")
    return Layer(table, lambda s: label, base=path.parent)


def keywords(values: Mapping[str, Any], label: str, base: Path | None = None) -> Layer:
    """Python keywords (``inference_only=True``) as a layer: the API's arguments, the pytest marker's.
    ``label`` names the source, with ``{key}`` for the keyword: "the keyword argument {key}"."""
    layer = {}
    for key, value in values.items():
        name = key.replace("_", "-")
        if name not in SETTINGS:
            raise SettingError(f"{label.format(key=key)}: unknown keyword; known: "
                               f"{', '.join(s.dest for s in offered())}")
        if value is not None:
            layer[name] = value
    return Layer(layer, lambda s: label.format(key=s.dest), base=base)


# -- the result ------------------------------------------------------------------------------------

@dataclass
class Settings:
    """The effective value of every offered setting, with where each came from."""

    values: dict[str, Any]
    sources: dict[str, str]  # name -> "environment ATTN_SPEC_PROFILE", "default", ...
    raw: dict[str, Any] = field(default_factory=dict)  # name -> the value as written, for messages
    pyproject: Path | None = None
    bases: dict[str, str | None] = field(default_factory=dict)  # name -> folder its relative paths started from

    def __getitem__(self, name: str) -> Any:
        return self.values[name]

    def error(self, name: str, why: str) -> SettingError:
        """``profile='huge' from environment ATTN_SPEC_PROFILE: must be one of ...``."""
        shown = self.raw.get(name, self.values[name])
        return SettingError(f"{name}={shown!r} from {self.sources[name]}: {why}")

    def given(self) -> dict[str, Any]:
        """API keywords for the settings that are not defaults (pending ones never appear)."""
        return {SETTINGS[n].dest: v for n, v in self.values.items() if self.sources[n] != "default"}

    def to_wire(self) -> dict:
        """A JSON-able copy, for pytest-xdist workers (which may run on another host)."""
        return {"values": self.values, "sources": self.sources, "raw": self.raw, "bases": self.bases,
                "pyproject": str(self.pyproject) if self.pyproject else None}

    @classmethod
    def from_wire(cls, data: dict) -> "Settings":
        return cls(data["values"], data["sources"], data["raw"],
                   Path(data["pyproject"]) if data["pyproject"] else None, data["bases"])


def resolve(layers: list[Layer], pyproject_path: Path | None = None) -> Settings:
    """Each offered setting from the first layer that has it (highest first), else its default."""
    settings = Settings({}, {}, pyproject=pyproject_path)
    for s in SETTINGS.values():
        for layer in layers:
            if s.name not in layer.values:
                continue
            raw, source = layer.values[s.name], layer.where(s)
            if s.pending:
                raise SettingError(f"{s.name}={raw!r} from {source}: this version of attn-spec does not have "
                                   f"it yet ({s.pending})")
            try:
                value = _parse(s, raw)
            except KitUsageError as exc:
                raise SettingError(f"{s.name}={raw!r} from {source}: {exc}") from None
            settings.values[s.name], settings.sources[s.name] = _rebase(s, value, layer.base), source
            settings.raw[s.name] = raw
            settings.bases[s.name] = None if layer.base is None else str(layer.base)
            break
        else:
            if not s.pending:
                default = list(s.default) if isinstance(s.default, list) else s.default
                settings.values[s.name] = [] if s.kind == "list" and default is None else default
                settings.sources[s.name] = "default"
    return settings


def overlay(settings: Settings, layer: Layer) -> Settings:
    """``settings`` with the values of ``layer`` on top (the pytest marker's keywords over the run's)."""
    top = resolve([layer], settings.pyproject)
    merged = Settings(dict(settings.values), dict(settings.sources), dict(settings.raw), settings.pyproject,
                      dict(settings.bases))
    for name in layer.values:
        for part in ("values", "sources", "raw", "bases"):
            getattr(merged, part)[name] = getattr(top, part)[name]
    return merged


def load(*top: Layer, start: str | os.PathLike | None = None, path: str | os.PathLike | None = None,
         environ=None, below: tuple[Layer, ...] = ()) -> Settings:
    """``top`` layers (command line, keywords) over the environment over ``below`` (pytest's ini keys)
    over pyproject.toml over defaults. The pyproject.toml is ``path`` (a file, or a folder to search
    up from), else the nearest one with a [tool.attn-spec] table from ``start`` (default: cwd) up."""
    if path is not None and not Path(path).is_file():
        start, path = path, None
    found = Path(path).resolve() if path is not None else find_pyproject(start)
    return resolve([*top, environment(environ), *below, pyproject(found)], found)


def stray_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """ATTN_SPEC_* variables that name no setting (a typo is otherwise silently ignored)."""
    environ = os.environ if environ is None else environ
    known = {s.env for s in SETTINGS.values()}
    return sorted(k for k in environ if k.startswith("ATTN_SPEC_") and k not in known)


# -- the flags, derived ----------------------------------------------------------------------------

def add_arguments(parser) -> None:
    """The settings as ``attn-spec check`` flags (``attn-spec config`` takes the same). Values stay raw
    strings here; :func:`resolve` parses them, so a bad one reads the same from every source."""
    import argparse

    for s in offered():
        if s.positional:
            parser.add_argument(s.dest, nargs="*", metavar=s.metavar,
                                help=f"{s.help} (default: targets from {TABLE} in pyproject.toml)")
        elif s.kind == "bool":
            parser.add_argument(*s.cli_flags, dest=s.dest, action=argparse.BooleanOptionalAction, default=None,
                                help=s.help)
        elif s.kind == "list":
            parser.add_argument(*s.cli_flags, dest=s.dest, nargs="+", action="extend", default=[],
                                metavar=s.metavar, help=s.help)
        else:
            parser.add_argument(*s.cli_flags, dest=s.dest, metavar=s.metavar, help=s.help)


def add_pytest_options(parser) -> None:
    """The same settings as the pytest plugin's ``--attn-*`` options and ini keys, with the same help."""
    import argparse

    group = parser.getgroup("attn-spec", "attn-spec: check attention implementations against the property catalog")
    for s in offered():
        if s.kind == "bool":
            group.addoption(s.pytest_flag, dest=s.ini, action=argparse.BooleanOptionalAction, default=None,
                            help=s.help)
        elif s.kind == "list":
            group.addoption(s.pytest_flag, dest=s.ini, action="append", default=[], metavar=s.metavar,
                            help=f"{s.help} (comma-separated; may repeat)")
        else:
            group.addoption(s.pytest_flag, dest=s.ini, metavar=s.metavar, help=s.help)
        parser.addini(s.ini, help=s.help, type="linelist" if s.kind == "list" else "string")
