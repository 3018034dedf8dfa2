"""One step's observations, handed from the training thread to the writer thread.

While hooks fire, the training thread appends to lists and copies small tensors' values into
a reused buffer (:class:`Staging`), those it cannot read in place (before numba loads, or
another dtype or layout: ``stats``). Everything else that costs time (the staged tensors'
statistics, stacking, the device-to-host copy, building columns) happens in
:meth:`PendingStep.materialize`, which the writer thread calls.

The writer's time is not free either: on a 2-core machine it runs beside the training's own
second thread, and each millisecond it takes a step adds about a millisecond to the step. Most
of what a step's records say (module, kind, slot, shape, ...) is the same from step to step,
so those columns are built once per :class:`Layout` and shared; a step adds its values only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch
from torch._utils import _flatten_dense_tensors

from hooktrace.recorder.histogram import histogram_staged
from hooktrace.recorder.stats import (
    STATS_WIDTH,
    Stats,
    activity_staged,
    route_taken,
    summarize_staged,
)
from hooktrace.trace.histograms import WIDTH as HISTOGRAM_WIDTH
from hooktrace.trace.schema import NO_GRADIENT_DTYPE, NOTE_SKIPPED, RECORD_SCHEMA
from hooktrace.trace.writer import HOLD_STEPS, StepData, arrow_strings


class Meta(NamedTuple):
    """What a hook knows about one record, kept as cheap Python values. A record's ``seq`` is
    its row in the step (the writer numbers them)."""

    micro_step: int
    phase: str
    module: str
    call: int
    kind: str
    slot: str
    dtype: torch.dtype | None  # None: a parameter with no gradient
    shape: tuple[int, ...]
    units: int
    unit_size: int
    note: str = ""  # schema's ``note``: why there are no statistics, or how they were taken


class Staged(NamedTuple):
    """Statistics still to compute, of the tensor staged ``position``-th in the step."""

    position: int


class StagedUnits(NamedTuple):
    """Per-unit activity still to count, of a staged tensor of ``shape`` along ``dim``."""

    position: int
    shape: tuple[int, ...]
    dim: int

    @property
    def units(self) -> int:
        return self.shape[self.dim]


class StagingPool:
    """Float64 buffers that small tensors' values are copied into, reused from step to step.

    A step fills one buffer; the writer thread gives it back once the step's statistics are
    computed. Why not a copy per tensor: a few dozen allocations a step fewer in the hooks,
    and no concatenation in the writer. Small allocations that live for a step also change
    how the C allocator reuses the heap: in one measurement (the reference CNN, one thread)
    the training's own large tensors then took about 1,500 more page faults a step, more
    time than the statistics themselves; with the pool, no more than without recording
    (docs/PERFORMANCE.md).
    """

    def __init__(self, *, keep: int = HOLD_STEPS + 4, keep_values: int = 1 << 20) -> None:
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self._keep = keep  # buffers held between steps, at most: the steps the writer
        # holds, the step being recorded, and a few in the writer's queue
        self._keep_values = keep_values  # larger buffers are freed after use
        self.capacity = 1024  # values: the largest buffer asked for so far
        self.allocated = 0  # buffers made, over the pool's life

    def take(self, at_least: int) -> torch.Tensor:
        with self._lock:
            self.capacity = max(self.capacity, at_least)
            while self._free:
                buffer = self._free.pop()
                if buffer.numel() >= self.capacity:
                    return buffer
            self.allocated += 1
        with torch.inference_mode(False):  # hooks may fire inside inference mode: a buffer
            # made there could not be written outside it
            return torch.empty(self.capacity, dtype=torch.float64)

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for a later step, unless the pool holds enough, or it is smaller
        than steps now need, or larger than worth holding between steps."""
        with self._lock:
            fits = self.capacity <= buffer.numel() <= self._keep_values
            if fits and len(self._free) < self._keep and all(b is not buffer for b in self._free):
                self._free.append(buffer)


