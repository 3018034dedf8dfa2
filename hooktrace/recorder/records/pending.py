"""One step's observations, handed from the training thread to the writer thread.

While hooks fire, the training thread appends to the lists of a :class:`PendingStep` and
copies small tensors' values aside (:mod:`hooktrace.recorder.records.staging`). Everything else that
costs time (the staged tensors' statistics, stacking, the device-to-host copy, building
columns: :mod:`hooktrace.recorder.records.layout`) happens in :meth:`PendingStep.materialize`, which
the writer thread calls.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from hooktrace.recorder.records.layout import Layout, Layouts, MetaRow, dtype_name
from hooktrace.recorder.records.staging import Staged, StagedUnits, Staging, StagingPool
from hooktrace.recorder.stats import numba_kernels
from hooktrace.recorder.stats.histogram import histogram_staged
from hooktrace.recorder.stats.host import as_numpy
from hooktrace.recorder.stats.stats import STATS_WIDTH, Stats, activity_staged, summarize_staged
from hooktrace.trace.histograms import WIDTH as HISTOGRAM_WIDTH
from hooktrace.trace.histograms import Spans, columns
from hooktrace.trace.step_data import StepData


@dataclass
class PendingStep:
    step: int
    start_time: float
    meta: list[MetaRow] = field(default_factory=list)
    stats: list[Stats | Staged | None] = field(default_factory=list)
    activity: list[tuple[int, torch.Tensor | np.ndarray | StagedUnits]] = field(
        default_factory=list
    )
    histograms: list[tuple[int, np.ndarray | torch.Tensor | Staged]] = field(default_factory=list)
    # several records' histograms made together: their rows (int64) and counts (rows of
    # WIDTH, or cut to their spans by the kernel)
    histogram_blocks: list[tuple[np.ndarray, np.ndarray | Spans]] = field(default_factory=list)
    staging: Staging = field(default_factory=Staging)
    counts_pool: StagingPool | None = None  # where histogram_blocks' counts are counted into
    counts_held: list[torch.Tensor] = field(default_factory=list)  # taken from it this step
    layouts: Layouts | None = None  # shared between steps; None: each step builds its own
    tensors: list[tuple[int, torch.Tensor, torch.cuda.Event | None]] = field(default_factory=list)
    specs: dict[int, str] = field(default_factory=dict)  # row -> call spec (JSON)
    micro_steps: int = 0
    skipped: bool = False
    end_time: float = 0.0
    dropped: int = 0
    nbytes: int = 0

    def stage(self, tensor: torch.Tensor) -> Staged:
        """Copy a small CPU tensor aside; its statistics are computed in :meth:`materialize`."""
        return Staged(self.staging.add(tensor))

    def counts(self, values: int) -> np.ndarray:
        """``values`` int64 places (their contents undefined) where a block of
        :attr:`histogram_blocks` is counted (``histogram_kernel.histograms_at``): from the
        pool, which has them back once the step is materialized (:meth:`_histograms` copies
        them out). New megabytes of counts made and freed every step took the training
        thread 545 to 755 page faults a step in two runs of three (``getrusage``, 2026-11-30)."""
        if self.counts_pool is None:
            return np.empty(values, dtype=np.int64)
        buffer = self.counts_pool.take(values)
        self.counts_held.append(buffer)
        return buffer[:values].numpy()

    def materialize(self) -> StepData:
        try:
            return self._materialize()
        finally:
            self.staging.release()
            held, self.counts_held = self.counts_held, []
            if self.counts_pool is not None:
                for buffer in held:
                    self.counts_pool.give_back(buffer)

    def _materialize(self) -> StepData:
        n = len(self.meta)
        layout = self.layouts.of(self.meta) if self.layouts is not None else Layout(self.meta)
        stats = self._statistics()
        try:  # optional: a failure costs the step's histograms, not its records
            histogram_rows, histogram_columns = self._histograms()
            failed = 0
        except Exception:
            histogram_rows, histogram_columns = np.zeros(0, dtype=np.int64), None
            failed = len(self.histograms) + sum(len(rows) for rows, _ in self.histogram_blocks)
        with np.errstate(invalid="ignore", divide="ignore"):
            numel = layout.numel
            zero_fraction = np.where(numel > 0, stats[:, 5] / np.maximum(numel, 1), np.nan)
        nan_count: Any = stats[:, 6].astype(np.int64)
        inf_count: Any = stats[:, 7].astype(np.int64)
        if layout.skipped.any():  # not summarised: nothing is known of their values
            zero_fraction[layout.skipped] = np.nan
            nan_count = pa.array(nan_count, mask=layout.skipped)
            inf_count = pa.array(inf_count, mask=layout.skipped)
        columns = {
            **layout.columns,
            "step": np.full(n, self.step, dtype=np.int64),
            "mean": stats[:, 0],
            "std": stats[:, 1],
            "min": stats[:, 2],
            "max": stats[:, 3],
            "norm": stats[:, 4],
            "zero_fraction": zero_fraction,
            "nan_count": nan_count,
            "inf_count": inf_count,
            "call_spec": (
                [self.specs.get(row, "") for row in range(n)] if self.specs else layout.no_specs
            ),
        }
        tensors = []
        for row, tensor, event in self.tensors:
            if event is not None:
                event.synchronize()  # waits in this thread only, never in training
            array, name = to_numpy(tensor)
            tensors.append((row, array, name))
        return StepData(
            step=self.step,
            micro_steps=self.micro_steps,
            skipped=self.skipped,
            start_time=self.start_time,
            end_time=self.end_time,
            columns=columns,
            activity=self._activity(),
            tensors=tensors,
            dropped=self.dropped,
            nonfinite=bool((stats[:, 6] > 0).any() or (stats[:, 7] > 0).any()),
            histogram_rows=histogram_rows,
            histogram_columns=histogram_columns,
            histograms_failed=failed,
        )

    def _statistics(self) -> np.ndarray:
        """One row of ``STATS_WIDTH`` per record: NaN statistics and zero counts where the
        record has none (a parameter without a gradient)."""
        stats = np.empty((len(self.stats), STATS_WIDTH))
        stats[:, :5] = np.nan
        stats[:, 5:] = 0
        computed_rows: list[int] = []
        computed: list[np.ndarray] = []
        staged_rows: list[int] = []
        positions: list[int] = []
        device_rows: list[int] = []
        on_device: list[torch.Tensor] = []
        for row, value in enumerate(self.stats):
            kind = type(value)
            if kind is Staged:
                staged_rows.append(row)
                positions.append(value.position)  # type: ignore[union-attr]
            elif kind is np.ndarray:  # summarised on the host already
                computed_rows.append(row)
                computed.append(value)  # type: ignore[arg-type]
            elif value is not None:
                device_rows.append(row)
                on_device.append(value)  # type: ignore[arg-type]
        if computed:  # (one concatenation: a list of rows converts row by row, twice as slow)
            stats[computed_rows] = np.concatenate(computed).reshape(-1, STATS_WIDTH)
        if staged_rows:
            kernels = numba_kernels.staged()  # the same rows as numpy's, once ready
            values = self.staging.values()
            if kernels is not None:
                segments = kernels.summarize_segments(values, self.staging.bounds())
            else:
                segments = summarize_staged(values, self.staging.lengths_array())
            stats[staged_rows] = segments[positions]
        _wait_for_devices(on_device + [a for _, a in self.activity if isinstance(a, torch.Tensor)])
        if on_device:
            for gathered_rows, gathered in _gather(on_device, device_rows):
                stats[gathered_rows] = gathered
        return stats

    def _histograms(self) -> tuple[np.ndarray, dict[str, Any] | None]:
        """The histogrammed rows, in order, and their columns in the histogram table (None:
        none): staged tensors' made now, from their copies; a device's copied to the host,
        after :meth:`_statistics` waited for the devices; the blocks' spans as the kernel
        cut them, or cut here (the pool's blocks are read where they lie)."""
        entries = self.histograms
        rows = np.array([row for row, _ in entries], dtype=np.int64)
        counts = np.zeros((len(entries), HISTOGRAM_WIDTH), dtype=np.int64)
        staged: list[int] = []
        positions: list[int] = []
        on_device: list[int] = []
        tensors: list[torch.Tensor] = []
        for i, (_, value) in enumerate(entries):
            if type(value) is Staged:
                staged.append(i)
                positions.append(value.position)
            elif isinstance(value, np.ndarray):
                counts[i] = value
            else:
                on_device.append(i)
                tensors.append(value)  # type: ignore[arg-type]
        if staged:
            values, bounds = self.staging.values(), self.staging.bounds()
            counts[staged] = histogram_staged(values, bounds, positions)
        if tensors:
            _wait_for_devices(tensors)
            for gathered_rows, gathered in _gather(tensors, on_device):
                counts[gathered_rows] = gathered
        parts = [(r, c) for r, c in [(rows, counts), *self.histogram_blocks] if len(r)]
        if not parts:
            return rows, None
        kernels = numba_kernels.histograms()
        made = [_columns_of(block, kernels) for _, block in parts]
        rows = np.concatenate([r for r, _ in parts])
        made_columns = {
            name: pa.concat_arrays(cs) if isinstance(cs[0], pa.Array) else np.concatenate(cs)
            for name, cs in ((name, [m[name] for m in made]) for name in made[0])
        }
        if len(rows) > 1 and not (rows[1:] > rows[:-1]).all():  # in order, as a rule
            order = np.argsort(rows, kind="stable")
            rows = rows[order]
            taken = pa.array(order)
            made_columns = {
                name: column.take(taken) if isinstance(column, pa.Array) else column[order]
                for name, column in made_columns.items()
            }
        return rows, made_columns

    def _activity(self) -> list[tuple[int, np.ndarray]]:
        """Each record's per-unit positive counts (int64), in row order."""
        if not self.activity:
            return []
        activity: list[tuple[int, np.ndarray]] = []
        staged: list[tuple[int, StagedUnits]] = []
        on_device: list[tuple[int, torch.Tensor]] = []
        for row, counts in self.activity:
            if isinstance(counts, StagedUnits):
                staged.append((row, counts))
            elif isinstance(counts, np.ndarray):  # counted by the one-pass kernel
                activity.append((row, counts))
            elif counts.device.type == "cpu":  # a view, no copy
                activity.append((row, counts.to(torch.int64).numpy()))
            else:
                on_device.append((row, counts))
        if staged:
            activity.extend(self._staged_activity(staged))
        if on_device:
            rows, tensors = zip(*on_device, strict=True)
            for chunk_rows, merged in _gather_ragged(list(tensors), list(rows)):
                activity.extend(zip(chunk_rows, merged, strict=True))
        activity.sort(key=lambda item: item[0])
        return activity

    def _staged_activity(
        self, staged: list[tuple[int, StagedUnits]]
    ) -> list[tuple[int, np.ndarray]]:
        values, bounds = self.staging.values(), self.staging.bounds()
        kernels = numba_kernels.staged()  # the same counts as numpy's, once ready
        if kernels is None:
            spans = [(bounds[c.position], bounds[c.position + 1]) for _, c in staged]
            return [
                (row, activity_staged(values[lo:hi], c.shape, c.dim))
                for (row, c), (lo, hi) in zip(staged, spans, strict=True)
            ]
        # each tensor as (first value, outer, units, inner): one call counts them all
        segments = np.array(
            [(bounds[c.position], *_around(c.shape, c.dim)) for _, c in staged], dtype=np.int64
        )
        merged = kernels.unit_counts(values, segments)
        ends = np.cumsum(segments[:, 2]).tolist()
        return [
            (row, merged[end - c.units : end]) for (row, c), end in zip(staged, ends, strict=True)
        ]


def _columns_of(block: np.ndarray | Spans, kernels: Any) -> dict[str, Any]:
    """The histogram table's count columns of a block: cut to its spans by the kernel
    already, or whole rows cut here (in one compiled pass where the kernels are loaded)."""
    if isinstance(block, Spans):
        return block.columns()
    if kernels is None:
        return columns(block)
    block = np.ascontiguousarray(block)  # each row's address; the block lives through the call
    return kernels.span_columns(
        block.ctypes.data + np.arange(len(block), dtype=np.int64) * block.strides[0]
    )


def _wait_for_devices(tensors: list[torch.Tensor]) -> None:
    """Wait, in the writer's thread only, until each accelerator these tensors live on has run
    what was queued on it. Hooks queue the statistics on whatever stream is current where they
    fire (a side stream of the training's, autograd's), and the copies below run on this
    thread's own stream, which does not wait for those."""
    for device in {t.device for t in tensors if t.device.type not in ("cpu", "meta")}:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        else:  # xpu, mps, ...: where the backend has a synchronize
            backend = getattr(torch, device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()


def _gather(tensors: list[torch.Tensor], rows: list[int]) -> list[tuple[list[int], np.ndarray]]:
    """Stack equal-shaped tensors per device and copy each stack to the host once."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = []
    for indices in by_device.values():
        stacked = torch.stack([tensors[i] for i in indices]).cpu().numpy()
        out.append(([rows[i] for i in indices], stacked))
    return out


def _gather_ragged(
    tensors: list[torch.Tensor], rows: list[int]
) -> list[tuple[list[int], list[np.ndarray]]]:
    """Like _gather for 1-D tensors of different lengths: one concatenation, one copy."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    out = []
    for indices in by_device.values():
        merged = torch.cat([tensors[i].to(torch.int64) for i in indices]).cpu().numpy()
        bounds = np.cumsum([0] + [tensors[i].numel() for i in indices])
        pieces = [merged[bounds[k] : bounds[k + 1]] for k in range(len(indices))]
        out.append(([rows[i] for i in indices], pieces))
    return out


def _around(shape: tuple[int, ...], dim: int) -> tuple[int, int, int]:
    """(values before, units, values after) of ``shape`` around ``dim``."""
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A host tensor as numpy with the exact bits, and the dtype's name.

    numpy has no bfloat16 (and no float8): those travel as unsigned integers of the same width
    and the name says how to read them back.
    """
    name = dtype_name(tensor.dtype)
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return as_numpy(tensor.view(torch.int16)).view(np.uint16), name
    try:
        return as_numpy(tensor), name
    except RuntimeError:  # float8: "Unsupported dtype in DLTensor", numpy has no such type
        return as_numpy(tensor.view(torch.uint8)), name
