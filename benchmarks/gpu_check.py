"""The GPU half of issue 8, checked in one command where a CUDA device is present.

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

Prints one line per check and exits 1 if any fails. Without a CUDA device it says so and
exits 2. `--device cpu` runs the same steps on the CPU, where there is nothing to
synchronise: it checks the script, not the GPU.

Run: python benchmarks/gpu_check.py [--device cuda] [--models SmallCNN,TinyTransformer]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from models import Batch, default_loss, make_batch, make_model

import hooktrace


def to_device(batch: Batch, device: torch.device) -> Batch:
    def move(value: Any) -> Any:
        return value.to(device) if isinstance(value, torch.Tensor) else value

    return Batch(
        args=tuple(move(a) for a in batch.args),
        kwargs={k: move(v) for k, v in batch.kwargs.items()},
        target=move(batch.target),
    )


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


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batch: Batch) -> torch.Tensor:
    loss = default_loss(batch.run(model), batch.target)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def check_no_sync(name: str, device: torch.device, out: Path, *, full: bool) -> list[str]:
    """Problems found in one recorded step under the sync debug mode (empty: none)."""
    model = make_model(name).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = to_device(make_batch(name, seed=0), device)
    problems: list[str] = []
    kinds = "output,grad_output,param,grad_param"  # histograms on the device too: no sync
    with hooktrace.record(model, out, full_every=1 if full else None, histograms=kinds) as rec:
        for _ in range(2):  # first-call costs (cuDNN autotuning, allocator) outside the check
            train_step(model, opt, batch)
        held: list[Any] = []
        submit = rec._writer.submit
        rec._writer.submit = held.append  # the writer waits for the device: not in the window
        copies: list[torch.Tensor] = []
        try:
            with no_sync_allowed(device):
                train_step(model, opt, batch)
            copies = [t for step in held for _, t, _ in step.tensors]
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
    model = make_model(name, seed=0).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    batch = to_device(make_batch(name, seed=0), device)
    with hooktrace.record(model, out, histograms="output,grad_output,param,grad_param"):
        return [train_step(model, opt, batch).item() for _ in range(steps)]


def check_numbers(name: str, device: torch.device, tmp: Path) -> list[str]:
    """The GPU's records against the CPU's, for the same seeded training."""
    steps = 3
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
    rms = np.abs(a["norm"].to_numpy()[values]) / np.sqrt(a["numel"].to_numpy()[values])
    scale = np.maximum(rms, 1e-6)  # differences measured against each tensor's own scale
    for column in ["mean", "std", "min", "max", "norm", "zero_fraction"]:
        x, y = a[column].to_numpy()[values], b[column].to_numpy()[values]
        gap = np.abs(x - y) / (1.0 if column == "zero_fraction" else scale)
        worst = float(np.nanmax(gap)) if len(gap) else 0.0
        if not worst < 1e-2:
            problems.append(f"{column} differs by up to {worst:.2g} of the values' scale")
    if (a["nan_count"] != b["nan_count"]).any() or (a["inf_count"] != b["inf_count"]).any():
        problems.append("NaN or Inf counts differ")
    problems += _compare_histograms(hooktrace.load(tmp / "cpu"), hooktrace.load(tmp / "dev"))
    return problems


def _compare_histograms(cpu: hooktrace.Trace, dev: hooktrace.Trace) -> list[str]:
    """The device's histograms against the CPU's: every value counted, and the bins apart by
    no more than the values that other rounding moves across a power of two (2%)."""
    key = ["step", "module", "kind", "slot"]
    a = cpu.histograms().drop_duplicates(key).set_index(key).sort_index()
    b = dev.histograms().drop_duplicates(key).set_index(key).sort_index()
    if not a.index.equals(b.index) or len(a) == 0:
        return [f"histograms differ: {len(a)} on the cpu, {len(b)} on the device"]
    counted = b[["zero", "nan", "pos_inf", "neg_inf"]].sum(axis=1)
    counted += np.stack(b["pos"]).sum(axis=1) + np.stack(b["neg"]).sum(axis=1)
    problems = []
    if (counted != b["numel"]).any():
        problems.append("device histograms that do not count every value")
    moved = np.abs(np.stack(a["pos"]) - np.stack(b["pos"])).sum(axis=1)
    moved += np.abs(np.stack(a["neg"]) - np.stack(b["neg"])).sum(axis=1)
    worst = float((moved / np.maximum(a["numel"].to_numpy(), 1)).max())
    if not worst <= 0.02:
        problems.append(f"histograms differ by up to {worst:.1%} of a tensor's values")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", default="SmallCNN,TinyTransformer")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it where one is (or --device cpu to try it)")
        return 2
    print(f"torch {torch.__version__}, device {device}", end="")
    print(f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    failed = 0
    for name in args.models.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            checks = {
                "no sync, statistics": check_no_sync(name, device, Path(tmp) / "s", full=False),
                "no sync, full tensors, pinned": check_no_sync(
                    name, device, Path(tmp) / "f", full=True
                ),
                "records against the cpu": check_numbers(name, device, Path(tmp)),
            }
        for label, problems in checks.items():
            failed += bool(problems)
            verdict = "ok" if not problems else "FAILED: " + "; ".join(problems)
            print(f"  {name:<16} {label:<32} {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
