"""Recording overhead per training step, measured side by side.

For each reference model (tests/models.py: SmallCNN, batch 32 x 3 x 32 x 32; TinyTransformer,
batch 16 x 64 tokens x 32 features) it times one training step (forward, loss, backward,
optimizer step) under each variant, interleaving the variants repetition by repetition so
that the machine's noise falls on all of them alike, and prints medians, ratios to plain and
the process's minor page faults per step (the allocator's churn, which moves plain as much
as any variant):

  plain        no hooks
  empty        an empty forward hook on every module (the price of hook dispatch)
  floor        one sum() per recorded tensor (outputs and output gradients)
  naive        what hand-written hooks do: torch reductions with .item() per statistic,
               and a synchronous h5py write per tensor
  stats        hooktrace.record, statistics of every module at every step (the default:
               non-finite capture on, histograms of parameters and parameter gradients at
               every step); the one-time warm-up of its one-pass kernel falls in the untimed
               warm-up steps and is printed on its own at the end
  nocapture    stats with capture_nonfinite=False: statistics only. stats / nocapture,
               paired by repetition, is what watching for a non-finite value costs on steps
               where everything is finite
  nohist       stats with histograms=None: no histograms. stats / nohist, paired by
               repetition, is what the histograms of every parameter and gradient cost
  bare         stats with neither: what the recorder did before histograms and capture
               existed (asked for only: to compare with a commit of that time)
  full         hooktrace.record with full tensors of every module at every step
  bystander    hooktrace.record of another model: the process-wide hooks (recorder/hooks/attach.py)
               fire for every module call and return at once; what unrecorded modules pay
  onethread    stats, with the kernel kept to one thread instead of torch's OpenMP threads
               (not run unless asked for: what reading on torch's threads saves)
  eager        stats without numba: large CPU tensors by torch's reductions, small ones staged
               and summarised by numpy, histograms by numpy (asked for only: what the
               compiled kernels save, all together)
  torchonly    eager with nothing staged: every CPU tensor by torch's reductions in the hook
  smallstaged  stats with the small tensors' kernels kept out: staged, numpy in the writer
               (asked for only: what reading them in place saves)
  histnumpy    stats with the histograms counted by numpy (what their kernel saves)

Each compiled piece is weighed by the variant that leaves it out, paired with stats by
repetition ("stats / eager" and so on, printed below each table).

Each repetition times a window of steady training: a variant's recording is started, takes
WARM_UP_STEPS untimed steps (its first steps build what later steps reuse), then as many
steps as fill --seconds. The window must be longer than the writer's flush period (1 s), or
the writer's flushes and its held steps would fall after the window, outside the figure.

Run: python benchmarks/bench_record.py [--reps 15] [--seconds 2.5] [--models SmallCNN,TinyTransformer]
                                      [--variants plain,naive,stats]  (plain and naive always run)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import h5py
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import default_loss, make_batch, make_model

import hooktrace
from hooktrace.recorder.stats import numba_kernels, omp
from hooktrace.recorder.stats import stats as stats_module
from hooktrace.recorder.stats.stats import route_taken

# what is timed is the one-pass kernel: compile it here where numba's cache lacks it, rather
# than time torch's reductions while a filler compiles it aside (the default)
os.environ.setdefault("HOOKTRACE_ONE_PASS", "wait")

Variant = Callable[[nn.Module, Path], contextlib.AbstractContextManager[object]]


@contextlib.contextmanager
def plain(model: nn.Module, out: Path) -> Iterator[None]:
    yield


@contextlib.contextmanager
def hooks(model: nn.Module, make_hook: Callable[[str], Callable[..., None]]) -> Iterator[None]:
    handles = [m.register_forward_hook(make_hook(name)) for name, m in model.named_modules()]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def empty(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    return hooks(model, lambda name: lambda m, i, o: None)


def floor(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    kept: list[torch.Tensor] = []

    def make(name: str) -> Callable[..., None]:
        def hook(m: nn.Module, i: object, o: object) -> None:
            if isinstance(o, torch.Tensor) and o.is_floating_point():
                kept.append(o.detach().sum())
                if o.requires_grad:
                    o.register_hook(lambda g: kept.append(g.sum()) and None)

        return hook

    return hooks(model, make)


@contextlib.contextmanager
def naive(model: nn.Module, out: Path) -> Iterator[None]:
    with h5py.File(out / "naive.h5", "w") as f:
        counter = [0]

        def write(name: str, t: torch.Tensor) -> None:
            x = t.detach().float()
            row = [x.mean().item(), x.std().item(), x.min().item(), x.max().item(), x.norm().item()]
            row += [(x == 0).float().mean().item(), x.isnan().sum().item(), x.isinf().sum().item()]
            f.create_dataset(f"{counter[0]}", data=row)
            counter[0] += 1

        def make(name: str) -> Callable[..., None]:
            def hook(m: nn.Module, i: object, o: object) -> None:
                if isinstance(o, torch.Tensor) and o.is_floating_point():
                    write(name, o)
                    if o.requires_grad:
                        o.register_hook(lambda g: write(name, g) and None)

            return hook

        with hooks(model, make):
            yield


@contextlib.contextmanager
def stats(model: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(model, out / "run", overwrite=True):
        yield


@contextlib.contextmanager
def nocapture(model: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(model, out / "run", overwrite=True, capture_nonfinite=False):
        yield


@contextlib.contextmanager
def nohist(model: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(model, out / "run", overwrite=True, histograms=None):
        yield


@contextlib.contextmanager
def bare(model: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(
        model, out / "run", overwrite=True, histograms=None, capture_nonfinite=False
    ):
        yield


@contextlib.contextmanager
def full(model: nn.Module, out: Path) -> Iterator[None]:
    with hooktrace.record(model, out / "run", overwrite=True, full_every=1):
        yield


@contextlib.contextmanager
def bystander(model: nn.Module, out: Path) -> Iterator[None]:
    """Another model is recorded, not this one: the process-wide hooks fire for each of this
    model's module calls and return at once (what any module in the process pays)."""
    with hooktrace.record(nn.Linear(1, 1), out / "run", overwrite=True):
        yield


