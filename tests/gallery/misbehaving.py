"""Targets that misbehave towards the kit rather than compute attention wrong: they raise from
their backward, exit, return a generator, change global state, print megabytes, warn on every
call. Each must get a clear verdict of its own and leave every other target of the same run
untouched (tests/test_misbehaving.py). Not in CORRECT or BUGGY: their verdicts are not one
property failing."""
import logging
import os
import sys
import tempfile
import warnings

import torch

from gallery.core import seed_function

CHATTY_LINE = "chatty attention: " + "." * 10_000  # printed on every call: megabytes over a check


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward kernel not built for this GPU")


def raises_in_backward(Q, K, V, mask=None):
    """A correct forward whose custom backward raises."""
    return _Boom.apply(seed_function(Q, K, V, mask))


def raises_system_exit(Q, K, V, mask=None):
    sys.exit(3)


class Abort(BaseException):
    """A home-made interrupt: a BaseException, not an Exception."""


def raises_base_exception(Q, K, V, mask=None):
    raise Abort("stop everything")


def raises_keyboard_interrupt(Q, K, V, mask=None):
    """Raises KeyboardInterrupt itself: no Ctrl-C was pressed, so it is the target's failure."""
    raise KeyboardInterrupt


def raises_generator_exit(Q, K, V, mask=None):
    raise GeneratorExit


def returns_generator(Q, K, V, mask=None):
    yield seed_function(Q, K, V, mask)


def leaves_grad_mode_off(Q, K, V, mask=None):
    out = seed_function(Q, K, V, mask)
    torch.set_grad_enabled(False)
    return out


def changes_default_dtype(Q, K, V, mask=None):
    torch.set_default_dtype(torch.float64)
    return seed_function(Q, K, V, mask)


def changes_everything(Q, K, V, mask=None):
    """Reseeds the RNG, flips backend flags, moves the default device and the working directory."""
    torch.manual_seed(1234)
    torch.set_float32_matmul_precision("medium")
    torch.backends.mkldnn.enabled = False
    torch.set_default_device("meta")
    torch.set_num_threads(1)
    os.chdir(tempfile.gettempdir())
    return seed_function(Q, K, V, mask)


def prints_megabytes(Q, K, V, mask=None):
    print(CHATTY_LINE)
    print("and on stderr", file=sys.stderr)
    return seed_function(Q, K, V, mask)


def warns_every_call(Q, K, V, mask=None):
    warnings.warn("attention: falling back to the slow path", UserWarning)
    logging.getLogger("chatty.attention").warning("slow path for shape %s", tuple(Q.shape))
    return seed_function(Q, K, V, mask)


MISBEHAVING = [raises_in_backward, raises_system_exit, raises_base_exception, raises_keyboard_interrupt,
               raises_generator_exit, returns_generator, leaves_grad_mode_off, changes_default_dtype,
               changes_everything, prints_megabytes, warns_every_call]
