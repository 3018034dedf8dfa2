"""What recording costs the host per module call: the figure a GPU run pays in Python.

On a GPU a module call costs the host a few microseconds to launch its kernels, and whatever
a hook does in Python comes on top of that. Here compute is next to nothing: a chain of 200
``nn.Linear(8, 8)``, batch 2, SGD, one torch thread. What a recorded training step costs
beyond a plain one, divided by 200, is the host cost of recording one module call, with
everything that comes with it (its output and output gradient, its parameters, their
gradients and histograms, the writer thread's share of the interpreter). The loss is a mean
squared error to a fixed target, which stays finite for thousands of steps: a run gone NaN
would measure the non-finite capture at work, not a healthy run (the benchmark stops if a
loss is not finite).

Each repetition runs every variant once, in turn, each starting one variant further on, so
that drift on a shared machine falls on all of them alike; each figure is the median over
repetitions. The variants:

  plain          no hooks: the step itself (its time / 200 is "the nn.Linear call itself")
  no-op hook     one process-wide no-op forward hook
  defaults       hooktrace.record(model, out)
  no histograms  histograms=None
  no capture     histograms=None, capture_nonfinite=False
  outputs only   histograms=None, capture_nonfinite=False, params=False
  no collector   the defaults with Python's cyclic garbage collector off while they run
                 (what the recorder's allocations make it do is the difference)
  python floor   (on the CPU) not a recording: the least Python that reads what ``outputs
                 only`` reads (:func:`python_floor`); ``outputs only`` beyond it is the
                 recorder's bookkeeping
  c++ floor      (on the CPU, where torch's extension builder finds ninja and a compiler)
                 the python floor's hook written in C++ (``cpp_floor.cpp``, :func:`cpp_floor`),
                 its gradient hook a C++ one: what a hook pays past torch's own Python
  torch's route  (on a GPU) the defaults, a tensor's statistics and histogram by torch's
                 operations instead of the Triton kernels
  one by one     (on a GPU) the defaults, parameters and gradients each by its own route
                 instead of in batches (``device_batches``)

On a GPU (``--device cuda``, as ``gpu_check.py --costs`` runs it) the model and its batch
live on the device and each window ends by waiting for it: the steps are bound by the host
all the same.

Run: python benchmarks/bench_host.py [--reps 7] [--steps 20] [--layers 200] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook

import hooktrace

# the kernels that read small tensors in place are what a recording uses once numba's cache
# holds them: compile them here where it lacks them, rather than time the staged route
os.environ.setdefault("HOOKTRACE_ONE_PASS", "wait")

Variant = Callable[[nn.Module, Path], contextlib.AbstractContextManager[Any]]

RECORDED: dict[str, dict[str, Any]] = {
    "defaults": {},
    "no histograms": {"histograms": None},
    "no capture": {"histograms": None, "capture_nonfinite": False},
    "outputs only": {"histograms": None, "capture_nonfinite": False, "params": False},
}


@contextlib.contextmanager
def plain(model: nn.Module, out: Path) -> Iterator[None]:
    yield


@contextlib.contextmanager
def noop_hook(model: nn.Module, out: Path) -> Iterator[None]:
    handle = register_module_forward_hook(lambda module, args, output: None)
    try:
        yield
    finally:
        handle.remove()


def recorded(options: dict[str, Any]) -> Variant:
    def variant(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[Any]:
        return hooktrace.record(model, out / "run", overwrite=True, **options)

    return variant


@contextlib.contextmanager
def no_collector(model: nn.Module, out: Path) -> Iterator[None]:
    gc.disable()
    try:
        with hooktrace.record(model, out / "run", overwrite=True):
            yield
    finally:
        gc.enable()


@contextlib.contextmanager
def python_floor(model: nn.Module, out: Path) -> Iterator[None]:
    """Not a recording, and nothing written: one process-wide forward hook that reads each
    module's output where it lies with the kernel the recorder reads small CPU tensors with
    (statistics and per-unit counts, ``staged_kernels.InPlace.read``), keeps a record tuple,
    and hooks the output's gradient, read the same way. No call counts, phases, locks, look
    at compiling, tracing or transforms, no containers, subclasses or other devices: what
    ``outputs only`` costs beyond this is the recorder's bookkeeping in Python, and this the
    least a hook written in Python pays for reading the same tensors (the CPU only)."""
    from hooktrace.recorder.stats import numba_kernels

    kernels = numba_kernels.staged_loading()
    if kernels is None:
        raise SystemExit("bench_host: python floor needs the numba kernels (pip install numba)")
    in_place = kernels.InPlace()
    read, codes = in_place.read, in_place.codes
    names = {id(m): name for name, m in model.named_modules() if name}
    records: list[tuple[Any, ...]] = []

    def observe(tensor: torch.Tensor, name: str, kind: str, units: bool) -> None:
        shape, numel = tensor.shape, tensor.numel()
        count = shape[-1] if units else 0
        outer = numel // count if units else 0
        stats = read(tensor.data_ptr(), numel, codes[tensor.dtype], outer, count, 1 if units else 0)
        records.append((name, kind, tuple(shape), stats))

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is None or type(output) is not torch.Tensor:
            return
        observe(output, name, "output", True)
        if output.requires_grad:
            output.register_hook(lambda grad: observe(grad, name, "grad_output", False))

    handle = register_module_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@functools.cache
def _cpp_floor() -> Any:
    """``cpp_floor.cpp`` built by torch's extension builder (ninja and a C++ compiler), or
    None where it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        return load("hooktrace_cpp_floor", [str(Path(__file__).with_name("cpp_floor.cpp"))],
                    extra_cflags=["-O2"])  # fmt: skip
    except Exception as exc:
        print(f"bench_host: c++ floor left out: {type(exc).__name__}: {exc}".splitlines()[0])
        return None


