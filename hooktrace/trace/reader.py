"""Reading traces into pandas: :func:`load` and :class:`Trace`. Never imports torch.

Filters are pushed down to pyarrow, so a question reads only the columns and row groups it
needs. Part files that cannot be read are skipped and listed in ``Trace.skipped``, with a
:class:`TraceWarning` each; they never make the rest of a trace unreadable. Nothing here
unpickles: JSON, Parquet read against hooktrace's own schema, and numeric HDF5 datasets only.
"""

from __future__ import annotations

import json
import os
import stat
import warnings
import zlib
from collections.abc import Callable, Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from hooktrace.errors import (
    FormatVersionError,
    TensorNotRecorded,
    TraceError,
    TraceNotFound,
    TraceTooLarge,
    TraceWarning,
)
from hooktrace.trace import histograms, schema, timeline
from hooktrace.trace.captures import capture_paths, capture_table, read_meta, read_tensors

# torch dtypes numpy lacks: stored as unsigned integers of the same width (docs/FORMAT.md)
_NUMPY_DTYPES = {
    "bfloat16": ml_dtypes.bfloat16,
    "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2,
    "float8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
    "float8_e5m2fnuz": ml_dtypes.float8_e5m2fnuz,
}


def decode_dataset(dataset: Any, where: str) -> np.ndarray:
    """A full tensor from its HDF5 dataset, with its exact dtype (bfloat16 and float8 as
    ml_dtypes). Raises TraceError for anything that is not a plain numeric array: hooktrace
    writes no such thing, so the trace was altered, and it is not read."""
    kind = dataset.dtype.kind if isinstance(dataset, h5py.Dataset) else "group"
    if kind not in ("b", "i", "u", "f", "c"):
        raise TraceError(
            f"{where} is not a numeric array ({kind}): hooktrace writes no such thing, so the "
            "trace was altered; it is not read"
        )
    data = np.asarray(dataset[()])
    checksum = dataset.attrs.get(schema.TENSOR_CHECKSUM)
    if checksum is not None and zlib.crc32(np.ascontiguousarray(data).data) != int(checksum):
        raise TraceError(
            f"cannot read {where}: its bytes no longer match their checksum, so the segment "
            "was damaged after it was written; run `hooktrace check`"
        )
    dtype = dataset.attrs.get("dtype", data.dtype.name)
    if isinstance(dtype, bytes):
        dtype = dtype.decode("utf-8", "replace")
    target = _NUMPY_DTYPES.get(str(dtype))
    if target is not None:
        if data.dtype.itemsize != np.dtype(target).itemsize:
            raise TraceError(
                f"{where} is stored as {data.dtype}, which cannot hold {dtype}: the trace was altered"
            )
        data = data.view(target)
    return data


_MAX_RANK = 2**31 - 1  # the rank partition column is int32

# pages written with a CRC-32 (hooktrace since 2026-11-21) are verified; older ones have none
_PARQUET = ds.ParquetFileFormat(
    default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
)


MAX_RECORDS = 4_000_000
"""How many records ``Trace.records`` loads at most, by default: about 1.7 GB at its peak
(some 400 bytes a record while pyarrow's table and pandas' frame both exist), within the
2 GB the analyzer keeps to. Past it, ``records`` raises :class:`TraceTooLarge`, which shows the
filtered ways (:meth:`Trace.query`, :meth:`Trace.sql`)."""


def load(path: str | os.PathLike[str], *, max_records: int | None = MAX_RECORDS) -> Trace:
    """Open the run directory at ``path``; nothing is read but the manifest, the statuses and
    the Parquet footers. ``max_records`` bounds what ``Trace.records`` loads (None: no bound).

    Raises :class:`TraceNotFound` when there is no run there and :class:`TraceError` when the
    manifest cannot be read or was written by a newer format.
    """
    return Trace(path, max_records=max_records)


