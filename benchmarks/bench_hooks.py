"""What the process-wide hooks cost a module call, recorded or not, measured side by side.

The recorder attaches through hooks common to all modules (hooktrace/recorder/hooks/attach.py):
torch calls them for every module call in the process, so every module pays something while
a recording runs, recorded or not. This times one call of a tiny module (nn.Identity, in a
chain of 200, one thread, no grad) under each variant, interleaved repetition by repetition:

  plain        no hooks
  noop         two no-op process-wide hooks, as hooktrace registers (pre, and post with
               kwargs, always called): the price torch itself charges, its slow path
  bystander    hooktrace recording another model: what an unrecorded module pays
  recorded     hooktrace recording this chain: statistics of every output

Run: python benchmarks/bench_hooks.py [--reps 9]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

import hooktrace

CHAIN = 200
CALLS = 200  # forwards of the chain per repetition


@contextlib.contextmanager
def plain(net: nn.Module, out: Path) -> Iterator[None]:
    yield


@contextlib.contextmanager
def noop(net: nn.Module, out: Path) -> Iterator[None]:
    handles = [
        register_module_forward_pre_hook(lambda m, a: None),
        register_module_forward_hook(
            lambda m, a, k, o=None: None, with_kwargs=True, always_call=True
        ),
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def bystander(net: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(nn.Linear(1, 1), out / "run", overwrite=True):
        yield


@contextlib.contextmanager
def recorded(net: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(net, out / "run", overwrite=True) as rec:
        yield
        rec.step()


VARIANTS: dict[str, Callable[[nn.Module, Path], contextlib.AbstractContextManager[None]]] = {
    "plain": plain,
    "noop": noop,
    "bystander": bystander,
    "recorded": recorded,
}


def per_call_us(net: nn.Module, x: torch.Tensor) -> float:
    start = time.perf_counter()
    for _ in range(CALLS):
        net(x)
    return (time.perf_counter() - start) / CALLS / (CHAIN + 1) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    net = nn.Sequential(*[nn.Identity() for _ in range(CHAIN)])
    x = torch.ones(4)
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for _ in range(args.reps):
            for name, variant in VARIANTS.items():
                with variant(net, Path(tmp)):
                    per_call_us(net, x)  # warm-up
                    times[name].append(per_call_us(net, x))
    print(
        f"torch {torch.__version__}; one module call, median of {args.reps} interleaved repetitions"
    )
    base = statistics.median(times["plain"])
    print(f"  {'variant':<10} {'us/call':>8} {'x plain':>8}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<10} {median:8.2f} {median / base:8.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