@contextlib.contextmanager
def cpp_floor(model: nn.Module, out: Path) -> Iterator[None]:
    """Not a recording either: ``python floor`` written in C++ (``cpp_floor.cpp``), the
    gradient hooked by a C++ hook that runs in the autograd engine without the interpreter.
    What a hook costs where only torch's own Python (``Module._call_impl``) is left."""
    hooks = _cpp_floor().Hooks()
    for index, (name, module) in enumerate(model.named_modules()):
        if name:
            hooks.add(module, index)
    handle = register_module_forward_hook(hooks.post, with_kwargs=True, always_call=True)
    try:
        yield
    finally:
        handle.remove()
        with_kwargs = torch.nn.modules.module._global_forward_hooks_with_kwargs
        with_kwargs.pop(handle.id, None)  # (its handle leaves it there)
        hooks.taken()


@contextlib.contextmanager
def torch_route(model: nn.Module, out: Path) -> Iterator[None]:
    """The defaults with a device's statistics and histograms taken by torch's operations,
    a launch each, instead of the Triton kernels (``device_kernels``): on a GPU only."""
    from hooktrace.recorder.stats import device_kernels

    with (
        mock.patch.object(device_kernels, "usable", lambda *args, **kwargs: False),
        hooktrace.record(model, out / "run", overwrite=True),
    ):
        yield


@contextlib.contextmanager
def one_by_one(model: nn.Module, out: Path) -> Iterator[None]:
    """The defaults with a device's parameters and gradients each summarised and histogrammed
    by its own route rather than in batches (``device_batches``): on a GPU only."""
    from hooktrace.recorder.stats import device_batches

    with (
        mock.patch.object(device_batches, "batchable", lambda value: False),
        hooktrace.record(model, out / "run", overwrite=True),
    ):
        yield


VARIANTS: dict[str, Variant] = {
    "plain": plain,
    "no-op hook": noop_hook,
    **{name: recorded(options) for name, options in RECORDED.items()},
    "no collector": no_collector,
}
ON_A_DEVICE: dict[str, Variant] = {"torch's route": torch_route, "one by one": one_by_one}
"""Variants measured on a GPU only."""
ON_THE_CPU: dict[str, Variant] = {"python floor": python_floor, "c++ floor": cpp_floor}
"""Variants measured on the CPU only (the c++ floor where it builds)."""


