"""The statistics of one activation: the eager route against one-pass kernels.

Times, per tensor of SmallCNN's and TinyTransformer's activation shapes, what the recorder
does in a hook on the CPU:

  eager      ``summarize`` and per-unit ``activity`` (torch, four or five passes, 2 threads)
  one-pass   ``summarize_with_activity``: the numba kernel, one pass (the default); tensors of
             131,072 values or more on torch's OpenMP threads
  1 thread   the same kernel kept to one thread

and prints the first large tensor's wait for the one-pass kernel, in fresh processes: on an
empty numba cache (compiled aside, and compiled there), and from the cache.

Then the exponent histograms (hooktrace.recorder.stats.histogram) of the same activations, and of
SmallCNN's and TinyTransformer's parameters and gradients (what the recorder histograms by
default, every step), side by side with the statistics of the same tensors:

  histogram     the compiled kernel (``histogram_many``: a list in one call; activations of
                131,072 values or more on torch's OpenMP threads)
  1 thread      the same kernel kept to one thread
  numpy         the same counts from the same bits by numpy, a few passes: before numba is
                loaded, or without it
  torch route   the same counts by torch (frexp, where, bincount): the route of tensors on
                other devices, and the CPU's before the two above
  statistics    what the recorder computes for those tensors anyway: ``summarize_with_activity``
                for an activation; for parameters and gradients, the small ones read in place
                in one call (``staged_kernels.summarize_tensors``), the others by the kernel

With ``--inductor`` it also times single functions compiled by
torch.compile (inductor, dynamic shapes) that compute the same sums, extremes, zero count
and per-unit positive counts, accumulating in float64 and in float32, and what compiling
them cost (the route docs/PERFORMANCE.md weighed first).

With ``--graph-ops`` (only them): what the operators a compiled graph calls cost a call
(hooktrace.recorder.graphs.ops), interleaved, for a classifier's logits and the two models'
activations: the forward's ``hooktrace::summarize`` against the hooks' function it calls,
and a gradient's ``hooktrace::sink_summary`` against the two operators it replaced, a
summarising one whose row a ``hooktrace::sink`` then hands on (the sink a no-op here).

Run: python benchmarks/bench_stats_kernels.py [--reps 9] [--inductor] [--histograms (only them)]
     [--graph-ops (only them)]
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
from pathlib import Path
from typing import Any

import torch

from hooktrace.recorder.stats import histogram, numba_kernels, omp, staged_kernels
from hooktrace.recorder.stats.stats import (
    activity,
    route,
    stageable,
    summarize,
    summarize_with_activity,
)
from hooktrace.recorder.stats.torch_route import histogram_torch
from hooktrace.trace.histograms import reference

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import default_loss, make_batch, make_model

# what is timed is the one-pass kernel: compile it here where numba's cache lacks it, rather
# than time torch's reductions while a filler compiles it aside (the default)
os.environ.setdefault("HOOKTRACE_ONE_PASS", "wait")

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


def interleaved_us(functions: list[tuple[Callable[[], object], int]], reps: int) -> list[float]:
    """Median microseconds a call of each function, called ``inner`` times in a row, the
    functions taking turns repetition by repetition: what the machine's noise does to one
    (others share this one's cores) it does to all alike."""
    times: list[list[float]] = [[] for _ in functions]
    for f, _ in functions:
        f()
    for _ in range(reps):
        for (f, inner), spent in zip(functions, times, strict=True):
            start = time.perf_counter()
            for _ in range(inner):
                f()
            spent.append((time.perf_counter() - start) / inner)
    return [statistics.median(spent) * 1e6 for spent in times]


_WAIT = """
import time
from hooktrace.recorder.stats import kernel_cache
from hooktrace.recorder.stats.stats import route
start = time.perf_counter()
route()
waited = time.perf_counter() - start
while kernel_cache._state == "running" and not kernel_cache.filled():
    time.sleep(0.2)
print(waited, time.perf_counter() - start - waited)
"""


def warmup_seconds() -> dict[str, float]:
    """The first large tensor's wait for the one-pass kernel, in fresh processes: on an empty
    numba cache (the default: nothing compiled, the filler started; and the filler's own
    time), on an empty cache with ``HOOKTRACE_ONE_PASS=wait`` (compiled there), and from the
    cache the filler filled."""

    def probe(cache: str, setting: str) -> tuple[float, float]:
        env = {**os.environ, "NUMBA_CACHE_DIR": cache, "HOOKTRACE_ONE_PASS": setting}
        out = subprocess.check_output([sys.executable, "-c", _WAIT], env=env, text=True)
        waited, filler = out.split()
        return float(waited), float(filler)

    with tempfile.TemporaryDirectory() as cold, tempfile.TemporaryDirectory() as compiled:
        waited, filler = probe(cold, "1")
        return {
            "cold": waited,
            "filler": filler,
            "warm": probe(cold, "1")[0],
            "compiled here": probe(compiled, "wait")[0],
        }


def without_numba(tensors: list[torch.Tensor]) -> None:
    """``histogram_many`` as it runs before numba is loaded: numpy, tensor by tensor."""
    ready = numba_kernels.histograms
    numba_kernels.histograms = lambda: None  # what histogram asks before it picks a route
    try:
        histogram.histogram_many(tensors)
    finally:
        numba_kernels.histograms = ready


def parameter_statistics(tensors: list[torch.Tensor]) -> None:
    """What the recorder does for a kind's values once its kernels are ready: the small ones
    read in place in one call, the others by the one-pass kernel."""
    staged_kernels.summarize_tensors([t for t in tensors if stageable(t)])
    for t in tensors:
        if not stageable(t):
            summarize_with_activity(t, None)


def torch_route(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        histogram_torch(t)


def one_thread(tensors: list[torch.Tensor]) -> None:
    threads = omp.threads
    omp.threads = lambda: 1  # what histogram_many asks before a large tensor
    try:
        histogram.histogram_many(tensors)
    finally:
        omp.threads = threads


def parameters_and_gradients(name: str) -> list[torch.Tensor]:
    """A model's parameters and their gradients after one training step."""
    torch.manual_seed(0)
    model = make_model(name)
    batch = make_batch(name, seed=0)
    default_loss(batch.run(model), batch.target).backward()
    parameters = list(model.parameters())
    return [p.detach() for p in parameters] + [p.grad for p in parameters if p.grad is not None]


def compare_histograms(reps: int) -> None:
    """Histograms against the torch route and against the statistics of the same tensors."""
    route()  # loads the histogram kernels with the one-pass kernel
    columns = ["histogram", "1 thread", "numpy", "torch route", "statistics"]
    header = "".join(f" {c + ' us':>15}" for c in columns)
    ratios = "".join(f" {'/' + c:>7}" for c in ("numpy", "torch", "stats"))
    print(f"  {'tensors':<34} {'values':>7}{header} {'ns/value':>9}{ratios}")
    cases: list[tuple[str, list[torch.Tensor], Callable[[], object]]] = []
    torch.manual_seed(0)
    for shape, dim in SHAPES:
        x = torch.randn(shape).relu_()
        cases.append((str(shape), [x], lambda x=x, dim=dim: summarize_with_activity(x, dim)))
    for name in ("SmallCNN", "TinyTransformer"):
        tensors = parameters_and_gradients(name)
        label = f"{name} params+grads ({len(tensors)})"
        cases.append((label, tensors, lambda t=tensors: parameter_statistics(t)))
    for label, tensors, stats in cases:
        rows = histogram.histogram_many(tensors)
        for row, t in zip(rows, tensors, strict=True):  # the figures are of right answers
            assert row.tolist() == reference(t.numpy()).tolist()
        timed = interleaved_us(
            [
                (lambda t=tensors: histogram.histogram_many(t), 50),
                (lambda t=tensors: one_thread(t), 50),
                (lambda t=tensors: without_numba(t), 5),
                (lambda t=tensors: torch_route(t), 5),
                (stats, 50),
            ],
            reps,
        )
        values = sum(t.numel() for t in tensors)
        line = f"  {label:<34} {values:7d}" + "".join(f" {us:15.1f}" for us in timed)
        ratios = "".join(f" {timed[0] / timed[k]:7.3f}" for k in (2, 3, 4))
        print(line + f" {timed[0] * 1e3 / values:9.2f}" + ratios)


GRAPH_SHAPES = [((32, 10), 1), ((16, 64, 128), 2), ((32, 16, 32, 32), 1)]
"""Values a compiled graph summarises: SmallCNN's logits, a TinyTransformer activation, and
SmallCNN's first convolution's output."""


def graph_operators(reps: int) -> None:
    from hooktrace.recorder.graphs import ops

    ops.set_sink(lambda site, row: None)
    try:
        print("  operators a compiled graph calls, us a call (interleaved):")
        print(
            f"  {'shape':<18} {'summarize op':>13} {'its function':>13} "
            f"{'summarize+sink':>15} {'sink_summary':>13}"
        )
        for shape, dim in GRAPH_SHAPES:
            x = torch.randn(shape)
            inner = max(1, 20_000 // x.numel())
            timed = interleaved_us(
                [
                    (lambda x=x, dim=dim: torch.ops.hooktrace.summarize(x, dim), inner),
                    (lambda x=x, dim=dim: ops._summarize_op(x, dim), inner),
                    (
                        lambda x=x: torch.ops.hooktrace.sink(
                            torch.ops.hooktrace.summarize(x, -1)[0], 0
                        ),
                        inner,
                    ),
                    (lambda x=x: torch.ops.hooktrace.sink_summary(x, 0, False), inner),
                ],
                reps,
            )
            print(f"  {shape!s:<18}" + "".join(f" {us:>13.1f}" for us in timed[:2]) +
                  f" {timed[2]:>15.1f} {timed[3]:>13.1f}")  # fmt: skip
    finally:
        ops.set_sink(None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile kernels")
    parser.add_argument(
        "--histograms", action="store_true", help="only the histograms against the statistics"
    )
    parser.add_argument(
        "--graph-ops", action="store_true", help="only the operators a compiled graph calls"
    )
    args = parser.parse_args()
    if args.graph_ops:
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {route().description}"
        )
        graph_operators(args.reps)
        return
    if args.histograms:
        print(
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; {route().description}"
        )
        compare_histograms(args.reps)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {route().description}")
    wait = warmup_seconds()
    print(
        f"first large tensor's wait for the one-pass kernel: {wait['cold']:.2f} s on an empty "
        f"numba cache (the filler then compiled for {wait['filler']:.1f} s aside), "
        f"{wait['warm']:.2f} s from the cache, {wait['compiled here']:.2f} s with "
        "HOOKTRACE_ONE_PASS=wait on an empty cache"
    )
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
    compare_histograms(args.reps)


if __name__ == "__main__":
    main()
