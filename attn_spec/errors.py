"""The kit's exceptions, under one root: catch :class:`AttnSpecError` to catch any of them.

    AttnSpecError
    ├── Failure (also an AssertionError)   a property does not hold on the current case
    │   ├── TargetRaised                   ... because the target raised on a valid input
    │   │   ├── TargetHung                 ... or did not return within its deadline
    │   │   └── TargetDied                 ... or killed the forked child its call ran in (a signal)
    │   └── NotDifferentiable              ... because its output carries no gradient (it is trained)
    ├── Unsupported                        the target declared or lacks what a property needs
    ├── Uninformative                      the case does not make the property's relation bite
    │   └── PlatformDefect                 ... because the platform fails the kit's own formula on it
    ├── KitUsageError (also a ValueError)  the caller asked for something impossible
    ├── TargetLoadError                    a TARGET path could not be loaded
    └── IsolationError                     grading's process boundary failed (the machine's or the kit's fault)

Two control-flow signals of the grader are BaseExceptions on purpose and live beside the code that
raises them (``grading.isolation.remote.Stopped``, ``grading.isolation.sandbox.BadOutput``): they
must pass through Hypothesis and a property's ``except Exception`` untouched. Both derive from
:class:`KitSignal`, which a call into a target also lets through (every other exception raised
there, BaseExceptions included, is the target's: attn_spec.targets.guard).
"""
from __future__ import annotations


class AttnSpecError(Exception):
    """The root of every exception the kit raises on purpose."""


class KitSignal(BaseException):
    """A control-flow signal of the kit's own: passes untouched through target calls, properties and Hypothesis."""


class Failure(AttnSpecError, AssertionError):
    """A property does not hold on the current case.

    Raise it through :mod:`attn_spec.checking.assertions`, which words every failure in one grammar.
    ``message`` says what was measured and what was expected; ``cause`` is the likely bug in one
    sentence; ``got``/``expected`` are small tensors to print side by side; ``mask`` (True = may attend) the
    pattern the heatmaps hatch, where it is not the case's own mask; ``summary`` what the counterexample was,
    where it is not the case's attention inputs (a FlexAttention mod's sizes). ``vacuous``: the property
    would have held only trivially (the output ignores its inputs); the report shows it blocked by
    the root property, whose own failure names the problem.
    """

    def __init__(self, message: str, *, cause: str = "", got=None, expected=None, labels=None, inputs=None, mask=None,
                 summary: str | dict = "", vacuous: bool = False, call: str = ""):
        super().__init__(message)
        self.call = call  # the call of the target that failed, as the user would write it (the reproduce snippet's)
        self.message, self.cause, self.got, self.expected = message, cause, got, expected
        self.labels = labels  # (what got is, what expected is), e.g. ("weights read with V = identity", ...)
        self.inputs = inputs  # name -> tensor: the inputs of the call shown, when they are not the case's
        self.mask, self.summary = mask, summary
        self.vacuous = vacuous

    calls: int | None = None  # the target's calls when the relation failed (set by checking.assertions.fail)


class TargetRaised(Failure):
    """The target raised an exception (other than NotImplementedError) on a valid input."""

    def __init__(self, exc: BaseException, call: str, user_traceback: str):
        try:
            text = str(exc)
        except BaseException:  # noqa: BLE001 - an exception whose __str__ raises is still reported
            text = "(its message cannot be printed)"
        super().__init__(f"{call} raised {type(exc).__name__}: {text}",
                         cause="the attention under test crashed on a valid input; see its traceback")
        self.exc, self.user_traceback = exc, user_traceback


class TargetHung(TargetRaised):
    """The target did not return within its deadline (attn_spec.targets.deadline): ``exc`` is the kit's
    interrupt, ``user_traceback`` and ``where`` (``file.py:3 in fn``) where the target's code was when it came."""

    def __init__(self, exc: BaseException, call: str, seconds: float, user_traceback: str, where: str = ""):
        Failure.__init__(self, f"{call} did not return within {seconds:.3g} s" + (f" (stopped at {where})" if where
                                                                                   else ""),
                         cause="the attention under test never returned on a valid input: an endless loop, a wait "
                               "for something that never comes, or far too slow (--call-timeout sets the deadline)")
        self.exc, self.user_traceback, self.seconds = exc, user_traceback, seconds


class TargetDied(TargetRaised):
    """A call run in a forked child (attn_spec.targets.forked) killed that process: ``signal`` is the signal's name
    (SIGABRT, SIGSEGV), ``words`` the last line native code wrote to stderr before (glibc's "free(): invalid
    pointer"); the kit's process and the rest of the check go on."""

    def __init__(self, call: str, signal: str, likely: str, words: str = ""):
        Failure.__init__(self, f"{call}: the process died: {signal}" + (f", likely {likely}" if likely else "")
                         + (f" (its last words on stderr: {words!r})" if words else ""),
                         cause="the attention under test killed the process it ran in on a valid input"
                               + (f" ({likely})" if likely else ""))
        self.exc, self.user_traceback, self.signal = None, "", signal


class NotDifferentiable(Failure):
    """The output of a target that is trained (function, module, adapter) carries no gradient."""


class Unsupported(AttnSpecError):
    """The target declared (NotImplementedError) or lacks a capability a property needs.

    Exported as ``attn_spec.Unsupported`` for targets: ``raise attn_spec.Unsupported("2-D inputs
    only")`` in an attention declines that input, as a ``NotImplementedError`` raised from the
    target's own code does (one raised inside torch or another library is a crash instead).
    ``total``: the target never does this (it takes no such argument), so the property is a
    skip; otherwise only this input is outside what the target handles and is passed over.
    """

    def __init__(self, message: str, *, total: bool = False):
        super().__init__(message)
        self.total = total


class Uninformative(AttnSpecError):
    """The case checks nothing for this property (a mask that masks no key, a single batch element, a
    permutation of one token): the runner draws another case in its place."""


class PlatformDefect(Uninformative):
    """A property failed, and the kit's own plain formula shows the same kind of defect on exactly the inputs
    the target got (attn_spec.checking.platform): the platform's failure, not the target's. ``note``: what the
    report says once in its header (what, torch, device, dtype, shapes, workaround, reproduce)."""

    def __init__(self, note: dict):
        super().__init__(f"a platform defect, not the target's: {note['what']} (torch {note['torch']}, "
                         f"{note['device']}, {note['dtype']})")
        self.note = note


class KitUsageError(AttnSpecError, ValueError):
    """A caller asked for something impossible (an unknown profile, dtype, device or mask kind)."""


class TargetLoadError(AttnSpecError):
    """A TARGET could not be loaded: wrong path, missing name, import error, not callable."""


class IsolationError(AttnSpecError):
    """Grading's process boundary failed: a problem of the machine or the kit, never of a submission."""
