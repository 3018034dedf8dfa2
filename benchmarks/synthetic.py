"""Synthetic traces for benchmarks: millions of rows in seconds, without torch.

:func:`generate_trace` writes a valid run directory through the real
:class:`~hooktrace.trace.writer.TraceWriter`, shaped like what the recorder writes for a stack
of ``Linear -> ReLU`` blocks trained with SGD. Per step, in ``seq`` order:

1. ``param`` rows (weight, bias) of every Linear, as the step's first forward sees them;
2. the forward pass: one ``output`` row per module; ReLU outputs carry per-unit activity
   (``units`` = width, each counted over ``unit_size`` = batch values);
3. the backward pass: one ``grad_output`` row per module, in reverse order;
4. ``grad_param`` rows (weight, bias) of every Linear.

A Linear gives 6 rows a step and a ReLU 2, so ``modules=250`` (125 of each) is 1,000 rows a
step, and 1,000 steps make 1M rows (:func:`rows_per_step` says how many for other sizes).

Values are drawn from ``seed`` (and rank and step), so two traces with the same arguments
are equal record for record. Planted faults, each starting at the first record of a module at
a step and lasting from there on, in execution order (later records of that step and every
later step), as a real fault propagates:

- ``perturb_from_step`` / ``perturb_module``: statistics scaled by ``1 + perturb_scale``
  (a divergence for ``hooktrace diff``: its first divergence is that module at that step);
- ``nan_from_step`` / ``nan_module``: statistics become NaN and ``nan_count`` = ``numel``
  (the origin of a NaN for ``hooktrace anomalies``);
- ``dead_units`` / ``dead_from_step``: the first ``dead_units`` units of every ReLU never
  fire from that step on (activity 0), for dead-unit analysis.

Run it to write one trace: ``python benchmarks/synthetic.py OUT --steps 1000 --modules 250``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hooktrace.trace import schema
from hooktrace.trace.step_data import StepData
from hooktrace.trace.writer import TraceWriter

LINEAR_TYPE = "torch.nn.modules.linear.Linear"
RELU_TYPE = "torch.nn.modules.activation.ReLU"
ROOT = "Net"


@dataclass
class SyntheticTrace:
    """What :func:`generate_trace` wrote."""

    path: Path
    rows: int
    steps: int
    modules: list[str]
    seconds: float


def module_names(modules: int) -> list[str]:
    """``blocks.0.fc, blocks.0.relu, blocks.1.fc, ...``: Linear at even, ReLU at odd positions."""
    return [f"blocks.{i // 2}.{'fc' if i % 2 == 0 else 'relu'}" for i in range(modules)]


def rows_per_step(modules: int) -> int:
    linears = (modules + 1) // 2
    return 6 * linears + 2 * (modules - linears)


def generate_trace(
    path: str | os.PathLike[str],
    *,
    steps: int,
    modules: int,
    width: int = 64,
    batch: int = 32,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    perturb_from_step: int | None = None,
    perturb_module: str | None = None,
    perturb_scale: float = 1e-3,
    nan_from_step: int | None = None,
    nan_module: str | None = None,
    dead_units: int = 0,
    dead_from_step: int = 0,
    writer_options: dict[str, Any] | None = None,
) -> SyntheticTrace:
    """Write ``steps`` x :func:`rows_per_step` (``modules``) records of rank ``rank`` into
    ``path`` (see the module docstring for the layout and the planted faults).
    ``writer_options`` go to the :class:`TraceWriter` (``max_buffer_bytes=1``: a part a step)."""
    if modules < 1 or steps < 1:
        raise ValueError("a synthetic trace needs at least one step and one module")
    names = module_names(modules)
    for option, name in (("perturb_module", perturb_module), ("nan_module", nan_module)):
        if name is not None and name not in names:
            raise ValueError(f"{option} {name!r} is not one of the modules ({names[0]}, ...)")
    t0 = time.perf_counter()
    template = _Template(names, width=width, batch=batch)
    writer = TraceWriter(
        path,
        rank=rank,
        manifest=_manifest(steps, modules, seed, world_size) if rank == 0 else None,
        **(writer_options or {}),
    )
    writer.add_modules(_module_rows(names, width))
    try:
        for step in range(steps):
            data = template.step(
                step,
                np.random.default_rng([seed, rank, step]),
                perturb=_onset(template, step, perturb_from_step, perturb_module),
                perturb_scale=perturb_scale,
                nan=_onset(template, step, nan_from_step, nan_module),
                dead_units=dead_units if step >= dead_from_step else 0,
            )
            writer.submit(_Ready(data))
    except BaseException:
        writer.close(schema.STATUS_FAILED, error="synthetic generation failed")
        raise
    writer.close(schema.STATUS_COMPLETE)
    if writer.error is not None:
        raise RuntimeError(f"the trace writer failed: {writer.error!r}")
    return SyntheticTrace(
        Path(path), steps * len(template.module), steps, names, time.perf_counter() - t0
    )


class _Ready:
    """A step already in numpy: what the writer's ``PendingStep`` protocol asks for."""

    def __init__(self, data: StepData) -> None:
        self.data = data
        self.nbytes = 160 * data.rows + sum(a.nbytes for _, a in data.activity)

    def materialize(self) -> StepData:
        return self.data


