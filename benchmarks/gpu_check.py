"""The GPU checks, in one command where a CUDA device is present.

For each reference model (tests/models.py: SmallCNN, TinyTransformer) on the GPU:

  1. no synchronisation: a recorded training step (forward, loss, backward, optimizer
     step), statistics and histograms of every module's outputs, gradients and
     parameters, and then with full tensors of every module too, runs under
     torch.cuda.set_sync_debug_mode("error"), which raises on any operation that makes the
     host wait for the device. The step's records are handed to the writer only after the
     mode is switched off again: the writer thread waits for the device by design;
  2. pinned copies: every full tensor copied to the host during that step lies in pinned
     memory, so the copy does not block the training stream;
  3. the numbers: the same seeded training recorded on the CPU and on the GPU gives the
     same records, with statistics equal to float32 tolerance (cuDNN and the CPU sum in
     different orders), histograms that count every value and put at most 2% of a
     tensor's values in other bins than the CPU's (a value that other rounding moves
     across a power of two), and the training's loss is unchanged by recording.

The compiled path, for each model compiled by ``torch.compile`` (inductor; its graphs call
hooktrace's operator on each module's value, which takes the hooks' route):

  4. no synchronisation, as in 1, with histograms of every module's outputs and gradients
     (the graphs' variant that returns their values) and then with full tensors;
  5. recording leaves the compiled training as it was: the same seeded steps give the same
     losses and final parameters, bit for bit, and dynamo captures as many graphs;
  6. the compiled run's records match an eager recording of the same training on the same
     device, module by module (``hooktrace.diff`` at rtol 1e-3, the compiler's tolerance, and
     atol 1e-5 for gradients that are zero but for rounding), dropout switched off (the
     two runs draw their masks from different generators).

``--costs`` then prints what recording costs on the device: ``bench_device_batches.py``'s
parameters and gradients one by one and batched, ``bench_host.py``'s host cost per module
call and ``bench_compiled.py``'s step ratios, eager and compiled.

Prints one line per check and exits 1 if any fails. Without a CUDA device it says so and
exits 2. `--device cpu` runs the same steps on the CPU, where there is nothing to
synchronise: it checks the script, not the GPU.

Run: python benchmarks/gpu_check.py [--device cuda] [--models SmallCNN,TinyTransformer]
     [--checks eager,compiled] [--costs]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts: deterministic()
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_compiled
import bench_device_batches
import bench_host
from models import default_loss, make_batch, make_model

import hooktrace


@contextlib.contextmanager
def no_sync_allowed(device: torch.device) -> Iterator[None]:
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> torch.Tensor:
    loss = default_loss(batch.run(model), batch.target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def check_no_sync(
    name: str, device: torch.device, out: Path, *, full: bool, compiled: bool = False
) -> list[str]:
    """Problems found in one recorded step under the sync debug mode (empty: none)."""
    torch._dynamo.reset()
    model = make_model(name).to(device)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = make_batch(name, seed=0).to(device)
    problems: list[str] = []
    kinds = "output,grad_output,param,grad_param"  # histograms on the device too: no sync
    with hooktrace.record(run, out, full_every=1 if full else None, histograms=kinds) as rec:
        # the writer thread waits for the device by design, and the debug mode is the whole
        # process's: it is given no step until the check is over
        held: list[Any] = []
        submit = rec._writer.submit
        rec._writer.submit = held.append
        copies: list[torch.Tensor] = []
        try:
            for _ in range(2):  # first-call costs (compiling, cuDNN's autotuning) outside it
                train_step(run, opt, batch)
            with no_sync_allowed(device):
                train_step(run, opt, batch)
            copies = [t for _, t, _ in held[-1].tensors] if held else []
        except RuntimeError as exc:
            problems.append(f"a synchronisation in a recorded step: {str(exc).splitlines()[0]}")
        finally:
            rec._writer.submit = submit
            for step in held:
                submit(step)
        if rec.error is not None:
            problems.append(f"the recorder stopped: {rec.error}")
        if full and device.type == "cuda":
            if not copies:
                problems.append("no full tensor was copied in the checked step")
            unpinned = sum(1 for t in copies if not t.is_pinned())
            if unpinned:
                problems.append(f"{unpinned} of {len(copies)} full-tensor copies not pinned")
    return problems


def record_run(name: str, device: torch.device, out: Path, steps: int) -> list[float]:
    torch.manual_seed(0)
    model = without_dropout(make_model(name, seed=0).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = make_batch(name, seed=0).to(device)
    with hooktrace.record(model, out, histograms="output,grad_output,param,grad_param"):
        return [train_step(model, opt, batch).item() for _ in range(steps)]


def check_numbers(name: str, device: torch.device, tmp: Path) -> list[str]:
    """The GPU's records against the CPU's, for the same seeded training."""
    steps = 3
    with deterministic():
        cpu_loss = record_run(name, torch.device("cpu"), tmp / "cpu", steps)
        dev_loss = record_run(name, device, tmp / "dev", steps)
    problems = []
    if not np.allclose(cpu_loss, dev_loss, rtol=1e-3, atol=1e-5):
        problems.append(f"losses differ: cpu {cpu_loss} against {device.type} {dev_loss}")
    key = ["step", "phase", "module", "call", "kind", "slot"]
    a = hooktrace.load(tmp / "cpu").records.set_index(key).sort_index()
    b = hooktrace.load(tmp / "dev").records.set_index(key).sort_index()
    if not a.index.equals(b.index):
        problems.append(f"records differ: {len(a)} on the cpu, {len(b)} on {device.type}")
        return problems
    values = a["numel"].to_numpy() > 0  # parameters without a gradient have no statistics
    rms = np.abs(a["norm"].to_numpy()) / np.sqrt(np.maximum(a["numel"].to_numpy(), 1))
    # gradients that are zero but for rounding (a convolution's bias before a batch norm)
    # are noise of 1e-8 on both devices: compared with the scale of their kind's gradients
    noise = rms < 1e-4 * a.groupby(level="kind")["norm"].transform("median").to_numpy()
    values &= ~noise
    scale = np.maximum(rms[values], 1e-6)  # differences against each tensor's own scale
    where = a.index[values]
    # a gradient's exact zeros are sums that cancel, which depends on the order of the sums
    # (an attention's key bias): its zeros are compared as its histogram's bins are
    forward = ~a.index.get_level_values("kind").str.startswith("grad")[values]
    for column in ["mean", "std", "min", "max", "norm", "zero_fraction"]:
        x, y = a[column].to_numpy()[values], b[column].to_numpy()[values]
        gap = np.abs(x - y) / (1.0 if column == "zero_fraction" else scale)
        if column == "zero_fraction":
            gap = np.where(forward, gap, 0.0)
        worst = int(np.nanargmax(gap)) if len(gap) else -1
        if worst >= 0 and not gap[worst] < 1e-2:
            problems.append(
                f"{column} differs by up to {gap[worst]:.2g} of the values' scale, in "
                f"{where[worst]}: {x[worst]:.6g} on the cpu, {y[worst]:.6g} on the device"
            )
    if (a["nan_count"] != b["nan_count"]).any() or (a["inf_count"] != b["inf_count"]).any():
        problems.append("NaN or Inf counts differ")
    noisy = {(step, module, kind, slot) for step, _, module, _, kind, slot in a.index[noise]}
    problems += _compare_histograms(
        hooktrace.load(tmp / "cpu"), hooktrace.load(tmp / "dev"), leave_out=noisy
    )
    return problems


def without_dropout(model: nn.Module) -> nn.Module:
    """``model`` with every dropout at 0: an eager and a compiled run draw their masks from
    different generators, so only a model without dropout computes the same in both."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(module, nn.MultiheadAttention):
            module.dropout = 0.0
    return model


