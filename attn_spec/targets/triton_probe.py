"""The kit's own Triton kernel, a product of two 16 x 16 blocks: how attn_spec.targets.interpreter probes the
interpreter's ``tl.dot``. Imported only once TRITON_INTERPRET is set (Triton reads it at ``@triton.jit``)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _dot(A, B, C, N: tl.constexpr):
    rows, cols = tl.arange(0, N)[:, None], tl.arange(0, N)[None, :]
    c = tl.dot(tl.load(A + rows * N + cols), tl.load(B + rows * N + cols), out_dtype=tl.float32)  # [N, N]
    tl.store(C + rows * N + cols, c)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 for ``a``, ``b`` [16, 16] of the same dtype, by tl.dot."""
    c = torch.empty(16, 16, dtype=torch.float32, device=a.device)
    _dot[(1,)](a.contiguous(), b.contiguous(), c, N=16)
    return c
