"""The background, crash-safe trace writer.

The recorder hands over one :class:`PendingStep` per recorded step and goes back to training.
A single writer thread turns it into numpy (``materialize``, where device-to-host copies are
waited for), buffers a few steps, and flushes them as one unit: first the HDF5 segment (closed,
then renamed), then the records, steps and modules Parquet parts (each written under a
temporary name, then renamed). A crash at any moment leaves only whole files behind.

Memory is bounded: ``submit`` blocks while more than ``max_buffer_bytes`` wait to be written
(backpressure), so nothing is dropped silently. Nothing here imports torch.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import io
import json
import os
import queue
import threading
import time
import warnings
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hooktrace.errors import RecordingError
from hooktrace.trace import histograms, schema

_CLOSE = object()
_WAKE = object()  # a submitter waits for space: flush now rather than at the next timer

HOLD_STEPS = 8
"""Steps submitted before the writer is woken to take them, together (``_take_incoming``),
unless they hold ``HOLD_BYTES`` first or the flush timer comes sooner. Each holds its staging
buffer until then (``staging.StagingPool`` keeps enough)."""
HOLD_BYTES = 16 << 20


@dataclass
class StepData:
    """One recorded step as numpy, ready to write.

    ``columns`` holds the record columns the recorder knows (see ``RECORD_COLUMNS_IN``); the
    writer adds where activity and tensors land. ``activity`` and ``tensors`` pair a row
    index with its per-unit counts or its full tensor (with the tensor's own dtype name, which
    for bfloat16 travels as uint16 bits). ``histogram_rows`` are the rows histogrammed, in
    order, and ``histograms`` their counts, one row of ``histograms.WIDTH`` each.
    """

    step: int
    micro_steps: int
    skipped: bool
    start_time: float
    end_time: float
    columns: dict[str, Any]
    activity: list[tuple[int, np.ndarray]] = field(default_factory=list)
    tensors: list[tuple[int, np.ndarray, str]] = field(default_factory=list)
    dropped: int = 0
    nonfinite: bool = False  # a record holds a NaN or Inf
    histogram_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    histograms: np.ndarray = field(
        default_factory=lambda: np.zeros((0, histograms.WIDTH), dtype=np.int64)
    )
    histograms_failed: int = 0  # histograms that could not be made: the records hold

    @property
    def rows(self) -> int:
        return len(self.columns["step"])


RECORD_COLUMNS_IN = (
    "step", "micro_step", "phase", "seq", "module", "call", "kind", "slot", "dtype", "shape",
    "numel", "mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count",
    "units", "unit_size", "call_spec", "note",
)  # fmt: skip
_OPTIONAL: dict[str, list[str]] = {"call_spec": [], "note": []}


class PendingStep(Protocol):
    """What the recorder submits: cheap to create, converted in the writer thread."""

    nbytes: int

    def materialize(self) -> StepData: ...


def write_json_atomic(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_name(schema.temporary_name(path.name))
    with _removed_on_failure(tmp):
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
        os.replace(tmp, path)


@contextlib.contextmanager
def _removed_on_failure(tmp: Path) -> Any:
    """A write that fails (disk full, directory gone) leaves no temporary file behind: on a
    full disk it would hold space the training itself may need."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class TraceWriter:
    """Writes one rank's shard of a run directory from a background thread."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        rank: int = 0,
        manifest: Mapping[str, Any] | None = None,
        compression: str | None = None,
        max_buffer_bytes: int = 256 << 20,
        flush_seconds: float = 1.0,
        flush_rows: int = 200_000,
        flush_bytes: int = 32 << 20,
        hold_steps: int = HOLD_STEPS,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.compression = compression
        self.max_buffer_bytes = max_buffer_bytes
        self.flush_seconds = flush_seconds
        self.flush_rows = flush_rows
        self.flush_bytes = flush_bytes  # full tensors stream to disk instead of piling up
        self.hold_steps = hold_steps

        self.error: BaseException | None = None
        self.nonfinite_seen = False
        """Whether a step taken so far holds a NaN or Inf: where statistics stay on a GPU
        until this thread copies them, the first the recorder can learn of one without
        waiting for the device."""
        self.steps_written = 0
        self.records_written = 0
        self.histograms_failed = 0  # histograms the steps could not make (their records hold)
        self.tensors_written = 0
        self.bytes_written = 0
        self.steps_lost = 0
        self.blocked_seconds = 0.0

        self._dirs = {
            name: self.run_dir / schema.rank_dir(name, rank)
            for name in (
                schema.RECORDS_DIR,
                schema.STEPS_DIR,
                schema.MODULES_DIR,
                schema.TENSORS_DIR,
            )
        }
        self._status_path = self.run_dir / schema.STATUS_DIR / f"rank={rank}.json"
        self._started = time.time()
        try:
            for d in self._dirs.values():
                d.mkdir(parents=True, exist_ok=True)
            (self.run_dir / schema.STATUS_DIR).mkdir(parents=True, exist_ok=True)
            if manifest is not None:
                write_json_atomic(self.run_dir / schema.MANIFEST, manifest)
            self._write_status(schema.STATUS_RECORDING)
        except OSError as exc:
            raise RecordingError(
                f"cannot write a trace into {self.run_dir}: {exc.strerror or exc}; choose a "
                "writable directory with free space"
            ) from exc

        self._part = 0
        self._queue: queue.Queue[object] = queue.Queue()
        self._pending_bytes = 0
        self._space = threading.Condition()
        self._incoming: collections.deque[PendingStep] = collections.deque()  # submitted
        self._incoming_bytes = 0  # (both guarded by _space)
        self._buffer: list[StepData] = []
        self._buffered_bytes = 0  # bytes of the steps in _buffer, released when flushed
        self._buffered_rows = 0
        self._waiting = 0  # submitters blocked by backpressure
        self._new_modules: list[dict[str, Any]] = []
        self._modules_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="hooktrace-writer", daemon=True)
        self._thread.start()

    # -- called from the training thread ---------------------------------------------------

    def submit(self, pending: PendingStep) -> None:
        """Queue a step; blocks while the writer is ``max_buffer_bytes`` behind."""
        if self._closed:
            raise RuntimeError("submit() after close()")
        with self._space:
            if (
                self._pending_bytes > 0
                and self._pending_bytes + pending.nbytes > self.max_buffer_bytes
            ):
                t0 = time.perf_counter()
                self._waiting += 1
                self._queue.put(_WAKE)
                while (
                    self._pending_bytes > 0
                    and self._pending_bytes + pending.nbytes > self.max_buffer_bytes
                    and self._thread.is_alive()
                ):
                    self._space.wait(timeout=0.5)
                self._waiting -= 1
                self.blocked_seconds += time.perf_counter() - t0
            self._pending_bytes += pending.nbytes
            self._incoming.append(pending)
            self._incoming_bytes += pending.nbytes
            wake = (
                len(self._incoming) >= self.hold_steps
                or self._incoming_bytes >= HOLD_BYTES
                or self._pending_bytes >= self.flush_bytes  # a flush by size is due
            )
        if wake:  # else the writer takes the step with the next ones, or at its flush timer
            self._queue.put(_WAKE)

    def add_modules(self, rows: list[dict[str, Any]]) -> None:
        """Module table rows; written with the next flush."""
        with self._modules_lock:
            self._new_modules.extend(rows)

    def close(
        self,
        status: str,
        *,
        error: str | None = None,
        extra: Mapping[str, Any] | None = None,
        warn: bool = True,
    ) -> str | None:
        """Flush everything, stop the thread and write the final status. Idempotent.

        Returns what went wrong in the end that nobody was told yet (the final flush or the
        final status failed), None when nothing did; ``warn`` also says it as a warning (the
        recorder says it itself, pointing at the user's line)."""
        if self._closed:
            return None
        self._closed = True
        self._queue.put(_CLOSE)
        self._thread.join()
        problem = None
        if self.error is not None and status == schema.STATUS_COMPLETE:
            status = schema.STATUS_INCOMPLETE
        if self.error is not None and not (error and _describe(self.error) in error):
            # failed after the recorder last looked (in the final flush): nobody said so yet
            problem = (
                f"the trace writer failed ({_describe(self.error)}): {self.steps_lost} step(s) "
                f"were not written to {self.run_dir}"
            )
        if self.error is not None:
            error = error or f"trace writer failed: {_describe(self.error)}"
        try:
            self._write_status(status, error=error, extra=extra, final=True)
        except OSError as exc:  # the end of a recording must not take the training down
            if self.error is None:  # else the same trouble that stopped the writer
                self.error = exc
                problem = (
                    f"could not write the final status of {self.run_dir} ({_describe(exc)}): its "
                    f"{self.steps_written} step(s) written stay readable, but it reads as "
                    "unfinished"
                )
        if problem is not None and warn:
            warnings.warn(
                f"hooktrace: {problem}; training was not affected", RuntimeWarning, stacklevel=3
            )
        return problem

    # -- the writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        last_flush = time.monotonic()
        while True:
            timeout = max(0.05, self.flush_seconds - (time.monotonic() - last_flush))
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                item = None
            self._take_incoming()
            if item is _CLOSE:
                self._flush_safely()
                return
            if not self._buffer:
                continue
            if (
                self._buffered_rows >= self.flush_rows
                or self._buffered_bytes >= self.flush_bytes
                or self._waiting
                or time.monotonic() - last_flush >= self.flush_seconds
            ):
                self._flush_safely()
                last_flush = time.monotonic()

    def _take_incoming(self) -> None:
        """Materialise the steps submitted since the last time, one after the other.

        Steps arrive a few at a time (``HOLD_STEPS``): the training thread wakes this thread
        once for them, not once a step, and the interpreter's code and data stay in the caches
        from one step to the next, where a step at a time found them evicted by the training
        each time (on the reference CNN, 0.42-0.48 ms of the writer's time a step one at a
        time, 0.29-0.34 four at a time, 0.23-0.25 eight at a time)."""
        with self._space:
            taken = list(self._incoming)
            self._incoming.clear()
            self._incoming_bytes = 0
        for pending in taken:
            if self.error is not None:  # an earlier step failed: the rest are lost with it
                self.steps_lost += 1
                self._release(pending.nbytes)
                continue
            self._buffered_bytes += pending.nbytes
            try:
                data = pending.materialize()
            except BaseException as exc:  # a fault here must not reach training
                self.steps_lost += 1
                self._fail(exc)
                continue
            self._buffer.append(data)
            self._buffered_rows += data.rows
            self.nonfinite_seen = self.nonfinite_seen or data.nonfinite

    def _release(self, nbytes: int) -> None:
        with self._space:
            self._pending_bytes -= nbytes
            self._space.notify_all()

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.steps_lost += len(self._buffer)
        self._buffer.clear()
        self._buffered_rows = 0

    def _flush_safely(self) -> None:
        nbytes, self._buffered_bytes = self._buffered_bytes, 0
        self._buffered_rows = 0
        steps = len(self._buffer)
        written = self.steps_written
        try:
            if self.error is None:
                self._flush()
            else:
                self._buffer.clear()
        except BaseException as exc:
            self.steps_lost += steps - (self.steps_written - written)  # those not readable
            self._fail(exc)
        finally:
            self._release(nbytes)

    def _flush(self) -> None:
        with self._modules_lock:
            modules, self._new_modules = self._new_modules, []
        if not self._buffer and not modules:
            return
        steps, self._buffer = self._buffer, []
        index = self._part
        self._part += 1
        if steps:
            columns = _concat_columns(steps)
            segment = self._write_segment(index, steps, columns)
            ordered = {name: columns[name] for name in schema.RECORD_SCHEMA.names}
            try:
                records = _table(ordered, schema.RECORD_SCHEMA)
                self._write_parquet(records, self._dirs[schema.RECORDS_DIR], index)
            except BaseException:
                if segment is not None:  # no record points into it: give its space back
                    with contextlib.suppress(OSError):
                        segment.unlink()
                raise
            # the records part is in place: these steps are readable from here on
            self.steps_written += len(steps)
            self.histograms_failed += sum(d.histograms_failed for d in steps)
            self.records_written += records.num_rows
            self.tensors_written += sum(len(d.tensors) for d in steps)
            self.bytes_written += segment.stat().st_size if segment is not None else 0
            self._write_parquet(_steps_table(steps), self._dirs[schema.STEPS_DIR], index)
            self._write_histograms(steps, records, index)
        if modules:
            columns = {k: [m[k] for m in modules] for k in schema.MODULE_SCHEMA.names}
            table = _table(columns, schema.MODULE_SCHEMA)
            self._write_parquet(table, self._dirs[schema.MODULES_DIR], index)

    def _write_histograms(self, steps: list[StepData], records: pa.Table, index: int) -> None:
        """The steps' histograms, one row per histogrammed record, beside the records (the
        directory is made with the first: a trace without histograms has none)."""
        if not any(len(d.histogram_rows) for d in steps):
            return
        bases = np.cumsum([0] + [d.rows for d in steps[:-1]])
        rows = np.concatenate(
            [d.histogram_rows + base for d, base in zip(steps, bases, strict=True)]
        )
        counts = np.concatenate([d.histograms for d in steps])
        keys = records.take(pa.array(rows)).select(
            ["step", "seq", "module", "kind", "slot", "numel"]
        )
        columns = {name: keys.column(name) for name in keys.column_names}
        table = _table({**columns, **histograms.columns(counts)}, histograms.HISTOGRAM_SCHEMA)
        directory = self.run_dir / schema.rank_dir(histograms.HISTOGRAMS_DIR, self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        self._write_parquet(table, directory, index)

    def _write_segment(
        self, index: int, steps: list[StepData], columns: dict[str, Any]
    ) -> Path | None:
        """Write activity and full tensors; fill the location columns. Returns the segment
        written, or None when the steps hold neither."""
        n = len(columns["step"])
        offsets = np.full(n, -1, dtype=np.int64)
        keys = [""] * n
        activity: list[np.ndarray] = []
        tensors: list[tuple[int, np.ndarray, str]] = []
        base = 0
        position = 0
        for data in steps:
            for row, counts in data.activity:
                offsets[base + row] = position
                activity.append(counts)
                position += len(counts)
            tensors.extend((base + row, array, dtype) for row, array, dtype in data.tensors)
            base += data.rows
        columns["activity_offset"] = offsets
        segment_type = schema.RECORD_SCHEMA.field("segment").type
        if not activity and not tensors:
            columns["tensor_key"] = keys
            columns["segment"] = pa.nulls(n, segment_type)
            return None

        name = schema.segment_name(index)
        final = self._dirs[schema.TENSORS_DIR] / name
        tmp = final.with_name(schema.temporary_name(name))
        # h5py writes through a Python file object: a failed write (disk full, file too
        # large) is then a plain OSError, where HDF5's own driver leaves a half-closed file
        # behind that crashes the interpreter at exit. HDF5 1.10's file layout checksums its
        # metadata, and each tensor carries a CRC-32 of its bytes (below): a flipped bit is
        # then an error on reading, never a wrong value. (zlib computes it without holding the
        # GIL, where HDF5's fletcher32 filter held it and cost the training 3x a plain step.)
        with (
            _removed_on_failure(tmp),
            open(tmp, "w+b", buffering=0) as raw,  # HDF5 seeks between writes: no buffer
            _Sink(raw) as sink,
            h5py.File(sink, "w", libver=("v110", "latest")) as f,
        ):
            f.attrs["format"] = schema.FORMAT_NAME
            f.attrs["format_version"] = schema.FORMAT_VERSION
            if activity:
                merged = np.concatenate(activity).astype(np.int64, copy=False)
                # counts are small: shuffled, their high bytes compress away first (a third
                # smaller and a third faster than gzip alone on the reference models)
                f.create_dataset(
                    "activity", data=merged, compression="gzip", compression_opts=1, shuffle=True
                )
            group = f.create_group("t") if tensors else None
            for row, array, dtype in tensors:
                key = f"t/{row}"
                assert group is not None
                checksum = np.uint32(zlib.crc32(array.data))
                chunked = array.size > 1  # filters need chunks; a scalar has none
                ds = group.create_dataset(
                    str(row), data=array, compression=self.compression if chunked else None
                )
                ds.attrs["dtype"] = dtype
                ds.attrs[schema.TENSOR_CHECKSUM] = checksum
                keys[row] = key
        with _removed_on_failure(tmp):
            os.replace(tmp, final)
        relative = f"{schema.rank_dir(schema.TENSORS_DIR, self.rank)}/{name}"
        columns["tensor_key"] = keys
        columns["segment"] = pa.DictionaryArray.from_arrays(
            pa.array(np.zeros(n, dtype=np.int32)), arrow_strings([relative], pa.string())
        ).cast(segment_type)
        return final

    def _write_parquet(self, table: pa.Table, directory: Path, index: int) -> None:
        name = schema.part_name(index)
        tmp = directory / schema.temporary_name(name)
        with _removed_on_failure(tmp):
            # row groups of 64k rows: a step-range query decodes little more than it needs;
            # a CRC-32 in each page header, which the reader verifies. Statistics rarely
            # repeat a value: a dictionary of them is built only to be thrown away (plain,
            # they write a quarter faster and a quarter smaller)
            pq.write_table(
                table,
                tmp,
                compression="zstd",
                row_group_size=1 << 16,
                write_page_checksum=True,
                use_dictionary=[f.name for f in table.schema if not pa.types.is_floating(f.type)],
            )
            os.replace(tmp, directory / name)

    def _write_status(
        self,
        status: str,
        *,
        error: str | None = None,
        extra: Mapping[str, Any] | None = None,
        final: bool = False,
    ) -> None:
        payload: dict[str, Any] = {
            "rank": self.rank,
            "status": status,
            "start_time": self._started,
            "end_time": time.time() if final else None,
            "error": error,
            "steps_written": self.steps_written,
            "records_written": self.records_written,
            "tensors_written": self.tensors_written,
            "steps_lost": self.steps_lost,
            "writer_blocked_seconds": round(self.blocked_seconds, 6),
        }
        if extra:
            payload.update(extra)
        # the recorder's count (in the hooks), and the steps' (here, up to the last flush)
        payload["histograms_failed"] = payload.get("histograms_failed", 0) + self.histograms_failed
        write_json_atomic(self._status_path, payload)


class _Sink:
    """The file h5py writes a segment through. Its first failed operation is kept, not
    raised, and it does nothing after it (the segment is discarded anyway): an error raised
    into HDF5 while it flushes its cache on closing is printed as an "Exception ignored"
    traceback, one per write that follows. The kept error is raised once HDF5 is done."""

    def __init__(self, raw: io.FileIO) -> None:
        self._raw = raw
        self._position = 0  # where HDF5 thinks it is, once the file is given up
        self.failed: OSError | None = None

    def __enter__(self) -> _Sink:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.failed is not None and exc_info[0] is None:
            raise self.failed

    def _guard(self, operation: Callable[[], Any], otherwise: Any) -> Any:
        if self.failed is not None:
            return otherwise
        try:
            return operation()
        except OSError as exc:
            self.failed = exc
            return otherwise

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")

        def write_all() -> int:  # an unbuffered write may take less than it was given
            written = 0
            while written < len(view):
                count = self._raw.write(view[written:])
                if not count:
                    raise OSError(errno.EIO, f"wrote nothing to {self._raw.name}")
                written += count
            return written

        return int(self._guard(write_all, len(view)))

    def truncate(self, size: int) -> int:
        return int(self._guard(lambda: self._raw.truncate(size), size))

    def flush(self) -> None:
        self._guard(self._raw.flush, None)

    def seek(self, offset: int, whence: int = 0) -> int:
        self._position = offset if whence == 0 else self._position
        return int(self._guard(lambda: self._raw.seek(offset, whence), self._position))

    def tell(self) -> int:
        return int(self._guard(self._raw.tell, self._position))

    def read(self, size: int = -1) -> bytes:
        return bytes(self._guard(lambda: self._raw.read(size), b""))

    def readinto(self, buffer: Any) -> int:
        return int(self._guard(lambda: self._raw.readinto(buffer), 0))


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line (HDF5's messages can hold newlines)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _table(columns: dict[str, Any], table_schema: pa.Schema) -> pa.Table:
    """The columns as a table of ``table_schema``. A name that is not valid Unicode (a lone
    surrogate, from a name decoded with surrogateescape) has no UTF-8 form: it is written
    with backslash escapes instead of failing the whole flush."""
    try:
        return pa.Table.from_pydict(columns).cast(table_schema)
    except UnicodeEncodeError:
        escaped = {
            name: [_escape(v) for v in values] if isinstance(values, list) else values
            for name, values in columns.items()
        }
        return pa.Table.from_pydict(escaped).cast(table_schema)


def _escape(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def arrow_strings(values: list[str], type: pa.DataType) -> pa.Array:
    """``values`` as an Arrow array of ``type`` (a string or dictionary type), with names that
    are not valid Unicode backslash-escaped as :func:`_table` does."""
    try:
        return pa.array(values, type=type)
    except UnicodeEncodeError:
        return pa.array([_escape(v) for v in values], type=type)


def _concat_columns(steps: list[StepData]) -> dict[str, Any]:
    columns: dict[str, Any] = {}
    for name in RECORD_COLUMNS_IN:
        parts = [d.columns.get(name, _OPTIONAL.get(name, [])) for d in steps]
        if name in _OPTIONAL:  # may be left out by writers that have none
            parts = [
                p if len(p) == d.rows else [""] * d.rows for p, d in zip(parts, steps, strict=True)
            ]
        columns[name] = _concat(parts)
    return columns


def _concat(parts: list[Any]) -> Any:
    """One column from the steps' parts: numpy arrays, Arrow arrays or lists. A part that
    steps share (a :class:`~hooktrace.recorder.layout.Layout`'s column) is repeated as a
    whole, not value by value."""
    runs: list[tuple[Any, int]] = []  # (part, how many steps in a row share it)
    for part in parts:
        if runs and runs[-1][0] is part:
            runs[-1] = (part, runs[-1][1] + 1)
        else:
            runs.append((part, 1))
    if all(isinstance(p, np.ndarray) for p, _ in runs):
        return np.concatenate([np.tile(p, k) if k > 1 else p for p, k in runs])
    arrow = next((p.type for p, _ in runs if isinstance(p, pa.Array)), None)
    if arrow is None:
        return [v for p, k in runs for v in (p * k if k > 1 else p)]
    arrays = []
    for part, k in runs:
        array = part if isinstance(part, pa.Array) else arrow_strings(list(part), arrow)
        if k > 1:
            array = array.take(np.tile(np.arange(len(array), dtype=np.int64), k))
        arrays.append(array)
    return pa.concat_arrays(arrays)


def _steps_table(steps: list[StepData]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "step": d.step,
                "micro_steps": d.micro_steps,
                "skipped": d.skipped,
                "records": d.rows,
                "full_tensors": len(d.tensors),
                "dropped": d.dropped,
                "start_time": d.start_time,
                "end_time": d.end_time,
            }
            for d in steps
        ],
        schema=schema.STEP_SCHEMA,
    )