@dataclass
class Staging:
    """One step's small tensors, their values one after the other in a float64 buffer."""

    pool: StagingPool | None = None
    buffer: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)
    used: int = 0

    def add(self, tensor: torch.Tensor) -> int:
        """Copy ``tensor``'s values in now, before anything can change them; its position.

        float64 holds every real dtype's values exactly (integers up to 2**53)."""
        n = tensor.numel()
        if self.buffer is None or self.used + n > self.buffer.numel():
            self._grow(self.used + n)
        assert self.buffer is not None
        target = self.buffer[self.used : self.used + n]
        values = tensor.detach()
        if values.dim() > 1:
            if values.is_contiguous():
                values = values.view(-1)
            else:  # copied straight from its strides, with no contiguous copy between
                target = target.view(values.shape)
        target.copy_(values)
        self.used += n
        self.lengths.append(n)
        return len(self.lengths) - 1

    def add_many(self, tensors: list[torch.Tensor]) -> int:
        """:meth:`add` for several tensors of one dtype, with one copy; the first one's
        position (the others follow it)."""
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        n = flat.numel()
        if self.buffer is None or self.used + n > self.buffer.numel():
            self._grow(self.used + n)
        assert self.buffer is not None
        self.buffer[self.used : self.used + n].copy_(flat)
        self.used += n
        first = len(self.lengths)
        self.lengths.extend(t.numel() for t in tensors)
        return first

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self.buffer.numel() if self.buffer is not None else 0)
        if self.pool is not None:
            bigger = self.pool.take(size)
        else:
            with torch.inference_mode(False):
                bigger = torch.empty(size, dtype=torch.float64)
        if self.buffer is not None:
            bigger[: self.used].copy_(self.buffer[: self.used])
        self.buffer = bigger

    @property
    def nbytes(self) -> int:
        """The memory this step holds for staging: its whole buffer."""
        return self.buffer.numel() * 8 if self.buffer is not None else 0

    def values(self) -> np.ndarray:
        """The staged values, a view of the buffer: read them before :meth:`release`."""
        if self.buffer is None:
            return np.zeros(0)
        return self.buffer[: self.used].numpy()

    def bounds(self) -> np.ndarray:
        """Where each tensor's values begin, and after the last one, where they end."""
        bounds = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=bounds[1:])
        return bounds

    def lengths_array(self) -> np.ndarray:
        return np.array(self.lengths, dtype=np.int64)

    def release(self) -> None:
        """Give the buffer back for another step. Arrays from :meth:`values` point into it:
        another step's values overwrite them from here on."""
        buffer, self.buffer = self.buffer, None
        if buffer is not None and self.pool is not None:
            self.pool.give_back(buffer)


class Layout:
    """The columns of a step's records that do not depend on the values recorded: where each
    record comes from (module, call, kind, slot), what it holds (dtype, shape, units) and its
    place in the step. Built once, shared by every step whose records line up the same way;
    the writer repeats them without rebuilding (``step_data.concat_columns``)."""

    def __init__(self, meta: list[Meta]) -> None:
        n = len(meta)
        (micro_step, phase, module, call, kind, slot, dtype, shape, units, unit_size, note) = (
            zip(*meta, strict=True) if n else ((),) * len(Meta._fields)
        )
        self.rows = n
        self.numel = np.array(
            [_numel(s) if d is not None else 0 for s, d in zip(shape, dtype, strict=True)],
            dtype=np.int64,
        )
        strings = {
            "phase": list(phase),
            "module": list(module),
            "kind": list(kind),
            "slot": list(slot),
            "dtype": [dtype_name(d) for d in dtype],
            "shape": [shape_text(s) for s in shape],
            "note": list(note),
        }
        self.columns: dict[str, Any] = {
            "micro_step": np.array(micro_step, dtype=np.int32),
            "seq": np.arange(n, dtype=np.int64),  # the order the hooks saw the records in
            "call": np.array(call, dtype=np.int32),
            "numel": self.numel,
            "units": np.array(units, dtype=np.int32),
            "unit_size": np.array(unit_size, dtype=np.int64),
        }
        for name, values in strings.items():
            self.columns[name] = arrow_strings(values, RECORD_SCHEMA.field(name).type)
        self.no_specs = arrow_strings([""] * n, pa.string())  # call_spec where none was saved
        # records of tensors that were not summarised: no statistics, zero counts unknown
        self.skipped = np.array([s.startswith(NOTE_SKIPPED) for s in note], dtype=bool)


