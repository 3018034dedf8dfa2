"""The background, crash-safe trace writer.

The recorder hands over one :class:`PendingStep` per recorded step and goes back to training.
A single writer thread turns it into numpy (``materialize``, where device-to-host copies are
waited for), buffers a few steps, and flushes them as one unit: first the HDF5 segment (closed,
then renamed), then the records, steps and modules Parquet parts (each written under a
temporary name, then renamed). A crash at any moment leaves only whole files behind.

Memory is bounded: ``submit`` blocks while more than ``max_buffer_bytes`` wait to be written
(backpressure), so nothing is dropped silently. Nothing here imports torch.

This module is the thread and its timing; how each file is written crash-safe is in
:mod:`hooktrace.trace.crash_safe`, and how the steps become Arrow tables in
:mod:`hooktrace.trace.step_data`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import pyarrow as pa

from hooktrace.errors import RecordingError
from hooktrace.trace import histograms, schema
from hooktrace.trace.crash_safe import write_json_atomic, write_parquet, write_segment
from hooktrace.trace.step_data import (
    StepData,
    concat_columns,
    histograms_table,
    steps_table,
    table,
)

_CLOSE = object()
_WAKE = object()  # a submitter waits for space: flush now rather than at the next timer

HOLD_STEPS = 8
"""Steps submitted before the writer is woken to take them, together (``_take_incoming``),
unless they hold ``HOLD_BYTES`` first or the flush timer comes sooner. Each holds its staging
buffer until then (``staging.StagingPool`` keeps enough)."""
HOLD_BYTES = 16 << 20


class PendingStep(Protocol):
    """What the recorder submits: cheap to create, converted in the writer thread."""

    nbytes: int

    def materialize(self) -> StepData: ...


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
            # from here the step weighs what it holds (a step's histograms are megabytes of
            # counts submitted, in the recorder's pool, and kilobytes of spans here): the
            # rest is given back now, so that the flush by size, the wake-up by size and
            # the back-pressure all count what is held
            surplus = pending.nbytes - data.held_bytes()
            if surplus > 0:
                self._buffered_bytes -= surplus
                self._release(surplus)
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
            columns = concat_columns(steps)
            segment = write_segment(
                self.run_dir, self.rank, index, steps, columns, compression=self.compression
            )
            ordered = {name: columns[name] for name in schema.RECORD_SCHEMA.names}
            try:
                records = table(ordered, schema.RECORD_SCHEMA)
                write_parquet(records, self._dirs[schema.RECORDS_DIR], index)
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
            write_parquet(steps_table(steps), self._dirs[schema.STEPS_DIR], index)
            self._write_histograms(steps, records, index)
        if modules:
            columns = {k: [m[k] for m in modules] for k in schema.MODULE_SCHEMA.names}
            write_parquet(
                table(columns, schema.MODULE_SCHEMA), self._dirs[schema.MODULES_DIR], index
            )

    def _write_histograms(self, steps: list[StepData], records: pa.Table, index: int) -> None:
        """The steps' histograms, one row per histogrammed record, beside the records (the
        directory is made with the first: a trace without histograms has none)."""
        found = histograms_table(steps, records)
        if found is None:
            return
        directory = self.run_dir / schema.rank_dir(histograms.HISTOGRAMS_DIR, self.rank)
        directory.mkdir(parents=True, exist_ok=True)
        write_parquet(found, directory, index)

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


def _describe(exc: BaseException) -> str:
    """``Type: message`` on one line (HDF5's messages can hold newlines)."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())