def compiled_training(
    name: str,
    device: torch.device,
    out: Path | None,
    *,
    compiled: bool = True,
    dropout: bool = True,
    steps: int = 3,
) -> tuple[list[float], dict[str, torch.Tensor], int]:
    """Seeded SGD steps of ``name`` on ``device``, compiled by inductor unless not
    ``compiled``, recorded into ``out`` where given: losses, final parameters, and the number
    of graphs dynamo captured."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)  # dropout's masks
    model = make_model(name, seed=0).to(device)
    if not dropout:
        without_dropout(model)
    run = torch.compile(model) if compiled else model
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = make_batch(name, seed=0).to(device)
    recording = hooktrace.record(run, out) if out is not None else contextlib.nullcontext()
    with recording:
        losses = [train_step(run, opt, batch) for _ in range(steps)]
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    graphs = int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    return [float(loss) for loss in losses], params, graphs


def check_compiled_trains_as_unrecorded(name: str, device: torch.device, tmp: Path) -> list[str]:
    with deterministic():
        return _compiled_trains_as_unrecorded(name, device, tmp)


def _compiled_trains_as_unrecorded(name: str, device: torch.device, tmp: Path) -> list[str]:
    plain_losses, plain_params, plain_graphs = compiled_training(name, device, None)
    again_losses, again_params, _ = compiled_training(name, device, None)
    if again_losses != plain_losses or any(
        not torch.equal(v, again_params[k]) for k, v in plain_params.items()
    ):  # the control: without it, a difference below could be the device's own
        return ["not deterministic on this device even unrecorded: nothing to compare"]
    losses, params, graphs = compiled_training(name, device, tmp / "compiled")
    problems = []
    if losses != plain_losses:
        problems.append(f"losses differ: {plain_losses} unrecorded against {losses}")
    changed = [k for k, v in plain_params.items() if not torch.equal(v, params[k])]
    if changed:
        problems.append(f"{len(changed)} parameters differ after training, {changed[0]} first")
    if graphs != plain_graphs:
        problems.append(f"dynamo captured {graphs} graphs recorded, {plain_graphs} unrecorded")
    return problems


ATOL = 1e-5


def check_compiled_against_eager(name: str, device: torch.device, tmp: Path) -> list[str]:
    compiled_training(name, device, tmp / "eager", compiled=False, dropout=False)
    compiled_training(name, device, tmp / "compiled", dropout=False)
    # atol: a gradient that is zero but for rounding (a convolution's bias before a batch
    # norm, an attention's key bias) is noise of 1e-7 in both runs on the CPU, and more on
    # a GPU (an H200 left 7 of the CNN's 201 records apart at 1e-6)
    result = hooktrace.diff(tmp / "eager", tmp / "compiled", rtol=1e-3, atol=ATOL)
    # and a gradient's exact zeros are sums that cancel (an attention's key bias), exact in
    # one run and 1e-10 in the other: a few percent of its zero fraction, nothing else, or
    # any share of it where the whole gradient is under atol (a convolution's 16 biases
    # before a batch norm: one of them an exact zero in one run, 1/16 of them)
    table = result.table
    noise = table[["norm_a", "norm_b"]].max(axis=1) < ATOL
    cancelled = (table["exceeded"] == "zero_fraction") & (
        (table["d_zero_fraction"].abs() < 0.05) | noise
    )
    apart = table[~cancelled]
    problems = []
    if result.structure.differs or len(apart):
        problems.append(" / ".join(repr(result).splitlines()[1:]))
    inside = set(hooktrace.load(tmp / "compiled").records["module"])
    if len(inside) < 3:
        problems.append(f"only {sorted(inside)} recorded: the modules inside are missing")
    return problems


def _compare_histograms(
    cpu: hooktrace.Trace, dev: hooktrace.Trace, *, leave_out: set[tuple[Any, ...]]
) -> list[str]:
    """The device's histograms against the CPU's: every value counted, and the bins apart by
    no more than the values that other rounding moves across a power of two (2%), but for
    the tensors in ``leave_out`` (rounding noise, binned by its rounding) and the bins of
    each tensor's rounding noise (below 2^-24 of its largest value), counted as zeros."""
    key = ["step", "module", "kind", "slot"]
    a = cpu.histograms().drop_duplicates(key).set_index(key).sort_index()
    b = dev.histograms().drop_duplicates(key).set_index(key).sort_index()
    a = a[~a.index.isin(list(leave_out))]
    b = b[~b.index.isin(list(leave_out))]
    if not a.index.equals(b.index) or len(a) == 0:
        return [f"histograms differ: {len(a)} on the cpu, {len(b)} on the device"]
    counted = b[["zero", "nan", "pos_inf", "neg_inf"]].sum(axis=1)
    counted += np.stack(b["pos"]).sum(axis=1) + np.stack(b["neg"]).sum(axis=1)
    problems = []
    if (counted != b["numel"]).any():
        problems.append("device histograms that do not count every value")
    # values 2^24 times smaller than a tensor's largest are its rounding noise, and exact
    # zeros where the sums cancelled: they are counted together, as one bin
    pos_a, pos_b = np.stack(a["pos"]), np.stack(b["pos"])
    neg_a, neg_b = np.stack(a["neg"]), np.stack(b["neg"])
    held = (pos_a + pos_b + neg_a + neg_b) > 0
    top = np.where(held.any(axis=1), held.shape[1] - 1 - np.argmax(held[:, ::-1], axis=1), 0)
    kept = np.arange(held.shape[1])[None, :] >= (top - 24)[:, None]
    moved = (np.abs(pos_a - pos_b) * kept).sum(axis=1) + (np.abs(neg_a - neg_b) * kept).sum(axis=1)
    tiny_a = a["zero"].to_numpy() + (pos_a * ~kept).sum(axis=1) + (neg_a * ~kept).sum(axis=1)
    tiny_b = b["zero"].to_numpy() + (pos_b * ~kept).sum(axis=1) + (neg_b * ~kept).sum(axis=1)
    moved += np.abs(tiny_a - tiny_b)
    share = moved / np.maximum(a["numel"].to_numpy(), 1)
    worst = int(np.argmax(share))
    if not share[worst] <= 0.02:
        problems.append(
            f"histograms differ by up to {share[worst]:.1%} of a tensor's values, in "
            f"{a.index[worst]}"
        )
    return problems