class _Template:
    """The per-step row layout, built once; each step only draws new values."""

    def __init__(self, names: list[str], *, width: int, batch: int) -> None:
        rows: list[
            tuple[str, str, str, tuple[int, ...], int]
        ] = []  # module, kind, slot, shape, units
        linears = [n for n in names if n.endswith(".fc")]
        for name in linears:
            rows += [
                (name, "param", "weight", (width, width), 0),
                (name, "param", "bias", (width,), 0),
            ]
        for name in names:
            units = width if name.endswith(".relu") else 0
            rows.append((name, "output", "0", (batch, width), units))
        for name in reversed(names):
            rows.append((name, "grad_output", "0", (batch, width), 0))
        for name in linears:
            rows += [
                (name, "grad_param", "weight", (width, width), 0),
                (name, "grad_param", "bias", (width,), 0),
            ]
        n = len(rows)
        self.batch = batch
        self.module = np.array([r[0] for r in rows], dtype=object)
        self.kind = np.array([r[1] for r in rows], dtype=object)
        self.slot = np.array([r[2] for r in rows], dtype=object)
        self.shape = np.array([",".join(map(str, r[3])) for r in rows], dtype=object)
        self.numel = np.array([int(np.prod(r[3])) for r in rows], dtype=np.int64)
        self.units = np.array([r[4] for r in rows], dtype=np.int32)
        self.unit_size = np.where(self.units > 0, batch, 0).astype(np.int64)
        self.activity_rows = np.flatnonzero(self.units > 0)
        self.phase = np.full(n, "train", dtype=object)
        self.dtype = np.full(n, "float32", dtype=object)
        self.seq = np.arange(n, dtype=np.int64)
        self.zeros_i32 = np.zeros(n, dtype=np.int32)
        relu_like = np.array(
            [r[0].endswith(".relu") and r[1] in ("output", "grad_output") for r in rows]
        )
        self.zero_base = np.where(relu_like, 0.5, 0.0)
        kind_scale = {"param": 0.1, "output": 1.0, "grad_output": 1e-3, "grad_param": 1e-2}
        self.scale = np.array([kind_scale[r[1]] for r in rows]) * np.linspace(1.0, 2.0, n)
        self.first_row: dict[str, int] = {}
        for i, name in enumerate(self.module):
            self.first_row.setdefault(str(name), i)

    def step(
        self,
        step: int,
        rng: np.random.Generator,
        *,
        perturb: int | None,
        perturb_scale: float,
        nan: int | None,
        dead_units: int,
    ) -> StepData:
        n = len(self.module)
        drift = 1.0 + 0.01 * rng.standard_normal(n)
        std = self.scale * drift
        mean = self.scale * 0.1 * rng.standard_normal(n)
        stats = {
            "mean": mean,
            "std": std,
            "min": mean - 3.0 * std,
            "max": mean + 3.0 * std,
            "norm": np.sqrt(self.numel * (std**2 + mean**2)),
            "zero_fraction": np.clip(self.zero_base + 0.02 * rng.standard_normal(n), 0, 1)
            * (self.zero_base > 0),
        }
        nan_count = np.zeros(n, dtype=np.int64)
        if perturb is not None:
            for name in ("mean", "std", "min", "max", "norm"):
                stats[name][perturb:] *= 1.0 + perturb_scale
        if nan is not None:
            for name in ("mean", "std", "min", "max", "norm"):  # zeros are still counted
                stats[name][nan:] = np.nan
            nan_count[nan:] = self.numel[nan:]
        activity = []
        for row in self.activity_rows:
            counts = rng.integers(0, self.batch + 1, size=int(self.units[row]), dtype=np.int64)
            counts[:dead_units] = 0
            activity.append((int(row), counts))
        columns: dict[str, Any] = {
            "step": np.full(n, step, dtype=np.int64),
            "micro_step": self.zeros_i32,
            "phase": self.phase,
            "seq": self.seq,
            "module": self.module,
            "call": self.zeros_i32,
            "kind": self.kind,
            "slot": self.slot,
            "dtype": self.dtype,
            "shape": self.shape,
            "numel": self.numel,
            **stats,
            "nan_count": nan_count,
            "inf_count": np.zeros(n, dtype=np.int64),
            "units": self.units,
            "unit_size": self.unit_size,
        }
        now = time.time()
        return StepData(step, 1, False, now, now, columns, activity=activity)


def _onset(template: _Template, step: int, from_step: int | None, module: str | None) -> int | None:
    """The first row of this step that a fault planted at (from_step, module) reaches."""
    if from_step is None or module is None or step < from_step:
        return None
    return template.first_row[module] if step == from_step else 0


def _module_rows(names: list[str], width: int) -> list[dict[str, Any]]:
    rows = [
        {"module": ROOT, "type": "torch.nn.modules.container.Sequential", "root": ROOT,
         "parent": "", "depth": 0, "parameters": 0, "first_step": 0}
    ]  # fmt: skip
    for name in names:
        linear = name.endswith(".fc")
        rows.append(
            {
                "module": name,
                "type": LINEAR_TYPE if linear else RELU_TYPE,
                "root": ROOT,
                "parent": "",
                "depth": name.count(".") + 1,
                "parameters": width * width + width if linear else 0,
                "first_step": 0,
            }
        )
    return rows


def _manifest(steps: int, modules: int, seed: int, world_size: int) -> dict[str, Any]:
    return {
        "format": schema.FORMAT_NAME,
        "format_version": schema.FORMAT_VERSION,
        "hooktrace_version": "synthetic",
        "torch_version": "none (synthetic)",
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "command": [
            "benchmarks/synthetic.py",
            f"--steps={steps}",
            f"--modules={modules}",
            f"--seed={seed}",
        ],
        "config": {"synthetic": True},
        "roots": [ROOT],
        "start_time": time.time(),
        "world_size": world_size,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write a synthetic hooktrace run.")
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--modules", type=int, default=250)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    made = generate_trace(args.out, steps=args.steps, modules=args.modules, seed=args.seed)
    print(f"wrote {made.rows:,} records ({made.steps} steps x {len(made.modules)} modules) "
          f"to {made.path} in {made.seconds:.1f} s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