class Layouts:
    """The layouts of recent steps, by their records' :class:`Meta`: a training loop
    alternates between a few (a training step, an evaluation pass)."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._recent: OrderedDict[tuple[Meta, ...], Layout] = OrderedDict()
        self._lock = threading.Lock()  # materialize() normally runs in the writer thread only
        self.built = 0  # layouts built, over the cache's life

    def of(self, meta: list[Meta]) -> Layout:
        key = tuple(meta)
        with self._lock:
            layout = self._recent.get(key)
            if layout is not None:
                self._recent.move_to_end(key)
                return layout
        layout = Layout(meta)
        with self._lock:
            self.built += 1
            self._recent[key] = layout
            while len(self._recent) > self._keep:
                self._recent.popitem(last=False)
        return layout


@dataclass
class PendingStep:
    step: int
    start_time: float
    meta: list[Meta] = field(default_factory=list)
    stats: list[Stats | Staged | None] = field(default_factory=list)
    activity: list[tuple[int, torch.Tensor | np.ndarray | StagedUnits]] = field(
        default_factory=list
    )
    histograms: list[tuple[int, np.ndarray | torch.Tensor | Staged]] = field(default_factory=list)
    staging: Staging = field(default_factory=Staging)
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

    def materialize(self) -> StepData:
        try:
            return self._materialize()
        finally:
            self.staging.release()

    def _materialize(self) -> StepData:
        n = len(self.meta)
        layout = self.layouts.of(self.meta) if self.layouts is not None else Layout(self.meta)
        stats = self._statistics()
        try:  # optional: a failure costs the step's histograms, not its records
            histogram_rows, histograms = self._histograms()
            failed = 0
        except Exception:
            histogram_rows = np.zeros(0, dtype=np.int64)
            histograms = np.zeros((0, HISTOGRAM_WIDTH), dtype=np.int64)
            failed = len(self.histograms)
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
            histograms=histograms,
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
        if computed:
            stats[computed_rows] = computed
        if staged_rows:
            compiled = compiled_kernels()
            values = self.staging.values()
            if compiled is not None:
                segments = compiled.summarize_segments(values, self.staging.bounds())
            else:
                segments = summarize_staged(values, self.staging.lengths_array())
            stats[staged_rows] = segments[positions]
        _wait_for_devices(on_device + [a for _, a in self.activity if isinstance(a, torch.Tensor)])
        if on_device:
            for gathered_rows, gathered in _gather(on_device, device_rows):
                stats[gathered_rows] = gathered
        return stats

    def _histograms(self) -> tuple[np.ndarray, np.ndarray]:
        """The histogrammed rows, in order, and their counts (one row of ``WIDTH`` each):
        staged tensors' made now, from their copies; a device's copied to the host, after
        :meth:`_statistics` waited for the devices."""
        entries = sorted(self.histograms, key=lambda entry: entry[0])
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
        return rows, counts

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
        compiled = compiled_kernels()
        if compiled is None:
            spans = [(bounds[c.position], bounds[c.position + 1]) for _, c in staged]
            return [
                (row, activity_staged(values[lo:hi], c.shape, c.dim))
                for (row, c), (lo, hi) in zip(staged, spans, strict=True)
            ]
        # each tensor as (first value, outer, units, inner): one call counts them all
        segments = np.array(
            [(bounds[c.position], *_around(c.shape, c.dim)) for _, c in staged], dtype=np.int64
        )
        merged = compiled.unit_counts(values, segments)
        ends = np.cumsum(segments[:, 2]).tolist()
        return [
            (row, merged[end - c.units : end]) for (row, c), end in zip(staged, ends, strict=True)
        ]


def compiled_kernels() -> Any:
    """The compiled kernels for small tensors (:mod:`hooktrace.recorder.kernel`: staged
    values, and parameters read in place) once this process took the one-pass route, else
    None: importing numba is left to the first large CPU tensor. Their results equal
    numpy's, so which one runs changes the time only."""
    taken = route_taken()
    if taken is None or taken.one_pass is None:
        return None
    from hooktrace.recorder import kernel

    return kernel


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
    return _numel(shape[:dim]), shape[dim], _numel(shape[dim + 1 :])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_SHAPE_TEXTS: dict[tuple[int, ...], str] = {}


def shape_text(shape: tuple[int, ...]) -> str:
    """'32,16,8,8': the shape column's form (remembered: the same shapes recur every step)."""
    text = _SHAPE_TEXTS.get(shape)
    if text is None:
        text = ",".join(map(str, shape))
        if len(_SHAPE_TEXTS) < 65536:
            _SHAPE_TEXTS[shape] = text
    return text


def dtype_name(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return NO_GRADIENT_DTYPE
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def to_numpy(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A host tensor as numpy with the exact bits, and the dtype's name.

    numpy has no bfloat16 (and no float8): those travel as unsigned integers of the same width
    and the name says how to read them back.
    """
    name = dtype_name(tensor.dtype)
    tensor = tensor.contiguous()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(np.uint16), name
    try:
        return tensor.numpy(), name
    except TypeError:
        return tensor.view(torch.uint8).numpy(), name