def eager_checks(name: str, device: torch.device, tmp: Path) -> dict[str, list[str]]:
    return {
        "no sync, statistics": check_no_sync(name, device, tmp / "s", full=False),
        "no sync, full tensors, pinned": check_no_sync(name, device, tmp / "f", full=True),
        "records against the cpu": check_numbers(name, device, tmp),  # (deterministic)
    }


def compiled_checks(name: str, device: torch.device, tmp: Path) -> dict[str, list[str]]:
    return {
        "compiled: no sync, histograms": check_no_sync(
            name, device, tmp / "cs", full=False, compiled=True
        ),
        "compiled: no sync, full tensors": check_no_sync(
            name, device, tmp / "cf", full=True, compiled=True
        ),
        "compiled: trains as unrecorded": check_compiled_trains_as_unrecorded(
            name, device, tmp / "u"
        ),
        "compiled: records match eager": check_compiled_against_eager(name, device, tmp / "e"),
    }


CHECKS = {"eager": eager_checks, "compiled": compiled_checks}


def tensor_costs(device: torch.device) -> None:
    """One tensor's statistics and histogram on the device, torch's route against the Triton
    kernels: the host's time a call (what a module call pays) and the device's (CUDA
    events), medians of 5 rounds of 50 calls; and the kernels' first use (Triton's compile and
    the check against torch's route)."""
    from hooktrace.recorder.stats import device_kernels
    from hooktrace.recorder.stats.torch_route import histogram_torch, summarize_on_device

    torch.cuda.synchronize(device)
    start = time.perf_counter()
    usable = device_kernels.usable(torch.ones(1, device=device))  # compiles them, checks them
    torch.cuda.synchronize(device)
    if not usable:
        print("\nno Triton kernels on this device: torch's route only")
        return
    print(
        f"\nthe kernels' first use (Triton's compile, the check): {time.perf_counter() - start:.2f} s"
    )
    routes = {
        "statistics, torch": summarize_on_device,
        "statistics, kernel": device_kernels.summarize,
        "histogram, torch": histogram_torch,
        "histogram, kernel": device_kernels.histogram,
    }
    print(f"{'values':>10} {'route':<20}{'host us':>10}{'device us':>11}{'GB/s':>8}")
    for numel in (64, 65_536, 1 << 24, 1 << 28):
        x = torch.randn(numel, device=device)
        for label, call in routes.items():
            host, dev = [], []
            for _ in range(5):
                torch.cuda.synchronize(device)
                begin, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                begin.record()
                start = time.perf_counter()
                for _ in range(50):
                    call(x)
                host.append((time.perf_counter() - start) / 50 * 1e6)
                end.record()
                torch.cuda.synchronize(device)
                dev.append(begin.elapsed_time(end) / 50 * 1e3)
            rate = numel * 4 / (statistics.median(dev) * 1e-6) / 1e9
            print(f"{numel:>10} {label:<20}{statistics.median(host):>10.1f}"
                  f"{statistics.median(dev):>11.1f}{rate:>8.0f}")  # fmt: skip
        del x


