"""The statistics of one activation: the eager route against one-pass kernels.

Times, per tensor of SmallCNN's and TinyTransformer's activation shapes, what the recorder
does in a hook on the CPU:

  eager      ``summarize`` and per-unit ``activity`` (torch, four or five passes, 2 threads)
  one-pass   ``summarize_with_activity``: the numba kernel, one pass (the default); tensors of
             131,072 values or more on torch's OpenMP threads
  1 thread   the same kernel kept to one thread

and prints the one-pass kernel's one-time warm-up, in fresh processes, with numba's cache
empty and then filled. With ``--inductor`` it also times single functions compiled by
torch.compile (inductor, dynamic shapes) that compute the same sums, extremes, zero count
and per-unit positive counts, accumulating in float64 and in float32, and what compiling
them cost (the route docs/PERFORMANCE.md weighed first).

Run: python benchmarks/bench_stats_kernels.py [--reps 9] [--inductor]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from hooktrace.recorder import omp
from hooktrace.recorder.stats import activity, route, summarize, summarize_with_activity

# (shape, unit dimension): SmallCNN's conv activations (channels), TinyTransformer's
# (features, the last dimension)
SHAPES = [
    ((32, 16, 32, 32), 1),
    ((32, 32, 16, 16), 1),
    ((32, 64, 8, 8), 1),
    ((16, 64, 128), 2),
    ((16, 64, 256), 2),
]


def fused64(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, min, max, zero count) in float64, and positives per unit, of a
    tensor viewed as (before the unit, units, after it)."""
    d = x3.double()
    totals = torch.stack(
        [d.sum(), (d * d).sum(), x3.amin().double(), x3.amax().double(), (x3 == 0).sum().double()]
    )
    return totals, (x3 > 0).sum((0, 2))


def fused32(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`fused64`, accumulating in float32."""
    totals = torch.stack([x3.sum(), (x3 * x3).sum(), x3.amin(), x3.amax(), (x3 == 0).sum().float()])
    return totals, (x3 > 0).sum((0, 2))


def median_us(f: Callable[[], object], reps: int, inner: int = 50) -> float:
    f()
    f()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(inner):
            f()
        times.append((time.perf_counter() - start) / inner)
    return statistics.median(times) * 1e6


def warmup_seconds() -> tuple[float, float]:
    """The one-pass kernel's warm-up in a fresh process: numba's cache empty, then filled."""
    probe = "from hooktrace.recorder.stats import route; print(route().warmup_s)"
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache}
        cold, warm = (
            float(subprocess.check_output([sys.executable, "-c", probe], env=env, text=True))
            for _ in range(2)
        )
    return cold, warm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile kernels")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {route().description}")
    cold, warm = warmup_seconds()
    print(f"one-pass warm-up, once per process: {cold:.2f} s compiling, {warm:.2f} s from cache")
    compiled = {}
    if args.inductor:
        for name, function in (("float64", fused64), ("float32", fused32)):
            start = time.perf_counter()
            kernel = torch.compile(function, dynamic=True)
            for shape in [(3, 5, 7), (2, 9, 4)]:  # dynamic shapes: two sizes compile it for all
                kernel(torch.randn(shape))
            compiled[f"inductor {name}"] = kernel
            print(f"compiling the {name} kernel: {time.perf_counter() - start:.1f} s (once)")
    torch.manual_seed(0)
    names = ["one-pass", "1 thread", *compiled]
    header = "".join(f" {name + ' us':>21} {'ratio':>6}" for name in names)
    print(f"  {'shape':<18} {'eager us':>9}{header}")
    for shape, dim in SHAPES:
        x = torch.randn(shape).relu_()
        scratch = torch.empty(x.numel())

        def eager(x: torch.Tensor = x, dim: int = dim, scratch: torch.Tensor = scratch) -> None:
            summarize(x, scratch=scratch)
            activity(x, dim, scratch=scratch)

        def one_pass(x: torch.Tensor = x, dim: int = dim) -> None:
            summarize_with_activity(x, dim)

        stats, counts = summarize_with_activity(x, dim)
        assert counts is not None and counts.tolist() == activity(x, dim).tolist()
        assert stats is not None and stats[5] == (x == 0).sum().item()

        def one_thread(x: torch.Tensor = x, dim: int = dim) -> None:
            threads = omp.threads
            omp.threads = lambda: 1  # what kernel.one_pass asks before a large tensor
            try:
                summarize_with_activity(x, dim)
            finally:
                omp.threads = threads

        eager_us = median_us(eager, args.reps)
        line = f"  {shape!s:<18} {eager_us:9.1f}"
        for run_one in (one_pass, one_thread):
            us = median_us(run_one, args.reps)
            line += f" {us:21.1f} {us / eager_us:6.2f}"
        x3 = x.view(math.prod(shape[:dim]), shape[dim], -1)
        for kernel in compiled.values():
            totals, counts = kernel(x3)
            assert counts.tolist() == activity(x, dim).tolist()
            assert totals[4].item() == (x == 0).sum().item()

            def run(kernel: Callable[..., Any] = kernel, x3: torch.Tensor = x3) -> None:
                totals, counts = kernel(x3)
                totals.tolist(), counts.tolist()  # the values on the host, as the writer needs

            fused_us = median_us(run, args.reps)
            line += f" {fused_us:21.1f} {fused_us / eager_us:6.2f}"
        print(line)


if __name__ == "__main__":
    main()
