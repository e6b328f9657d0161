"""Calibrate the error budget: how far do *correct* implementations stray from the float64 reference?

For every correct variant in the gallery and every dtype, draw random cases (thorough profile
shapes and magnitudes) and print the worst ratio of the variant's error to
  (a) the naive same-dtype error (what FACTOR must cover), and
  (b) the floor unit eps(dtype) * max|V| * sqrt(n_kv) (what FLOOR_ULPS must cover when the
      naive implementation is lucky).
A variant passes when  err <= FACTOR * naive + FLOOR_ULPS * unit;  the last column shows the
smallest FACTOR that would pass every case given the current floor.

    python benchmarks/calibrate_tolerance.py [--cases 300]
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from tabulate import tabulate  # noqa: E402

from attn_spec import reference, strategies, tolerance  # noqa: E402
from gallery import CORRECT  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=300)
    args = parser.parse_args()
    variants = [e for e in CORRECT if e.convention == "function"]
    rows = []
    for dtype in strategies.DTYPES:
        stats = {e.name: [0.0, 0.0, 0.0] for e in variants}  # worst err/naive, err/unit, needed factor

        @settings(max_examples=args.cases, database=None, deadline=None, suppress_health_check=list(HealthCheck))
        @given(strategies.cases("thorough", dtypes=[dtype]))
        def sample(case):
            q, k, v, mask = case.tensors()
            ref, _ = reference.attention(q, k, v, mask)
            naive = tolerance.naive_error(q, k, v, mask, ref)
            unit = tolerance.floor_unit(q, k, v)
            for e in variants:
                err = tolerance.max_error(e.obj(q, k, v, mask), ref)
                s = stats[e.name]
                s[0] = max(s[0], err / naive if naive else (0.0 if err == 0 else math.inf))
                s[1] = max(s[1], err / unit)
                slack = err - tolerance.FLOOR_ULPS * unit
                s[2] = max(s[2], slack / naive if slack > 0 and naive else (math.inf if slack > 0 else 0.0))

        sample()
        rows += [[dtype, name, f"{a:.3g}", f"{b:.3g}", f"{c:.3g}"] for name, (a, b, c) in stats.items()]
    print(tabulate(rows, headers=["dtype", "variant", "max err/naive", "max err/unit", "FACTOR needed"]))
    print(f"\ncurrent: FACTOR={tolerance.FACTOR}, FLOOR_ULPS={tolerance.FLOOR_ULPS}")


if __name__ == "__main__":
    main()
