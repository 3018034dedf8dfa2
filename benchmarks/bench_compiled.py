"""What recording costs a compiled model, per steady training step, measured side by side.

For each reference model (tests/models.py: SmallCNN and TinyTransformer, the batches of
bench_record.py) six variants train one step at a time (forward, loss, backward, SGD step):

  eager           no compiler, no recording
  eager+rec       hooktrace.record, no compiler (what a user gives up the compiler for)
  compiled        torch.compile with inductor, no recording
  compiled+rec    hooktrace.record of the same, the statistics compiled into its graphs
  compiled+out    compiled+rec of the modules' outputs and gradients only (params=False,
                  histograms=None, capture_nonfinite=False): the graphs' share of the cost,
                  without the parameters' records, which are taken outside the graph as in
                  an eager run
  compiled+nonorm compiled+rec without the normalisation layers (``exclude``: every
                  BatchNorm, LayerNorm and GroupNorm, all their records): their share. A
                  BatchNorm output summarised is made real where plain inductor fuses it
                  into the activation after it (docs/PERFORMANCE.md: the ReLU's mask the
                  forward then kept for the backward, before graphs/masks.py)

Each variant has its own copy of the model and its own backend function (dynamo keeps a
graph per backend, so the compiled variants never run each other's graphs). Each window
starts a recording of its own, and dynamo compiles the graph again at each (it guards on the
process-wide hooks' keys, new with each recording; inductor's FX graph cache makes these
compiles short): they fall in the untimed warm-up steps, and the recompile limit is raised
for them. Repetitions
interleave the variants so that the machine's drift falls on all of them alike; ratios are
paired by repetition and their median printed with the quartiles. The first step of each
compiled variant (capture and compile, the FX graph cache off) is timed on its own, after
one compile of an unrelated function (the first compile of a process pays for inductor's
start): what recording adds to the compile.

On a GPU (``--device cuda``, as ``gpu_check.py --costs`` runs it) models and batches live on
the device and each window ends by waiting for it.

Run: python benchmarks/bench_compiled.py [--reps 9] [--seconds 2] [--models SmallCNN,TinyTransformer]
     [--device cpu]
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
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import default_loss, make_batch, make_model

import hooktrace

VARIANTS = ("eager", "eager+rec", "compiled", "compiled+rec", "compiled+out", "compiled+nonorm")
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LayerNorm, nn.GroupNorm)
OUTPUTS_ONLY = {"params": False, "histograms": None, "capture_nonfinite": False}
WARM_UP_STEPS = 5


def _inductor() -> Callable[..., Any]:
    """A backend function of its own: inductor, under a name dynamo tells apart."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return compile_fx(gm, example_inputs)

    return backend


class Setup:
    """One variant: its model, its compiled call, its optimizer, its recording."""

    def __init__(self, name: str, label: str, out: Path, device: torch.device) -> None:
        self.device = device
        self.model = make_model(name).to(device)
        self.run: nn.Module = self.model
        if label.startswith("compiled"):
            self.run = torch.compile(self.model, backend=_inductor())  # type: ignore[assignment]
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.batch = make_batch(name, seed=0).to(device)
        self.recorded = "+" in label
        self.options: dict[str, Any] = OUTPUTS_ONLY if label.endswith("+out") else {}
        if label.endswith("+nonorm"):
            norms = [n for n, m in self.model.named_modules() if isinstance(m, NORMS)]
            self.options = {"exclude": norms}
        self.out = out / label.replace("+", "_")

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        if not self.recorded:
            yield
            return
        with hooktrace.record(self.run, self.out, overwrite=True, **self.options):
            yield

    def step(self) -> None:
        loss = default_loss(self.batch.run(self.run), self.batch.target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def wait(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def warm_compiler() -> None:
    """One compile of an unrelated function first: the first compile in a process also pays
    for inductor's imports and its compile workers, which would fall on whichever variant
    came first."""
    with torch._inductor.config.patch(fx_graph_cache=False):
        torch.compile(lambda x: torch.tanh(x @ x.T).sum(dim=0).amax(), backend=_inductor())(
            torch.randn(5, 3)
        )


def first_step(setup: Setup) -> float:
    """Seconds of the first step: dynamo's capture and the backend's compile."""
    with torch._inductor.config.patch(fx_graph_cache=False), setup.recording():
        setup.wait()
        start = time.perf_counter()
        setup.step()
        setup.wait()
        return time.perf_counter() - start


def steady(setup: Setup, seconds: float) -> float:
    """Seconds per step over at least ``seconds`` of steps, after a few untimed ones."""
    with setup.recording():
        for _ in range(WARM_UP_STEPS):
            setup.step()
        setup.wait()
        start, steps = time.perf_counter(), 0
        while steps < 4 or time.perf_counter() - start < seconds:
            setup.step()
            steps += 1
        setup.wait()
        return (time.perf_counter() - start) / steps


def allow_a_recompile_per_recording() -> None:
    torch._dynamo.config.recompile_limit = 1024  # a recompile per recording: see above
    torch._dynamo.config.accumulated_recompile_limit = 1 << 16


def bench(name: str, reps: int, seconds: float, device: torch.device) -> None:
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as tmp:
        setups = {label: Setup(name, label, Path(tmp), device) for label in VARIANTS}
        warm_compiler()
        firsts = {label: first_step(setups[label]) for label in VARIANTS[2:4]}
        times: dict[str, list[float]] = {label: [] for label in VARIANTS}
        for rep in range(reps):
            turn = rep % len(VARIANTS)
            order = VARIANTS[turn:] + VARIANTS[:turn]  # each goes first in turn
            for label in order:
                times[label].append(steady(setups[label], seconds))

    def paired(a: str, b: str) -> str:
        ratios = sorted(x / y for x, y in zip(times[a], times[b], strict=True))
        q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        return f"{q[1]:.3f}x (quartiles {q[0]:.3f}-{q[2]:.3f})"

    print(f"\n{name} on {device}: median step time over {reps} interleaved repetitions")
    for label in VARIANTS:
        print(f"  {label:<15} {statistics.median(times[label]) * 1e3:8.2f} ms")
    print(f"  compiled+rec / compiled    {paired('compiled+rec', 'compiled')}")
    print(f"  compiled+out / compiled    {paired('compiled+out', 'compiled')}")
    print(f"  compiled+nonorm / compiled {paired('compiled+nonorm', 'compiled')}")
    print(f"  eager+rec / eager          {paired('eager+rec', 'eager')}")
    print(f"  compiled+rec / eager+rec   {paired('compiled+rec', 'eager+rec')}")
    print(f"  compiled / eager           {paired('compiled', 'eager')}")
    extra = firsts["compiled+rec"] - firsts["compiled"]
    print(
        f"  first step (capture and compile): compiled {firsts['compiled']:.2f} s, "
        f"compiled+rec {firsts['compiled+rec']:.2f} s ({extra:+.2f} s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--models", default="SmallCNN,TinyTransformer")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    allow_a_recompile_per_recording()
    for name in args.models.split(","):
        bench(name, args.reps, args.seconds, torch.device(args.device))


if __name__ == "__main__":
    main()