class Trace:
    """One recorded run (all ranks), read lazily.

    ``records``, ``steps`` and ``modules`` are DataFrames (read on first use and kept);
    :meth:`query` reads a filtered subset without loading everything; :meth:`sql` answers a
    DuckDB query over the tables ``records``, ``steps`` and ``modules``; :meth:`tensor`
    returns a saved full tensor as a numpy array.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, max_records: int | None = MAX_RECORDS
    ) -> None:
        self.path = Path(path)
        self.max_records = max_records
        """The most records :attr:`records` loads (None: no bound); set it to load more."""
        if not self.path.exists():
            raise TraceNotFound(f"no run at {self.path}: give the directory a recording wrote")
        if not self.path.is_dir():
            raise TraceNotFound(f"{self.path} is a file, not a run: give the run directory")
        if not _utf8(str(self.path.resolve())):
            raise TraceError(
                f"{_printable(self.path)}: the path is not valid UTF-8, which Parquet readers "
                "need: rename the run directory (or a directory above it)"
            )
        manifest_path = self.path / schema.MANIFEST
        self.skipped: list[str] = []
        """Files that could not be read and were left out, each with the reason."""
        self._manifest = _read_manifest(manifest_path, self._leave_out)
        self._status = _read_statuses(self.path / schema.STATUS_DIR, self._leave_out)
        self._metadata: dict[Path, pq.FileMetaData] = {}
        self._parts = {
            name: self._discover(name)
            for name in (
                schema.RECORDS_DIR, schema.STEPS_DIR, schema.MODULES_DIR, histograms.HISTOGRAMS_DIR
            )
        }  # fmt: skip
        self._step_spans: dict[Path, tuple[int, int] | None] = {}
        self._sql: Any = None  # the DuckDB connection, made on first use
        self._sql_parts: dict[str, list[Path]] = {}

    # -- what the run is ---------------------------------------------------------------------

    @property
    def manifest(self) -> dict[str, Any]:
        """manifest.json, with ``status``, ``end_time`` and ``ranks`` folded in from status/."""
        merged = dict(self._manifest)
        merged["status"] = self.status
        ends = [s.get("end_time") for s in self._status.values()]
        finished = [float(e) for e in ends if e is not None]
        merged["end_time"] = max(finished) if finished and len(finished) == len(ends) else None
        merged["ranks"] = {str(r): s for r, s in sorted(self._status.items())}
        return merged

    @property
    def status(self) -> str:
        """The worst status over ranks: failed, incomplete, recording, then complete."""
        statuses = {s.get("status", schema.STATUS_INCOMPLETE) for s in self._status.values()}
        world = int(self._manifest.get("world_size", 1) or 1)
        if len(self._status) < world:
            statuses.add(schema.STATUS_INCOMPLETE)
        for status in (schema.STATUS_FAILED, schema.STATUS_INCOMPLETE, schema.STATUS_RECORDING):
            if status in statuses:
                return status
        return schema.STATUS_COMPLETE if statuses else schema.STATUS_INCOMPLETE

    @property
    def format_version(self) -> str:
        return str(self._manifest["format_version"])

    @property
    def ranks(self) -> list[int]:
        found = {_rank_of(p) for parts in self._parts.values() for p in parts}
        return sorted(found | set(self._status))

    # -- tables ------------------------------------------------------------------------------

    @property
    def record_count(self) -> int:
        """How many records the readable parts hold, from their footers (nothing decoded)."""
        return sum(self._metadata[p].num_rows for p in self._parts[schema.RECORDS_DIR])

    @cached_property
    def records(self) -> pd.DataFrame:
        """Every record: one row per recorded tensor per call per step (see docs/FORMAT.md).

        Raises :class:`TraceTooLarge` when the trace holds more than :attr:`max_records`:
        then read a part of it with :meth:`query`, or ask in SQL with :meth:`sql`."""
        count = self.record_count
        if self.max_records is not None and count > self.max_records:
            raise TraceTooLarge(
                f"{_printable(self.path)} holds {count:,} records, more than trace.records loads "
                f"into memory (max_records={self.max_records:,}; some 400 bytes a record in "
                "pandas): read the part you need, e.g. trace.query(steps=(0, 99), "
                "modules=['encoder.0.fc'], kinds=['grad_param'], columns=['step', 'module', "
                "'norm']), or ask in SQL: trace.sql(\"SELECT module, max(norm) FROM records "
                "WHERE kind = 'grad_param' GROUP BY module\"); or load it all anyway with "
                "hooktrace.load(run, max_records=None)"
            )
        return self.query()

    def sql(self, query: str, parameters: Sequence[Any] | None = None) -> pd.DataFrame:
        """The answer of a DuckDB ``query`` over this trace, as a DataFrame.

        The tables are ``records``, ``steps``, ``modules`` and ``histograms`` (with ``rank``), as
        docs/FORMAT.md describes them; DuckDB reads only the columns and row groups the query
        needs, on every core, spilling to disk past its memory limit::

            trace.sql("SELECT module, max(norm) AS norm FROM records "
                      "WHERE kind = 'grad_param' GROUP BY module ORDER BY norm DESC")

        ``parameters`` fill the query's ``?`` or ``$1`` placeholders. A query DuckDB refuses
        (a syntax error, an unknown column) raises :class:`TraceError` with DuckDB's reason.
        """
        import duckdb

        try:
            return self._duckdb().execute(query, parameters).df()
        except duckdb.Error as exc:
            raise TraceError(
                f"the query over {_printable(self.path)} failed: {_one_line(exc)} (tables: "
                "records, steps, modules, histograms; columns as in docs/FORMAT.md)"
            ) from exc

    def _duckdb(self) -> Any:
        """The DuckDB connection, its views over the parts readable now."""
        from hooktrace.trace import sql

        columns = {
            name: {c for p in parts for c in _columns(self._metadata[p])}
            for name, parts in self._parts.items()
        }
        if self._sql is None:
            self._sql = sql.connect(self._parts, columns)
        elif self._sql_parts != self._parts:  # a part found damaged since: left out
            sql.define_views(self._sql, self._parts, columns)
        self._sql_parts = {name: list(parts) for name, parts in self._parts.items()}
        return self._sql

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per recorded step and rank: micro-steps, skipped, counts, wall times."""
        table = self._read(schema.STEPS_DIR, schema.STEP_SCHEMA)
        frame = table.to_pandas()
        return frame.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)

    @cached_property
    def modules(self) -> pd.DataFrame:
        """One row per module and rank: type, root, parent, depth, parameter count."""
        table = self._read(schema.MODULES_DIR, schema.MODULE_SCHEMA)
        frame = table.to_pandas()
        frame = frame.drop_duplicates(["rank", "module"], keep="first")
        return frame.reset_index(drop=True)

    def query(
        self,
        *,
        columns: Sequence[str] | None = None,
        steps: Iterable[int] | tuple[int, int] | None = None,
        modules: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        phases: Iterable[str] | None = None,
    ) -> pd.DataFrame:
        """Records matching every filter given, reading only what is needed.

        ``steps`` is either an iterable of step numbers or an inclusive ``(first, last)``
        range given as a tuple of two ints. Rows come in (rank, step, seq) order.
        """
        steps = _steps(steps)
        expr = _filter(steps=steps, modules=modules, kinds=kinds, ranks=ranks, phases=phases)
        span = _span(steps)
        wanted = None
        if columns is not None:
            wanted = list(dict.fromkeys([*columns]))
            unknown = set(wanted) - set(schema.RECORD_SCHEMA.names) - {"rank"}
            if unknown:
                raise TraceError(
                    f"unknown record column(s) {sorted(unknown)}: choose from "
                    f"{', '.join(['rank', *schema.RECORD_SCHEMA.names])}"
                )
        table = self._read(
            schema.RECORDS_DIR, schema.RECORD_SCHEMA, columns=wanted, filter=expr,
            parts=None if span is None else self._parts_holding(*span),
        )  # fmt: skip
        frame = table.to_pandas()
        if "note" in frame.columns and frame["note"].hasnans:  # a 1.0 trace has no notes
            frame["note"] = _no_notes(frame["note"])
        order = [c for c in ("rank", "step", "seq") if c in frame.columns]
        if order and not in_order(frame, order):
            frame = frame.sort_values(order, kind="stable").reset_index(drop=True)
        return frame

    @property
    def has_histograms(self) -> bool:
        """Whether the trace holds histograms (recorded with ``histograms=`` kinds, since 1.3)."""
        return bool(self._parts[histograms.HISTOGRAMS_DIR])

    @property
    def histogram_count(self) -> int:
        """Histogram rows in the readable parts (from their footers: nothing is read)."""
        return sum(self._metadata[p].num_rows for p in self._parts[histograms.HISTOGRAMS_DIR])

    def histograms(
        self,
        *,
        steps: Iterable[int] | tuple[int, int] | None = None,
        modules: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
    ) -> pd.DataFrame:
        """The histograms matching every filter given (as :meth:`query` takes them), one row
        per histogrammed record in (rank, step, seq) order: ``rank``, ``step``, ``seq``,
        ``module``, ``kind``, ``slot``, ``numel``, the ``zero``, ``nan``, ``pos_inf`` and
        ``neg_inf`` counts, and ``pos`` and ``neg``, each a numpy array of
        ``MAGNITUDE_BINS`` counts by binary exponent (docs/FORMAT.md, "histograms";
        :func:`hooktrace.trace.histograms.exponents` gives each bin's exponent).

        Raises :class:`TraceError` when the trace holds no histograms at all."""
        if not self.has_histograms:
            raise TraceError(
                f"{_printable(self.path)} holds no histograms: {self.no_histograms_because}"
            )
        steps = _steps(steps)
        span = _span(steps)
        expr = _filter(steps=steps, modules=modules, kinds=kinds, ranks=ranks)
        table = self._read(
            histograms.HISTOGRAMS_DIR, histograms.HISTOGRAM_SCHEMA, filter=expr,
            parts=None if span is None else self._parts_holding(*span, histograms.HISTOGRAMS_DIR),
        )  # fmt: skip
        spans = {name: table.column(name) for name in ("pos_start", "pos", "neg_start", "neg")}
        frame = table.drop_columns(list(spans)).to_pandas()
        for sign in ("pos", "neg"):
            starts = spans[f"{sign}_start"].to_numpy()
            frame[sign] = list(histograms.whole(starts, spans[sign]))
        frame = frame[["rank", *(c for c in frame.columns if c != "rank")]]
        if not in_order(frame, ["rank", "step", "seq"]):
            frame = frame.sort_values(["rank", "step", "seq"], kind="stable")
        return frame.reset_index(drop=True)

    @property
    def no_histograms_because(self) -> str:
        """Why the trace holds no histograms, and how to record them, in a clause (where it
        does hold some, what was asked for)."""
        kinds = self.manifest.get("config", {}).get("histograms")
        how = "record with `hooktrace record --histograms param,grad_param`"
        if kinds == []:
            return f"it was recorded with histograms off; {how}"
        if kinds is None:
            return f"it was written before format 1.3, which added them; {how}"
        return f"none was written (histograms of {', '.join(kinds)} were asked for)"

    def timeline(self, step: int, *, micro_step: int | None = None, rank: int = 0) -> pd.DataFrame:
        """The events of ``step`` in execution order, with nesting depth and parent call:
        see :func:`hooktrace.trace.timeline.timeline`."""
        return timeline.timeline(self, step, micro_step=micro_step, rank=rank)

    # -- tensors -----------------------------------------------------------------------------

    def record(
        self,
        module: str,
        kind: str,
        *,
        step: int,
        slot: str = "0",
        call: int = 0,
        rank: int = 0,
        micro_step: int | None = None,
        phase: str | None = None,
    ) -> pd.Series:
        """The single record that matches; raises TensorNotRecorded, saying what exists."""
        rows = self.query(steps=[step], modules=[module], kinds=[kind], ranks=[rank])
        match = rows[(rows["slot"].astype(str) == slot) & (rows["call"] == call)]
        if micro_step is not None:
            match = match[match["micro_step"] == micro_step]
        if phase is not None:
            match = match[match["phase"].astype(str) == phase]
        if match.empty:
            raise TensorNotRecorded(
                f"no {kind} record of {module!r} (slot {slot}, call {call}, rank {rank}) at step "
                f"{step}: {self._what_exists(module, kind, rank)}"
            )
        return match.iloc[0]

    def tensor(
        self,
        module: str,
        kind: str,
        *,
        step: int,
        slot: str = "0",
        call: int = 0,
        rank: int = 0,
        micro_step: int | None = None,
        phase: str | None = None,
    ) -> np.ndarray:
        """A saved full tensor, dtype kept exactly (bfloat16 as ``ml_dtypes.bfloat16``)."""
        row = self.record(
            module,
            kind,
            step=step,
            slot=slot,
            call=call,
            rank=rank,
            micro_step=micro_step,
            phase=phase,
        )
        if not row["tensor_key"]:
            raise TensorNotRecorded(
                f"the {kind} of {module!r} at step {step} has statistics only; record with "
                f"full tensors for it (full_steps=[{step}] or full_every=1, and full_modules "
                f"matching {module!r}) to save it"
            )
        return self._read_dataset(str(row["segment"]), str(row["tensor_key"]))

    def activity(
        self,
        module: str,
        kind: str = "output",
        *,
        step: int,
        slot: str = "0",
        call: int = 0,
        rank: int = 0,
    ) -> np.ndarray:
        """Per-unit positive counts of one record (each out of ``unit_size`` values)."""
        row = self.record(module, kind, step=step, slot=slot, call=call, rank=rank)
        if int(row["units"]) == 0:
            raise TensorNotRecorded(
                f"no per-unit activity was recorded for the {kind} of {module!r}"
            )
        return self.read_activity(row["segment"], [int(row["activity_offset"])], int(row["units"]))[
            0
        ]

    def read_activity(self, segment: str, offsets: Sequence[int], units: int) -> list[np.ndarray]:
        """Slices of one segment's activity array: for analyses that read many at once."""
        merged = self.activity_array(segment)
        return [merged[o : o + units] for o in offsets]

    def activity_array(self, segment: str) -> np.ndarray:
        """One segment's whole activity array (every record's counts, at its
        ``activity_offset``)."""
        return self._read_dataset(segment, "activity")

    # -- non-finite captures -----------------------------------------------------------------

    def nonfinite_captures(self, *, rank: int | None = None) -> pd.DataFrame:
        """One row per non-finite capture: where the first NaN or Inf of the run was caught
        (step, module, forward or backward pass), what triggered it, and what running the
        call again found: the aten operation (``op``), the autograd node in a backward
        (``node``), the model's source line (``file``, ``line``, ``code``) and whether the
        value ``reproduces`` standalone; ``explanation`` says it in one sentence. Empty
        when the run kept none (see the status's ``nonfinite_captures``)."""
        return capture_table(self.path, rank)

    def capture_info(self, capture: int, *, rank: int = 0) -> dict[str, Any]:
        """Everything one capture says of itself: the row of :meth:`nonfinite_captures` in
        full, with the call spec, the statistics of the operation's inputs
        (``analysis["op_inputs"]``) and the tensors left out (``left_out``)."""
        return read_meta(self._capture_path(capture, rank))

    def capture_tensors(self, capture: int, *, rank: int = 0) -> dict[str, dict[str, np.ndarray]]:
        """The tensors of one capture, by group (``inputs``, ``outputs``, ``grad_outputs``,
        ``state``) and by slot or parameter name, with their exact dtypes."""
        return read_tensors(self._capture_path(capture, rank))

    def _capture_path(self, capture: int, rank: int) -> Path:
        for _, index, path in capture_paths(self.path, rank):
            if index == capture:
                return path
        held = [index for _, index, _ in capture_paths(self.path, rank)]
        have = f"it holds {', '.join(map(str, held))}" if held else "it holds none"
        raise TensorNotRecorded(
            f"{self.path} has no non-finite capture {capture} on rank {rank} ({have}); "
            "`hooktrace replay RUN --nonfinite` lists them"
        )

    # -- presentation ------------------------------------------------------------------------

    def __repr__(self) -> str:
        # a trace of 10^8 records too: the steps and kinds are counted by DuckDB, reading two
        # columns, the records from the footers
        try:
            steps = self.sql(
                "SELECT min(step) AS lo, max(step) AS hi, count(DISTINCT step) AS n FROM records"
            )
            counted = self.sql("SELECT kind, count(*) AS n FROM records GROUP BY kind")
            lo, hi, n_steps = (steps[c].iloc[0] for c in ("lo", "hi", "n"))
            pairs = [(str(k), int(v)) for k, v in zip(counted["kind"], counted["n"], strict=True)]
        except TraceError:  # a part DuckDB cannot decode: hooktrace's reader leaves it out
            column = self.query(columns=["step", "kind"])
            lo, hi, n_steps = column["step"].min(), column["step"].max(), column["step"].nunique()
            pairs = [(str(k), int(v)) for k, v in column["kind"].astype(str).value_counts().items()]
        order = {k: i for i, k in enumerate(schema.KINDS)}
        kinds = dict(sorted(pairs, key=lambda kv: (-kv[1], order.get(kv[0], len(order)), kv[0])))
        span = f"steps {lo}–{hi} ({n_steps})" if n_steps else "no steps"
        lines = [
            f"Trace('{self.path}')",
            f"  status {self.status}, format {self.format_version}, ranks {self.ranks}",
            f"  {span}, {len(self.modules)} modules, {sum(kinds.values()):,} records",
            "  kinds: " + ", ".join(f"{k} {v:,}" for k, v in kinds.items()),
        ]
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} unreadable file(s): see .skipped")
        return "\n".join(lines)

    # -- internals ---------------------------------------------------------------------------

    def _leave_out(self, what: str | Path, why: BaseException | str) -> None:
        """Skip a damaged file (or a field of one): list it in ``skipped`` and warn."""
        name = _printable(what.relative_to(self.path) if isinstance(what, Path) else what)
        reason = why if isinstance(why, str) else _one_line(why)
        self.skipped.append(f"{name}: {reason}")
        warnings.warn(
            f"{_printable(self.path)}: left out {name}: {reason}", TraceWarning, stacklevel=4
        )

    def part_spans(self) -> pd.DataFrame:
        """One row per readable records part, from its footer: ``rank``, ``first`` and
        ``last`` step (from its row groups' statistics; -1 where they are missing) and
        ``records``. A part holds whole steps, so this maps steps to files without reading
        a record."""
        rows = []
        for part in self._parts[schema.RECORDS_DIR]:
            if part not in self._step_spans:
                self._step_spans[part] = _step_span(self._metadata[part])
            span = self._step_spans[part] or (-1, -1)
            rows.append((_rank_of(part), *span, self._metadata[part].num_rows))
        return pd.DataFrame(rows, columns=["rank", "first", "last", "records"], dtype="int64")

    def value_span(self, column: str) -> tuple[Any, Any] | None:
        """The smallest and largest value of a records column, from the row groups'
        statistics (nothing decoded); None where some row group has none. A part of an older
        minor version without the column counts as ""-valued (``note``) or unknown."""
        low: Any = None
        high: Any = None
        for part in self._parts[schema.RECORDS_DIR]:
            metadata = self._metadata[part]
            names = metadata.schema.names
            if column not in names:
                if column != "note":
                    return None
                spans = [("", "")]
            else:
                index = names.index(column)
                spans = []
                for i in range(metadata.num_row_groups):
                    stats = metadata.row_group(i).column(index).statistics
                    if stats is None or not stats.has_min_max:
                        return None
                    spans.append((stats.min, stats.max))
            for lo, hi in spans:
                low = lo if low is None else min(low, lo)
                high = hi if high is None else max(high, hi)
        return None if low is None else (low, high)

    def _parts_holding(
        self, first: int, last: int, kind_dir: str = schema.RECORDS_DIR
    ) -> list[Path]:
        """The parts (of records, or histograms) that may hold a step in ``first``-``last``,
        by the step statistics of their row groups: a window of steps opens a few files."""
        found = []
        for part in self._parts[kind_dir]:
            if part not in self._step_spans:
                self._step_spans[part] = _step_span(self._metadata[part])
            span = self._step_spans[part]
            if span is None or (span[0] <= last and first <= span[1]):
                found.append(part)
        return found

    def _discover(self, kind_dir: str) -> list[Path]:
        base = self.path / kind_dir
        if not base.is_dir():
            return []
        required = _REQUIRED[kind_dir]
        good: list[Path] = []
        checked: list[pq.ParquetSchema] = []  # the schemas found right: parts share a few
        for part in sorted(base.glob("rank=*/part-*.parquet")):
            try:
                _rank_of(part)
                if not _utf8(str(part)):
                    raise ValueError("the file name is not valid UTF-8")
                if not _regular(part):  # a directory, or a pipe that would block a read
                    raise ValueError("not a regular file")
                metadata = pq.read_metadata(part)
                missing = required - set(_columns(metadata))
                if missing:
                    raise ValueError(
                        f"not a hooktrace {kind_dir} part (no column {', '.join(sorted(missing))})"
                    )
                wrong = None
                if not any(metadata.schema.equals(known) for known in checked):
                    wrong = _wrong_types(metadata.schema.to_arrow_schema(), _SCHEMAS[kind_dir])
                    if not wrong:
                        checked.append(metadata.schema)
                if wrong:
                    raise ValueError(f"not a hooktrace {kind_dir} part ({wrong})")
            except (OSError, ValueError, pa.ArrowException) as exc:
                self._leave_out(part, exc)
                continue
            good.append(part)
            self._metadata[part] = metadata
        return good

    def _read(
        self,
        kind_dir: str,
        file_schema: pa.Schema,
        *,
        columns: list[str] | None = None,
        filter: Any = None,
        parts: list[Path] | None = None,
    ) -> pa.Table:
        full_schema = file_schema.append(schema.PARTITIONING.field("rank"))
        parts = self._parts[kind_dir] if parts is None else parts
        empty = full_schema.empty_table()
        empty = empty.select(columns) if columns else empty
        if not parts:
            return empty

        def read(paths: list[Path]) -> pa.Table:
            table = self._dataset(kind_dir, paths, full_schema).to_table(
                columns=columns, filter=filter
            )
            table.validate(full=True)  # names that are not UTF-8 would fail in to_pandas()
            return table

        try:
            return read(parts)
        except (OSError, pa.ArrowException):
            pass
        # a part is damaged inside (its footer was fine): read them one by one, and leave out
        # those that cannot be read in full; a failure of the question itself is an error
        tables = []
        for part in list(parts):
            try:
                tables.append(read([part]))
            except (OSError, pa.ArrowException) as exc:
                if not self._damaged(kind_dir, part, full_schema):
                    raise TraceError(
                        f"cannot read {kind_dir} of {self.path}: {_one_line(exc)}"
                    ) from exc
                self._drop(kind_dir, part, exc)
        return pa.concat_tables(tables) if tables else empty

    def _dataset(self, kind_dir: str, paths: list[Path], full_schema: pa.Schema) -> ds.Dataset:
        return ds.dataset(
            [str(p) for p in paths],
            schema=full_schema,
            format=_PARQUET,
            partitioning=ds.partitioning(schema.PARTITIONING, flavor="hive"),
            partition_base_dir=str(self.path / kind_dir),
        )

    def _damaged(self, kind_dir: str, part: Path, full_schema: pa.Schema) -> bool:
        """True when ``part`` cannot be read in full, as hooktrace's schema, on its own."""
        try:
            self._dataset(kind_dir, [part], full_schema).to_table().validate(full=True)
        except (OSError, pa.ArrowException):
            return True
        return False

    def _drop(self, kind_dir: str, part: Path, why: BaseException | str) -> None:
        """Leave a damaged part out of every later read (``hooktrace check`` finds them)."""
        self._parts[kind_dir].remove(part)
        self._leave_out(part, why)

    def _segment_path(self, segment: str) -> Path:
        path = (self.path / segment).resolve()
        if not path.is_relative_to(self.path.resolve()):
            raise TraceError(f"refusing to read {segment!r}: it points outside the run directory")
        if not path.exists():
            raise TraceError(
                f"segment {segment} is missing from {self.path}: run `hooktrace check`"
            )
        if not _regular(path):
            raise TraceError(f"segment {segment} of {self.path} is not a regular file")
        return path

    def _read_dataset(self, segment: str, key: str) -> np.ndarray:
        """One full tensor of a segment; a damaged segment or an altered dataset is a TraceError."""
        path = self._segment_path(segment)
        try:
            with h5py.File(path, "r") as f:
                return decode_dataset(f[key], f"{segment}:{key}")
        except TraceError:
            raise
        except (OSError, KeyError, ValueError, TypeError, RuntimeError, AttributeError) as exc:
            raise TraceError(
                f"cannot read {key} from segment {segment} of {self.path} ({_one_line(exc)}): "
                "run `hooktrace check` to see what is damaged"
            ) from exc

    def _what_exists(self, module: str, kind: str, rank: int) -> str:
        rows = self.query(
            columns=["step", "module", "kind", "slot"], modules=[module], ranks=[rank]
        )
        if rows.empty:
            names = self.query(columns=["module"], ranks=[rank])["module"].astype(str).unique()[:8]
            return f"the trace has no module {module!r} (modules include: {', '.join(names)})"
        of_kind = rows[rows["kind"].astype(str) == kind]
        if of_kind.empty:
            kinds = sorted(rows["kind"].astype(str).unique())
            return f"{module!r} has kinds {', '.join(kinds)}"
        steps = of_kind["step"]
        slots = sorted(of_kind["slot"].astype(str).unique())
        return f"it has steps {steps.min()}–{steps.max()} and slots {', '.join(slots)}"


