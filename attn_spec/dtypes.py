"""The dtypes the kit checks, by name, in the order they are listed (``--dtypes``; every target's default)."""
import torch

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
