"""The statistics of one activation: hooktrace's eager route against one fused kernel.

Times, per tensor of SmallCNN's activation shapes, what the recorder does in a hook on the
CPU (``summarize`` and per-channel ``activity``, with the scratch buffer) against a single
function compiled by torch.compile (inductor) that computes the same sums, extremes, zero
count and per-channel positive counts in one pass per output. Also prints what compiling
cost, once. This is the measurement behind docs/PERFORMANCE.md's "way forward".

Run: python benchmarks/bench_stats_kernels.py [--reps 9] [--no-compile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from hooktrace.recorder.stats import activity, summarize

SHAPES = [(32, 16, 32, 32), (32, 32, 16, 16), (32, 64, 8, 8)]


def fused(x3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, sum of squares, min, max, zero count) in float64, and positives per channel."""
    d = x3.double()
    totals = torch.stack(
        [d.sum(), (d * d).sum(), x3.amin().double(), x3.amax().double(), (x3 == 0).sum().double()]
    )
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
    compiled = None
    if not args.no_compile:
        start = time.perf_counter()
        compiled = torch.compile(fused, dynamic=True)
        for shape in [(3, 5, 7), (2, 9, 4)]:  # dynamic shapes: two sizes compile it for all
            compiled(torch.randn(shape))
        print(f"compiling the fused kernel: {time.perf_counter() - start:.1f} s (once)")
    torch.manual_seed(0)
    print(f"  {'shape':<18} {'eager us':>9} {'fused us':>9} {'ratio':>6}")
    for shape in SHAPES:
        x = torch.randn(shape).relu_()
        scratch = torch.empty(x.numel())

        def eager(x: torch.Tensor = x, scratch: torch.Tensor = scratch) -> None:
            summarize(x, scratch=scratch)
            activity(x, 1, scratch=scratch)

        eager_us = median_us(eager, args.reps)
        line = f"  {shape!s:<18} {eager_us:9.1f}"
        if compiled is not None:
            x3 = x.view(shape[0], shape[1], -1)
            totals, counts = compiled(x3)
            assert counts.tolist() == activity(x, 1).tolist()
            assert totals[4].item() == (x == 0).sum().item()
            fused_us = median_us(lambda x3=x3: compiled(x3), args.reps)
            line += f" {fused_us:9.1f} {fused_us / eager_us:6.2f}"
        print(line)


if __name__ == "__main__":
    main()
