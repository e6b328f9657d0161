"""What a check costs a kernel with an envelope: examples drawn against examples that checked something.

A declined case (the target's own refusal) checks nothing; a kit that redraws such cases blindly pays for them (before
#35: rows-sum-to-one drew 164 examples for 7 informative ones on a kernel taking d_v = d_k only, since its V = ones
[n_kv, 1] was declined unless d_k = 1; now the kit fits its own probes' widths into the envelope). The 7 declined
after are the one explicit example of each property the kernel cannot take (gqa, window, softcap, dropout, ...). For each kernel below, per property: the examples Hypothesis ran, those the
target took (informative), those it declined, and those that raised something else (a case the property found
uninformative). Plain torch, CPU, the quick profile.

    python benchmarks/bench_envelope.py [--profile quick] [--seed 1]

Measured on this 2-core machine (quick, seed 1), before and after the envelope (#35 items 2, 3, 6):

  same_width (d_v = d_k only)     314 examples, 132 informative  ->  149 examples, 135 informative
  declares (head dims 16..128,    nothing checked (every d = 2     ->  144 examples, 134 informative, CONFORMS within
  float16/bfloat16, n_q = n_kv)   baseline probe declined)             head dims 16/32/64/128, ...
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import attn_spec  # noqa: E402
from attn_spec.checking import runner  # noqa: E402
from attn_spec.errors import Unsupported  # noqa: E402
from gallery import kernels  # noqa: E402


def declares(q, k, v, is_causal=False, scale=None):
    """A kernel's envelope declared with NotImplementedError: head dims 16..128, half precision, d_v = d_k, n_q = n_kv."""
    if q.shape[-1] not in (16, 32, 64, 128) or q.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError("head dims 16, 32, 64, 128; float16 and bfloat16")
    if v.shape[-1] != q.shape[-1] or q.shape[-2] != k.shape[-2]:
        raise NotImplementedError("d_v == d_k, n_q == n_kv")
    return kernels.flash(q, k, v, is_causal, scale)


def same_width(q, k, v, is_causal=False, scale=None):
    """Any head dim, but d_v = d_k only."""
    if v.shape[-1] != q.shape[-1]:
        raise NotImplementedError("d_v == d_k only")
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)


def measure(kernel, profile: str, seed: int):
    counts = collections.defaultdict(collections.Counter)
    judge = runner.judge

    def counted(prop, target, case):
        try:
            judge(prop, target, case)
        except Unsupported:
            counts[prop.id]["declined"] += 1
            raise
        except BaseException:
            counts[prop.id]["other"] += 1
            raise
        counts[prop.id]["informative"] += 1

    runner.judge = counted
    try:
        report = attn_spec.check(kernel, profile=profile, seed=seed)
    finally:
        runner.judge = judge
    t = report.targets[0]
    print(f"{kernel.__name__}: {t.verdict}")
    total = collections.Counter()
    for p in t.properties:
        if p.examples:
            c = counts[p.id]
            total.update(c, examples=p.examples)
            print(f"  {p.id:26s} {p.status:5s} drawn {p.examples:4d}  informative {c['informative']:4d}  "
                  f"declined {c['declined']:4d}  other {c['other']:3d}")
    print(f"  total: drawn {total['examples']}, informative {total['informative']}, declined {total['declined']}\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="quick")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    for kernel in (same_width, declares):
        measure(kernel, args.profile, args.seed)


if __name__ == "__main__":
    main()
