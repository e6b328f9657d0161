"""The user's own traceback of an exception, without the kit's frames: beneath loading (which reports an
import that raised) and deadline (a call stopped past its deadline), so that neither imports the other."""
from __future__ import annotations

import traceback
from pathlib import Path


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` without the kit's and importlib's own frames."""
    te = traceback.TracebackException.from_exception(exc)
    kit = str(Path(__file__).resolve().parent)
    te.stack = traceback.StackSummary.from_list(
        [f for f in te.stack if not f.filename.startswith(kit) and "importlib" not in f.filename
         and "<frozen" not in f.filename])
    return "".join(te.format()).rstrip()