def in_order(frame: pd.DataFrame, columns: list[str]) -> bool:
    """Whether the rows are sorted by ``columns`` already (as a part written in (step, seq)
    order reads back): sorting them again is most of a window's read."""
    if len(frame) < 2:
        return True
    keys = [frame[c].to_numpy() for c in columns]
    ahead = np.zeros(len(frame) - 1, dtype=bool)  # decided: this row is before the next
    for key in keys:
        before, after = key[:-1], key[1:]
        if ((before > after) & ~ahead).any():
            return False
        ahead |= before < after
    return True


def _steps(
    steps: Iterable[int] | tuple[int, int] | None,
) -> list[int] | tuple[int, int] | None:
    """``steps`` as a list, unless a (first, last) range or None: a generator is read once."""
    if steps is None or (isinstance(steps, tuple) and len(steps) == 2):
        return steps
    return [int(s) for s in steps]


def _filter(
    *,
    steps: Iterable[int] | tuple[int, int] | None = None,
    modules: Iterable[str] | None = None,
    kinds: Iterable[str] | None = None,
    ranks: Iterable[int] | None = None,
    phases: Iterable[str] | None = None,
) -> Any:
    """A dataset filter for every condition given (None: no condition)."""
    conditions = []
    if isinstance(steps, tuple) and len(steps) == 2:
        conditions.append((pc.field("step") >= steps[0]) & (pc.field("step") <= steps[1]))
    elif steps is not None:  # value sets typed: an empty one is then no row, not an error
        chosen = pa.array([int(s) for s in steps], pa.int64())
        conditions.append(pc.field("step").isin(chosen))
    for name, values in (("module", modules), ("kind", kinds), ("phase", phases)):
        if values is not None:
            value_set = pa.array([str(v) for v in values], pa.string())
            conditions.append(pc.field(name).cast(pa.string()).isin(value_set))
    if ranks is not None:
        conditions.append(pc.field("rank").isin(pa.array([int(r) for r in ranks], pa.int32())))
    expr = None
    for condition in conditions:
        expr = condition if expr is None else expr & condition
    return expr


