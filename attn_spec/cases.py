"""Public import path of the test cases (``from attn_spec.cases import Case``); they live in :mod:`attn_spec.checking.cases`."""
from attn_spec.checking.cases import DTYPES, Case, MhaCase, available_devices

__all__ = ["DTYPES", "Case", "MhaCase", "available_devices"]