@contextlib.contextmanager
def patched(model: nn.Module, out: Path, *patches: tuple[object, str, object]) -> Iterator[None]:
    """stats with each ``(owner, name, value)`` set for the recording's life: the route
    variants below, each leaving one compiled piece out."""
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        with hooktrace.record(model, out / "run", overwrite=True):
            yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


def onethread(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    # what kernel.one_pass asks before each large tensor
    return patched(model, out, (omp, "threads", lambda: 1))


def eager(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    """stats without numba: small CPU tensors staged and summarised by numpy in the writer,
    larger ones by torch's reductions in the hook, histograms by numpy."""
    return patched(model, out, (stats_module, "_route", EAGER))


def torchonly(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    """eager, and no staging: every CPU tensor summarised by torch's reductions in the hook."""
    return patched(
        model, out, (stats_module, "_route", EAGER), (stats_module, "STAGED_MAX_VALUES", 0)
    )


def smallstaged(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    """stats with every small CPU tensor staged and summarised by numpy in the writer: the
    compiled kernels that read them in place, and the writer's, kept out."""
    return patched(model, out, (numba_kernels, "staged", lambda: None))


def histnumpy(model: nn.Module, out: Path) -> contextlib.AbstractContextManager[None]:
    """stats with histograms counted by numpy instead of their compiled kernel."""
    return patched(model, out, (numba_kernels, "histograms", lambda: None))


EAGER = stats_module.Route("eager (benchmark)", 0.0, None)


VARIANTS: dict[str, Variant] = {
    "plain": plain,
    "empty": empty,
    "floor": floor,
    "naive": naive,
    "stats": stats,
    "nocapture": nocapture,
    "nohist": nohist,
    "bare": bare,
    "full": full,
    "bystander": bystander,
    "onethread": onethread,
    "eager": eager,
    "torchonly": torchonly,
    "smallstaged": smallstaged,
    "histnumpy": histnumpy,
}
REFERENCE_MODELS = ["SmallCNN", "TinyTransformer"]  # issue 8's two, in tests/models.py
DEFAULT = ["plain", "empty", "floor", "naive", "stats", "nocapture", "nohist", "full", "bystander"]


def page_faults() -> int:
    """Minor page faults of this process so far: memory the allocator handed back to the
    kernel and took again, which costs the training time whoever caused it."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


WARM_UP_STEPS = 10


def time_steps(
    name: str,
    variant: Variant,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    seconds: float,
    out: Path,
) -> tuple[float, float]:
    """Seconds and page faults per step, over at least ``seconds`` of steps."""
    batch = make_batch(name, seed=0)

    def step() -> None:
        loss = default_loss(batch.run(model), batch.target)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with variant(model, out):
        for _ in range(WARM_UP_STEPS):
            step()
        faults = page_faults()
        start = time.perf_counter()
        steps = 0
        while steps < 4 or time.perf_counter() - start < seconds:
            step()
            steps += 1
        elapsed = time.perf_counter() - start
        faults = page_faults() - faults
    return elapsed / steps, faults / steps


def bench(
    name: str, variants: list[str], *, reps: int, seconds: float
) -> dict[str, list[tuple[float, float]]]:
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for label in variants:  # warm-up: allocator, first-call costs
            time_steps(name, VARIANTS[label], model, opt, 0.0, out)
        shuffle = random.Random(0).shuffle
        for _ in range(reps):
            # a new order each repetition, so that no variant always runs right after the
            # same one: after full tensors, the disk's write-back slows whatever comes next
            order = list(variants)
            shuffle(order)
            for label in order:
                variant = VARIANTS[label]
                times[label].append(time_steps(name, variant, model, opt, seconds, out))
                os.sync()  # the disk's write-back of one variant's files must not slow the next
    return times


def report(name: str, times: dict[str, list[tuple[float, float]]], seconds: float) -> None:
    """Medians per variant, and each variant's ratio to plain paired by repetition: the
    host's speed drifts over minutes, and a repetition runs every variant within seconds."""

    def median(label: str, field: int = 0) -> float:
        return statistics.median(t[field] for t in times[label])

    def paired(label: str) -> list[float]:
        return sorted(a[0] / b[0] for a, b in zip(times[label], times["plain"], strict=True))

    base = median("plain")
    naive_overhead = median("naive") - base
    print(
        f"\n{name}: median step time over {len(times['plain'])} interleaved repetitions of"
        f" {seconds:g} s or more each"
    )
    print(
        f"  {'variant':<10} {'ms/step':>9} {'x plain':>8} {'overhead / naive overhead':>26}"
        f" {'page faults/step':>17} {'x plain, paired (quartiles)':>29}"
    )
    for label in times:
        share = (median(label) - base) / naive_overhead if naive_overhead > 0 else float("nan")
        ratios = paired(label)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
        print(
            f"  {label:<10} {median(label) * 1e3:9.2f} {median(label) / base:8.2f} {share:26.2f}"
            f" {median(label, 1):17.0f} {statistics.median(ratios):12.2f} ({q1:.2f} to {q3:.2f})"
        )
    for other in (
        "onethread",
        "nocapture",
        "nohist",
        "eager",
        "torchonly",
        "smallstaged",
        "histnumpy",
    ):
        if "stats" in times and other in times:  # the same repetition, side by side
            pairs = sorted(a[0] / b[0] for a, b in zip(times["stats"], times[other], strict=True))
            q1, _, q3 = statistics.quantiles(pairs, n=4) if len(pairs) > 1 else pairs * 3
            print(
                f"  stats / {other}, paired by repetition: median "
                f"{statistics.median(pairs):.3f} ({q1:.3f} to {q3:.3f})"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument(
        "--seconds", type=float, default=2.5, help="timed training per variant and repetition"
    )
    parser.add_argument("--models", default=",".join(REFERENCE_MODELS))
    parser.add_argument("--variants", default=",".join(DEFAULT))
    args = parser.parse_args()
    chosen = set(args.variants.split(",")) | {"plain", "naive"}
    unknown = chosen - set(VARIANTS)
    if unknown:
        parser.error(
            f"unknown variant(s) {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}"
        )
    variants = [v for v in VARIANTS if v in chosen]
    models = args.models.split(",")
    unknown = set(models) - set(REFERENCE_MODELS)
    if unknown:
        parser.error(
            f"unknown model(s) {', '.join(sorted(unknown))};"
            f" choose from {', '.join(REFERENCE_MODELS)}"
        )
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in models:
        report(name, bench(name, variants, reps=args.reps, seconds=args.seconds), args.seconds)
    taken = route_taken()
    if taken is not None:  # paid once per process, in the warm-up steps, outside the figures
        print(f"\nstatistics route: {taken.description}; warm-up {taken.warmup_s:.2f} s, once")


if __name__ == "__main__":
    main()