def _span(steps: Iterable[int] | tuple[int, int] | None) -> tuple[int, int] | None:
    """The steps' first and last, to pick the parts that may hold them (None: all)."""
    if steps is None:
        return None
    if isinstance(steps, tuple) and len(steps) == 2:
        return int(steps[0]), int(steps[1])
    chosen = [int(s) for s in steps]
    return (min(chosen), max(chosen)) if chosen else (1, 0)


def _columns(metadata: pq.FileMetaData) -> list[str]:
    """The part's columns by name (a list column's one, not its leaf's ``element``)."""
    return [metadata.schema.column(i).path.split(".")[0] for i in range(metadata.num_columns)]


def _wrong_types(found: pa.Schema, expected: pa.Schema) -> str | None:
    """Which column of a part holds values of another kind than the format says (text where
    numbers belong, ...), if any: such a part is not read (and ``hooktrace check`` says so)."""
    for field in expected:
        if field.name not in found.names:
            continue  # an older minor version: read as null
        have, want = found.field(field.name).type, field.type
        if _family(have) != _family(want):
            return f"column {field.name} is {have}, not {want}"
    return None


def _family(arrow_type: pa.DataType) -> str:
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return f"list of {_family(arrow_type.value_type)}"
    for name, test in (
        ("integer", pa.types.is_integer),
        ("float", pa.types.is_floating),
        ("bool", pa.types.is_boolean),
        ("string", lambda t: pa.types.is_string(t) or pa.types.is_large_string(t)),
    ):
        if test(arrow_type):
            return name
    return str(arrow_type)


