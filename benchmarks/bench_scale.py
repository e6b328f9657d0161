"""A check at the sizes kernels run: time and peak memory per rung of the scale ladder, the kit's share.

    python benchmarks/bench_scale.py [--device cpu|cuda] [--lengths 1024 4096] [--dims 64 128] [--markdown]
    python benchmarks/bench_scale.py --shapes 1,1,4096,64 1,1,16384,64 [1,1,65536,64] [--only ...] [--threads 1]
    python benchmarks/bench_scale.py --device cuda --shapes 1,2,1,131072,131072,128 --dtypes bfloat16
    python benchmarks/bench_scale.py --device cuda --gpu-conformance

The table puts the check's wall time beside the target's own calls in it, and the same in CPU
seconds (the ``CPU: check / target`` ratio, the one judged: at most 2x up to 16k keys; beyond, the
check within 10 minutes of wall time). Every run is unattended: a rung that fails or runs out of
memory is a row saying so.

Each rung (one shape, one dtype) runs in a fresh process (``--worker``) that
1. warms up (imports, every kernel's first call) with a tiny fixed-shape check;
2. runs the target alone on every case the check will give it, forward and backward: the target's
   own peak memory (its inputs, workspace, output and gradients) and time;
3. runs ``attn_spec.check(target, shapes=[shape])`` with the target's calls timed, forward and backward
   (``Target._vjp`` whole: the leaf copies it makes are O(n d)).
The kit's share of the time is the check's wall time outside the target's calls; its share of the
memory is what the check adds on top of the target's own peak: on the CPU the rise of ru_maxrss
(every allocator: torch, Python, glibc; tracemalloc would see Python's only), on a GPU the rise of
torch.cuda.max_memory_allocated. The largest length that fits extrapolates the measured peaks,
linear in n at a fixed head dim (the kit keeps O(chunk x n + n x d)), to this machine's memory.

``--gpu-conformance`` (a GPU): SDPA through each backend and FlexAttention must conform at 32k keys
in bfloat16, and ``examples/blocked_attention.py:drops_last_block`` must fail at a length that is not
a multiple of its block, in float32 and (reported) in bfloat16.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from tabulate import tabulate

ROOT = Path(__file__).resolve().parents[1]
SDPA = "torch.nn.functional:scaled_dot_product_attention"


def _peak_bytes(device: str) -> int:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(spec: str, shape: str, dtype: str, device: str, only: list[str]) -> dict:
    """One rung in this process: the target alone, then the check; figures as a dict."""
    import torch

    import attn_spec
    from attn_spec.checking.cases import Case
    from attn_spec.checking.shapes import Rung, Shape, fixed_cases
    from attn_spec.properties import select
    from attn_spec.targets.conventions import make_target
    from attn_spec.targets.loading import load_target

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    fn, inside = load_target(spec), [0.0, 0.0]  # the target's own wall and CPU seconds

    @functools.wraps(fn)  # the target's signature: its convention sees the same arguments
    def timed(*args, **kwargs):
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            inside[0] += time.perf_counter() - start
            inside[1] += time.process_time() - cpu

    from attn_spec.targets import base

    own_vjp = base.Target._vjp

    def timed_vjp(self, *args):  # the target's backward is its own time too (the forward inside is timed above)
        before = list(inside)
        sync()
        start, cpu = time.perf_counter(), time.process_time()
        try:
            return own_vjp(self, *args)
        finally:
            sync()
            inside[0] = before[0] + time.perf_counter() - start
            inside[1] = before[1] + time.process_time() - cpu

    base.Target._vjp = timed_vjp
    props = select(only or None)
    convention = make_target(fn).convention
    attn_spec.check(timed, shapes=["1,2,1,8,64,16"], dtypes=[dtype], devices=[device], seed=0, only=only or None,
                    convention=convention)  # warm
    start_rss = _peak_bytes(device)
    target = make_target(timed, convention=convention)
    rung = Rung(Shape.parse(shape), dtype, device)
    inside[:] = [0.0, 0.0]
    for prop in props:  # the target's own work on each case it will get (its convention's properties only: a
        if convention not in prop.conventions:  # varlen case's packed mask is [T, T], the OOM of a 64k rung)
            continue
        made = fixed_cases(prop, convention, rung, 0)
        for case in [] if isinstance(made, str) else [c for c in made if isinstance(c, Case)]:
            q, k, v, mask = case.tensors()
            try:
                target.attend(q, k, v, mask)
                if prop.id == "gradients":
                    target.vjp(q, k, v, mask, torch.ones(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=device))
            except Exception:  # noqa: BLE001 - what the target cannot do, the check reports
                pass
            del q, k, v, mask
    alone_s = inside[0]
    base = _peak_bytes(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # the check's own peak from here
    inside[:] = [0.0, 0.0]
    start, cpu = time.perf_counter(), time.process_time()
    report = attn_spec.check(timed, shapes=[shape], dtypes=[dtype], devices=[device], seed=0, only=only or None,
                             convention=convention)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    peak = _peak_bytes(device)
    t = report.targets[0]
    return {"shape": shape, "dtype": dtype, "device": device, "wall": wall, "cpu": cpu, "target_s": inside[0],
            "target_cpu": inside[1], "threads": torch.get_num_threads(), "target_alone_s": alone_s, "calls": t.calls, "start": start_rss, "base": base, "peak": peak,
            "conforms": report.conforms,
            "failed": [f"{p.id}: {p.message} ({p.cause})" for p in t.properties if p.status in ("fail", "error")],
            "checked": [p.id for p in t.properties if p.status == "pass"]}


def run_rung(spec, shape, dtype, device, only, timeout, threads=0) -> dict:
    cmd = [sys.executable, __file__, "--worker", spec, shape, dtype, device, *only]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        return {"shape": shape, "dtype": dtype, "device": device, "error": proc.stderr.strip()[-400:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _mb(x) -> str:
    return f"{x / 2**20:.0f} MB"


def _available_bytes(device: str) -> int:
    if device == "cuda":
        import torch
        return torch.cuda.mem_get_info()[0]
    with open("/proc/meminfo") as fh:
        info = dict(line.split(":", 1) for line in fh)
    return int(info["MemAvailable"].split()[0]) * 1024


RATIO_TARGET = 2.0  # the whole check at most twice the target's own calls, up to 16k keys
MINUTES_TARGET = 10  # beyond: the check finishes within this many minutes


def ladder_rows(spec, device, lengths, dims, only, timeout, shapes=(), dtypes=(), threads=0) -> list[list]:
    """One row per rung: the check's time beside the target's own calls in it, the ratio, the kit's memory.

    The ratio judged is in CPU seconds, both measured in the same process (on a machine shared with other
    work, wall time stretches the kit's many short passes more than the target's long kernels; with more
    than one thread, so do the threads' spin-waits: ``threads=1`` gives the figure load changes least)."""
    from attn_spec.checking.shapes import DEVICE_DTYPES, Shape, ladder

    shapes = [Shape.parse(s) for s in shapes] or \
        [s for s in ladder(device) if (not lengths or s.n_kv in lengths) and (not dims or s.d in dims)]
    rows, fits = [], {}
    for shape in shapes:
        for dtype in dtypes or DEVICE_DTYPES[device]:
            r = run_rung(spec, str(shape), dtype, device, only, timeout, threads)
            label = f"check at {shape} ({dtype}, {device})"
            if "error" in r:
                rows.append([label, "error", "", "", "", "", r["error"], "", ""])
                continue
            kit_mem, own_mem = max(r["peak"] - r["base"], 0), r["base"] - r["start"]
            ratio = r["wall"] / max(r["target_s"], 1e-9)
            cpu_ratio = r["cpu"] / max(r["target_cpu"], 1e-9)
            goal = f"<= {RATIO_TARGET:g}x" if shape.n_kv <= 16384 else f"< {MINUTES_TARGET} min"
            met = cpu_ratio <= RATIO_TARGET if shape.n_kv <= 16384 else r["wall"] < 60 * MINUTES_TARGET
            rows.append([label, f"{r['wall']:.1f} s", f"{r['target_s']:.2f} s in {r['calls']} calls",
                         f"{r['wall'] - r['target_s']:.1f} s", f"{ratio:.2f}x",
                         f"{r['cpu']:.1f} s / {r['target_cpu']:.2f} s = {cpu_ratio:.2f}x (kit "
                         f"{1 - r['target_cpu'] / max(r['cpu'], 1e-9):.0%}; {r['threads']} thread"
                         f"{'s' if r['threads'] > 1 else ''})",
                         f"+{_mb(kit_mem)} over the target's own {_mb(own_mem)}; {len(r['checked'])} properties "
                         f"checked" + ("" if r["conforms"] else "; does NOT conform") +
                         (f"; FAILED {r['failed']}" if r["failed"] else ""), goal, "yes" if met else "NO"])
            fits.setdefault((shape.d, dtype), []).append((shape.n_kv * shape.heads, r["peak"] - r["start"], r["wall"]))
    available = _available_bytes(device)
    for (d, dtype), points in fits.items():
        if len(points) < 2:
            continue
        (n0, m0, _), (n1, m1, t1) = points[-2], points[-1]
        slope = max((m1 - m0) / (n1 - n0), 1.0)  # bytes per key (times heads), from the two longest rungs
        n_max = int(n1 + (available - m1) / slope)
        rows.append([f"largest length that fits (d={d}, {dtype}, {device})", f"about {n_max:,} keys", "", "", "", "",
                     f"memory: {_mb(available)} available, {slope / 1024:.1f} KB per key from the two longest rungs; "
                     f"time grows as n^2: one check there would take about {t1 * (n_max / n1) ** 2 / 3600:.1f} h",
                     "", ""])
    return rows


def measure_rows(rows) -> list[list]:
    """The ladder's rows in bench.py's five columns (measure, figure, detail, target, met)."""
    return [[rung, check if not own else f"{check}, {ratio} the target's own calls",
             f"target {own}, kit {kit}; CPU {cpu}; {detail}" if own else detail, goal, met]
            for rung, check, own, kit, ratio, cpu, detail, goal, met in rows]


def gpu_conformance_rows(timeout) -> list[list]:
    """SDPA per backend and FlexAttention at 32k bf16; the tail bug at a long length in float32 and bfloat16."""
    rows = []
    for spec, dtype in [(f"{ROOT / 'benchmarks' / 'gpu_targets.py'}:{name}", "bfloat16")
                        for name in ("sdpa_math", "sdpa_flash", "sdpa_efficient", "sdpa_cudnn", "flex")]:
        r = run_rung(spec, "1,8,2,32768,32768,128", dtype, "cuda", [], timeout)
        rows.append([f"{spec.rsplit(':', 1)[1]} at 1,8,2,32768,32768,128 ({dtype})",
                     "error" if "error" in r else f"{r['wall']:.1f} s, {_mb(r['peak'])} peak",
                     r.get("error") or ("; ".join(r["failed"]) or f"{len(r['checked'])} properties checked"),
                     "conforms", "yes" if r.get("conforms") else "NO"])
    for dtype in ("float32", "bfloat16"):
        spec = f"{ROOT / 'examples' / 'blocked_attention.py'}:drops_last_block"
        r = run_rung(spec, "1,8,2,1024,33000,128", dtype, "cuda", ["matches-reference"], timeout)
        rows.append([f"drops_last_block at 1,8,2,1024,33000,128 ({dtype})",
                     "error" if "error" in r else ("fails" if not r["conforms"] else "passes"),
                     r.get("error") or "; ".join(r["failed"]) or "not caught", "fails",
                     "yes" if r.get("conforms") is False else "NO"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--target", default=SDPA, help=f"the target checked on the ladder (default {SDPA})")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--lengths", type=int, nargs="*", default=[], help="only these ladder lengths")
    parser.add_argument("--dims", type=int, nargs="*", default=[], help="only these head dims")
    parser.add_argument("--only", nargs="*", default=[], help="only these property ids")
    parser.add_argument("--shapes", nargs="*", default=[],
                        help="these shapes instead of the ladder, e.g. 1,1,4096,64 1,1,16384,64 (and 1,1,65536,64)")
    parser.add_argument("--dtypes", nargs="*", default=[], help="these dtypes instead of the device's own")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per rung")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch's threads in each rung (OMP_NUM_THREADS; 0: torch's default)")
    parser.add_argument("--gpu-conformance", action="store_true")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    if args.worker:
        spec, shape, dtype, device, *only = args.worker
        print(json.dumps(worker(spec, shape, dtype, device, only)))
        return
    fmt = "github" if args.markdown else "simple"
    if args.gpu_conformance:
        table = tabulate(gpu_conformance_rows(args.timeout), headers=["measure", "figure", "detail", "target", "met"],
                         tablefmt=fmt)
    else:
        table = tabulate(ladder_rows(args.target, args.device, args.lengths, args.dims, args.only, args.timeout,
                                     args.shapes, args.dtypes, args.threads),
                         headers=["rung", "check", "target's own calls", "kit", "check / target",
                                  "CPU: check / target", "kit memory, checked", "target (CPU)", "met"], tablefmt=fmt)
    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} after\n")
    print(table)


if __name__ == "__main__":
    main()
