"""The kit's exceptions: what a property raises when it does not hold, and why a check stops."""
from __future__ import annotations


class Failure(AssertionError):
    """A property does not hold on the current case.

    ``message`` says what was expected and what happened; ``cause`` is the likely bug in one
    sentence; ``got``/``expected`` are small tensors to print side by side.
    """

    def __init__(self, message: str, *, cause: str = "", got=None, expected=None):
        super().__init__(message)
        self.message, self.cause, self.got, self.expected = message, cause, got, expected


class TargetRaised(Failure):
    """The target raised an exception (other than NotImplementedError) on a valid input."""

    def __init__(self, exc: BaseException, call: str, user_traceback: str):
        super().__init__(f"{call} raised {type(exc).__name__}: {exc}",
                         cause="the attention under test crashed on a valid input; see its traceback")
        self.exc, self.user_traceback = exc, user_traceback


class Unsupported(Exception):
    """The target declared (NotImplementedError) or lacks a capability a property needs.

    ``total``: the target never does this (it takes no such argument), so the property is a
    skip; otherwise only this input is outside what the target handles and is passed over.
    """

    def __init__(self, message: str, *, total: bool = False):
        super().__init__(message)
        self.total = total


class TargetLoadError(Exception):
    """A TARGET could not be loaded: wrong path, missing name, import error, not callable."""
