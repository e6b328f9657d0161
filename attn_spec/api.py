"""The kit's Python API: ``attn_spec.check`` (a whole report) and ``attn_spec.reproduce`` (one case).

``attn_spec.properties.check_property`` runs one property with Hypothesis from your own tests.
"""
from __future__ import annotations

import random

from attn_spec.checking.assertions import restate
from attn_spec.checking.cases import DTYPES, available_devices
from attn_spec.checking.runner import check_target
from attn_spec.checking.strategies import checked, get_profile
from attn_spec.errors import Failure
from attn_spec.properties import select
from attn_spec.report import Report
from attn_spec.targets.behaviours import parse_requirements
from attn_spec.targets.capabilities import parse_capabilities
from attn_spec.targets.conventions import Target, make_target
from attn_spec.targets.loading import load_target
from attn_spec.version import __version__


def check(*targets, name=None, convention=None, profile="default", seed=None, only=None, skip=None,
          dtypes=None, devices=None, progress=None, require=None, exitfirst=False) -> Report:
    """Check attention functions or modules against the catalog; returns a :class:`Report`.

    >>> report = attn_spec.check(my_attention, profile="quick")
    >>> report.conforms, print(report)
    """
    get_profile(profile)
    parse_requirements(require)  # usage errors before any work
    parse_capabilities(require)
    props = select(only, skip)
    seed = random.randrange(2**32) if seed is None else seed
    dtypes = checked(dtypes or list(DTYPES), DTYPES, "dtypes")
    devices = checked(devices or available_devices(), available_devices(), "devices")
    reports = []
    for obj in targets:
        target = obj if isinstance(obj, Target) else make_target(obj, name if len(targets) == 1 else None, convention)
        reports.append(check_target(target, props, profile=profile, seed=seed, dtypes=dtypes,
                                    devices=devices, progress=progress, require=require, exitfirst=exitfirst))
    return Report(reports, __version__, profile, seed, devices=devices, dtypes=dtypes)


def reproduce(property_id: str, target, case, *, convention=None) -> None:
    """Run one property on one case; raises the Failure (with its diagnosis) if it does not hold."""
    prop = select(only=[property_id])[0]
    obj = load_target(target) if isinstance(target, str) else target
    adapter = obj if isinstance(obj, Target) else make_target(obj, target if isinstance(target, str) else None,
                                                               convention)
    try:
        prop.fn(adapter, case)
    except Failure as failure:
        restate(failure, f"{property_id}: ")
    print(f"{property_id} holds on {case.summary()}")