def _step_span(metadata: pq.FileMetaData) -> tuple[int, int] | None:
    """The smallest and largest step of a part, from its row groups' statistics;
    None when a row group has none (then the part is always read)."""
    try:
        column = metadata.schema.names.index("step")
    except ValueError:
        return None
    lows, highs = [], []
    for i in range(metadata.num_row_groups):
        stats = metadata.row_group(i).column(column).statistics
        if stats is None or not stats.has_min_max:
            return None
        lows.append(int(stats.min))
        highs.append(int(stats.max))
    return (min(lows), max(highs)) if lows else (1, 0)


# A part without these is not hooktrace's (other columns may be missing from files of an
# older minor version: they read as null)
def _no_notes(notes: pd.Series) -> pd.Series:
    """Notes with "" where a trace written before format 1.1 has none."""
    if isinstance(notes.dtype, pd.CategoricalDtype):
        if "" not in notes.cat.categories:
            notes = notes.cat.add_categories([""])
        return notes.fillna("")
    return notes.fillna("")


_SCHEMAS = {
    schema.RECORDS_DIR: schema.RECORD_SCHEMA,
    schema.STEPS_DIR: schema.STEP_SCHEMA,
    schema.MODULES_DIR: schema.MODULE_SCHEMA,
    histograms.HISTOGRAMS_DIR: histograms.HISTOGRAM_SCHEMA,
}

