"""The statistics of one activation: hooktrace's eager route against one fused kernel.

Times, per tensor of SmallCNN's and TinyTransformer's activation shapes, what the recorder
does in a hook on the CPU (``summarize`` and per-unit ``activity``, with the scratch buffer)
against single functions compiled by torch.compile (inductor, dynamic shapes) that compute
the same sums, extremes, zero count and per-unit positive counts: one accumulating in
float64, one in float32 (as the eager route does). Also prints what compiling cost, once.
This is the measurement behind docs/PERFORMANCE.md's "way forward".

Run: python benchmarks/bench_stats_kernels.py [--reps 9] [--no-compile]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from hooktrace.recorder.stats import activity, summarize

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--no-compile", action="store_true", help="time the eager route only")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    compiled = {}
    if not args.no_compile:
        for name, function in (("float64", fused64), ("float32", fused32)):
            start = time.perf_counter()
            kernel = torch.compile(function, dynamic=True)
            for shape in [(3, 5, 7), (2, 9, 4)]:  # dynamic shapes: two sizes compile it for all
                kernel(torch.randn(shape))
            compiled[name] = kernel
            print(f"compiling the {name} kernel: {time.perf_counter() - start:.1f} s (once)")
    torch.manual_seed(0)
    header = "".join(f" {name + ' us':>11} {'ratio':>6}" for name in compiled)
    print(f"  {'shape':<18} {'eager us':>9}{header}")
    for shape, dim in SHAPES:
        x = torch.randn(shape).relu_()
        scratch = torch.empty(x.numel())

        def eager(x: torch.Tensor = x, dim: int = dim, scratch: torch.Tensor = scratch) -> None:
            summarize(x, scratch=scratch)
            activity(x, dim, scratch=scratch)

        eager_us = median_us(eager, args.reps)
        line = f"  {shape!s:<18} {eager_us:9.1f}"
        x3 = x.view(math.prod(shape[:dim]), shape[dim], -1)
        for kernel in compiled.values():
            totals, counts = kernel(x3)
            assert counts.tolist() == activity(x, dim).tolist()
            assert totals[4].item() == (x == 0).sum().item()

            def run(kernel: Callable[..., Any] = kernel, x3: torch.Tensor = x3) -> None:
                totals, counts = kernel(x3)
                totals.tolist(), counts.tolist()  # the values on the host, as the writer needs

            fused_us = median_us(run, args.reps)
            line += f" {fused_us:11.1f} {fused_us / eager_us:6.2f}"
        print(line)


if __name__ == "__main__":
    main()
