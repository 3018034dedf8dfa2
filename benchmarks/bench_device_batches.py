"""A step's parameters and gradients on a device: one by one against batched.

What the recorder queues on a device for a model's parameters and their gradients, with
their histograms (the defaults), by each route, for the 200-layer model of bench_host.py
(``nn.Linear(8, 8)``: 400 parameters) and for TinyTransformer's (tests/models.py):

  one by one, torch   torch's operations per tensor (``torch_route``): a GPU without Triton
  one by one, Triton  the Triton kernels per tensor (``device_kernels``): 4 launches a
                      tensor; run on a GPU where Triton is, else counted only
  batched             ``device_batches``: a few dozen launches for all of them (each of
                      at most ``MAX_VALUES`` values; any larger one by one, by torch)

It prints the operations dispatched that compute (on a GPU, each is a kernel launch, and the
host pays for each: the figure that carries over to a GPU; views, which launch nothing, apart;
on a GPU, ``segment_reduce`` takes 3 launches where it counts 1 here) and, on ``--device`` (the CPU by default), the
host time a step's parameters and gradients take, median of ``--reps``, side by side in
each repetition. On the CPU an operation's host cost stands in for a launch's, but the host
time includes the computing too, which a GPU does on its own: where the values are many
(TinyTransformer's), the CPU's time is the batches' float64 passes, not the launches. The
CPU's own route (numba, in place) is another and is not timed here.

Run: python benchmarks/bench_device_batches.py [--reps 15] [--device cuda]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from models import TinyTransformer

from hooktrace.recorder.stats import device_batches, device_kernels
from hooktrace.recorder.stats.torch_route import histogram_torch, summarize_on_device


class _Counting(TorchDispatchMode):
    """Counts the operations that compute (a launch each on a GPU), views apart (none)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = self.views = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.is_view:
            self.views += 1
        else:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _tensors(model: nn.Module, device: str) -> list[torch.Tensor]:
    """The model's parameters and a gradient of each: what a step records by default."""
    model = model.to(device)
    params = [p.detach() for p in model.parameters()]
    return params + [torch.randn_like(p) for p in params]


def one_by_one(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        summarize_on_device(t.float())
        histogram_torch(t)


def one_by_one_triton(tensors: list[torch.Tensor]) -> None:
    for t in tensors:
        device_kernels.summarize(t)
        device_kernels.histogram(t)


def batched(tensors: list[torch.Tensor]) -> None:
    """As the recorder does it: tensors of at most ``MAX_VALUES`` values batched, any larger
    one by one (by torch's operations: the Triton kernels where they would be used)."""
    small = [t for t in tensors if t.numel() <= device_batches.MAX_VALUES]
    device_batches.both(small)  # statistics and histograms, from one copy of the values
    one_by_one([t for t in tensors if t.numel() > device_batches.MAX_VALUES])


def _ops(run: Callable[[], None]) -> str:
    with _Counting() as counting:
        run()
    return f"{counting.ops} ({counting.views} views)"


def _time(run: Callable[[], None], device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    run()  # host time: what the step waits for in Python, not the device's work
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    report(args.device, args.reps)


def report(device: str, reps: int) -> None:
    """The table, on ``device`` (``gpu_check.py --costs`` runs it on a GPU)."""
    models = {
        "200 x Linear(8, 8)": nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)]),
        "TinyTransformer": TinyTransformer(),
    }
    print(f"device {device}; {reps} repetitions, host time per step, median (quartiles)")
    print("model | tensors | route | operations (views) | host ms | x batched, paired")
    for name, model in models.items():
        tensors = _tensors(model, device)
        routes: dict[str, Callable[[], None]] = {
            "one by one, torch": functools.partial(one_by_one, tensors),
            "batched": functools.partial(batched, tensors),
        }
        if all(device_kernels.usable(t, histogram=True) for t in tensors):  # a GPU with Triton
            routes["one by one, Triton"] = functools.partial(one_by_one_triton, tensors)
        ops = {route: _ops(run) for route, run in routes.items()}
        ops.setdefault("one by one, Triton", f"{4 * len(tensors)}, counted")
        times: dict[str, list[float]] = {route: [] for route in routes}
        for _ in range(reps):
            for route, run in routes.items():
                times[route].append(_time(run, device))
        for route in ("one by one, torch", "one by one, Triton", "batched"):
            if route not in times:
                print(f"{name} | {len(tensors)} | {route} | {ops[route]} | (not run) |")
                continue
            ms = [t * 1e3 for t in times[route]]
            ratios = [a / b for a, b in zip(times[route], times["batched"], strict=True)]
            q = statistics.quantiles(ratios, n=4)
            print(
                f"{name} | {len(tensors)} | {route} | {ops[route]} | "
                f"{statistics.median(ms):.2f} | {statistics.median(ratios):.1f}x "
                f"({q[0]:.1f} to {q[2]:.1f})"
            )


if __name__ == "__main__":
    main()