def make_model(layers: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers)))


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(variant: Variant, model: nn.Module, out: Path, steps: int) -> float:
    """Seconds per training step under ``variant`` (after two steps of warm-up inside it)."""
    device = next(model.parameters()).device
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, generator=generator).to(device)
    target = torch.randn(2, 8, generator=generator).to(device)
    losses = []

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), target)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    with variant(model, out):
        step()
        step()
        _wait(device)
        start = time.perf_counter()
        for _ in range(steps):
            step()
        _wait(device)
        elapsed = time.perf_counter() - start
    if not torch.isfinite(torch.stack(losses)).all():
        raise SystemExit(
            "bench_host: the training diverged (a loss is not finite); its figures "
            "would measure a NaN run"
        )
    return elapsed / steps


def measure(device: torch.device, reps: int, steps: int, layers: int) -> dict[str, list[float]]:
    """Seconds per step of each variant, one figure a repetition."""
    torch.set_num_threads(1)
    model = make_model(layers).to(device)
    variants = {**VARIANTS, **(ON_A_DEVICE if device.type == "cuda" else ON_THE_CPU)}
    if "c++ floor" in variants and _cpp_floor() is None:
        del variants["c++ floor"]
    times: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory() as tmp:
        time_steps(VARIANTS["defaults"], model, Path(tmp), 2)  # kernels loaded, compiled
        order = list(variants.items())
        for rep in range(reps):  # each repetition starts one variant further on
            turn = rep % len(order)
            for name, variant in order[turn:] + order[:turn]:
                gc.collect()
                times[name].append(time_steps(variant, model, Path(tmp), steps))
    return times


def report(times: dict[str, list[float]], device: torch.device, steps: int, layers: int) -> None:
    reps = len(times["plain"])
    per_call = {n: [t / layers * 1e6 for t in ts] for n, ts in times.items()}
    plain_us = statistics.median(per_call["plain"])
    print(
        f"torch {torch.__version__}, {device}, 1 thread; {layers} x nn.Linear(8, 8), batch 2, "
        f"SGD; medians of {reps} interleaved repetitions of {steps} steps"
    )
    print(f"{'variant':<16}{'step':>10}{'x plain':>9}{'host us / module call':>24}")
    for name, ts in times.items():
        step = statistics.median(ts)
        extra = statistics.median(
            [c - p for c, p in zip(per_call[name], per_call["plain"], strict=True)]
        )
        label = f"{plain_us:.1f} (the call itself)" if name == "plain" else f"{extra:+.1f}"
        print(f"{name:<16}{step * 1e3:>8.2f}ms{step / statistics.median(times['plain']):>8.2f}x"
              f"{label:>24}")  # fmt: skip
    print("\neach option's share of the defaults, us / module call (paired by repetition):")
    shares = {
        "histograms": ("defaults", "no histograms"),
        "non-finite capture": ("no histograms", "no capture"),
        "parameters, their gradients": ("no capture", "outputs only"),
        "outputs, output gradients": ("outputs only", "plain"),
        "Python's collector": ("defaults", "no collector"),
        "outputs only beyond the floor": ("outputs only", "python floor"),
        "outputs only beyond c++'s": ("outputs only", "c++ floor"),
    }
    for what, (this, less) in shares.items():
        if less not in per_call:
            continue
        diff = statistics.median(
            [a - b for a, b in zip(per_call[this], per_call[less], strict=True)]
        )
        print(f"  {what:<30}{diff:+8.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20, help="timed steps a variant a rep")
    parser.add_argument("--layers", type=int, default=200)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    report(measure(device, args.reps, args.steps, args.layers), device, args.steps, args.layers)


if __name__ == "__main__":
    main()