def costs(device: torch.device, models: list[str]) -> None:
    """What recording costs on the device: one tensor's statistics, the host per module
    call, and training steps."""
    if device.type == "cuda":
        tensor_costs(device)
    print()
    bench_device_batches.report(str(device), 15)
    print()
    layers = 200
    steps, reps = 10, 3
    bench_host.report(bench_host.measure(device, reps, steps, layers), device, steps, layers)
    bench_compiled.allow_a_recompile_per_recording()
    for name in models:
        bench_compiled.bench(name, 2, 0.5, device)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """The same numbers from the same steps: deterministic algorithms (cuBLAS's workspace is
    set before CUDA starts), no cuDNN autotuning, no TF32 (the CPU has none to compare
    with); each as it was afterwards."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cuda.matmul.allow_tf32,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0])
        torch.backends.cudnn.benchmark = saved[1]
        torch.backends.cudnn.allow_tf32 = saved[2]
        torch.backends.cuda.matmul.allow_tf32 = saved[3]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="SmallCNN,TinyTransformer")
    parser.add_argument("--checks", default="eager,compiled")
    parser.add_argument("--costs", action="store_true", help="then measure what recording costs")
    parser.add_argument("--costs-only", action="store_true", help="no checks, only the costs")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it where one is (or --device cpu to try it)")
        return 2
    print(f"torch {torch.__version__}, device {device}", end="")
    print(f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    failed = 0
    models = args.models.split(",")
    for name in models if not args.costs_only else []:
        for group in args.checks.split(","):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    checks = CHECKS[group](name, device, Path(tmp))
                except Exception as exc:  # one group's crash is its failure, not the script's
                    checks = {f"{group} checks": [f"{type(exc).__name__}: {exc}"]}
                    traceback.print_exc()
            for label, problems in checks.items():
                failed += bool(problems)
                verdict = "ok" if not problems else "FAILED: " + "; ".join(problems)
                print(f"  {name:<16} {label:<32} {verdict}", flush=True)
    if args.costs or args.costs_only:
        costs(device, models)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
