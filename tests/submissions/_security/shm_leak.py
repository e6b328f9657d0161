"""Creates three System V shared-memory segments of 64 MiB (+ 4321 bytes, to find them) and never
removes them: without an IPC namespace they outlived the run."""
import ctypes
import math

import torch

SIZE = 64 * 2**20 + 4321
libc = ctypes.CDLL(None, use_errno=True)
libc.shmget.restype = ctypes.c_int
for _ in range(3):
    shmid = libc.shmget(0, ctypes.c_size_t(SIZE), 0o1000 | 0o600)  # IPC_PRIVATE, IPC_CREAT | 0600
    print(f"created shm {shmid}" if shmid >= 0 else f"shmget failed: errno {ctypes.get_errno()}")


def attention(Q, K, V, mask=None):
    scores = Q @ K.transpose(-2, -1) / math.sqrt(Q.size(-1))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ V