_REQUIRED = {
    schema.RECORDS_DIR: {"step", "seq", "module", "kind", "slot"},
    schema.STEPS_DIR: {"step"},
    schema.MODULES_DIR: {"module"},
    histograms.HISTOGRAMS_DIR: {"step", "seq", "module", "kind", "pos", "neg"},
}


LeaveOut = Callable[[str | Path, BaseException | str], None]


def _read_manifest(path: Path, leave_out: LeaveOut) -> dict[str, Any]:
    if not path.exists():
        raise TraceNotFound(
            f"{path.parent} is not a hooktrace run (no {schema.MANIFEST}): give a directory "
            "that `hooktrace record` or hooktrace.record() wrote"
        )
    try:
        if not _regular(path):
            raise OSError(f"{schema.MANIFEST} is not a regular file")
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise TraceError(
            f"{path} is unreadable ({_one_line(exc)}): the trace's manifest is damaged"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != schema.FORMAT_NAME:
        raise TraceError(
            f"{path} is not a hooktrace manifest: give a run directory hooktrace wrote"
        )
    try:
        major, _ = schema.parse_version(str(manifest["format_version"]))
    except (KeyError, ValueError) as exc:
        raise TraceError(f"{path} has no valid format_version: the manifest is damaged") from exc
    ours, _ = schema.parse_version(schema.FORMAT_VERSION)
    if major > ours:
        raise FormatVersionError(
            f"{path.parent} has trace format {manifest['format_version']}, newer than this "
            f"hooktrace reads ({schema.FORMAT_VERSION}): upgrade hooktrace"
        )
    if major < ours:
        raise FormatVersionError(
            f"{path.parent} has trace format {manifest['format_version']}, older than this "
            f"hooktrace reads ({schema.FORMAT_VERSION}): read it with an older hooktrace"
        )
    return _valid_fields(manifest, _MANIFEST_FIELDS, schema.MANIFEST, leave_out)


def _read_statuses(directory: Path, leave_out: LeaveOut) -> dict[int, dict[str, Any]]:
    statuses: dict[int, dict[str, Any]] = {}
    if not directory.is_dir():
        return statuses
    for path in sorted(directory.glob("rank=*.json")):
        try:
            rank = _rank_of(path)
            if not _regular(path):
                raise ValueError("not a regular file")
            payload = json.loads(path.read_bytes())
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            leave_out(path, exc)
            continue
        where = f"{schema.STATUS_DIR}/{path.name}"
        statuses[rank] = _valid_fields(payload, _STATUS_FIELDS, where, leave_out)
        if statuses[rank].get("status") not in schema.STATUSES:
            leave_out(where, f"unknown status {payload.get('status')!r}: read as incomplete")
            statuses[rank]["status"] = schema.STATUS_INCOMPLETE
    return statuses


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _optional(check: Any) -> Any:
    return lambda value: value is None or check(value)


# field -> (what it must be, test): fields that fail are left out with a warning, so that one
# damaged value neither stops the reading nor reaches an analysis as the wrong type
_MANIFEST_FIELDS = {
    "world_size": ("a positive integer", lambda v: _count(v) and v > 0),
    "start_time": ("a number", _number),
    "command": ("a list of strings", _strings),
    "roots": ("a list of strings", _strings),
    "config": ("an object", lambda v: isinstance(v, dict)),
    **{
        key: ("a string", lambda v: isinstance(v, str))
        for key in ("hooktrace_version", "torch_version", "python_version", "platform")
    },
}
_STATUS_FIELDS = {  # "status" itself is checked against schema.STATUSES
    "error": ("a string or null", _optional(lambda v: isinstance(v, str))),
    "start_time": ("a number", _optional(_number)),
    "end_time": ("a number or null", _optional(_number)),
    "writer_blocked_seconds": ("a number", _number),
    "stats_route": ("a string", lambda v: isinstance(v, str)),
    "stats_warmup_seconds": ("a number", _number),
    **{
        key: ("a count", _count)
        for key in ("steps_written", "records_written", "tensors_written", "steps_lost")
    },
}


def _valid_fields(
    payload: dict[str, Any], fields: dict[str, Any], where: str, leave_out: LeaveOut
) -> dict[str, Any]:
    valid = dict(payload)
    for key, (meaning, test) in fields.items():
        if key in valid and not test(valid[key]):
            leave_out(where, f"{key} is not {meaning} (got {_short(valid.pop(key))}): ignored")
    return valid


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _rank_of(path: Path) -> int:
    for part in reversed(path.parts):
        if part.startswith("rank="):
            text = part.partition("=")[2].removesuffix(".json")
            if not (text.isascii() and text.isdigit()):
                raise ValueError(f"{part} is not rank=R with R a number")
            rank = int(text)
            if not 0 <= rank <= _MAX_RANK:
                raise ValueError(f"rank {rank} is out of range")
            return rank
    raise ValueError(f"{path} is not under a rank=R directory")


def _regular(path: Path) -> bool:
    """A regular file (symbolic links followed): not a directory, a pipe or a device."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a name decoded with surrogateescape
        return False
    return True


def _printable(path: str | os.PathLike[str]) -> str:
    """A path that prints anywhere: bytes that are not UTF-8 shown as \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
