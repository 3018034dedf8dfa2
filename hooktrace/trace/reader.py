"""Reading traces into pandas: :func:`load` and :class:`Trace`. Never imports torch.

Filters are pushed down to pyarrow, so a question reads only the columns and row groups it
needs. Part files that cannot be read are skipped and listed in ``Trace.skipped``, with a
:class:`TraceWarning` each; they never make the rest of a trace unreadable. Nothing here
unpickles: JSON, Parquet read against hooktrace's own schema, and numeric HDF5 datasets only.

Over 400 lines because ``Trace`` is the one object a notebook meets, and its public methods
are kept together: each is a docstring and a few lines over the modules that do the work
(``manifest`` the JSON, ``footers`` the parts, ``filters`` and ``tables`` the reading,
``tensors`` and ``captures`` the HDF5, ``sql``, ``timeline``).
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hooktrace.errors import (
    TensorNotRecorded,
    TraceError,
    TraceNotFound,
    TraceTooLarge,
    TraceWarning,
)
from hooktrace.trace import footers, histograms, schema, tables, timeline
from hooktrace.trace.captures import capture_path, capture_table, read_meta, read_tensors
from hooktrace.trace.filters import in_order, row_filter, step_range, steps_given
from hooktrace.trace.manifest import read_manifest, read_statuses
from hooktrace.trace.paths import one_line, printable, rank_of, utf8
from hooktrace.trace.stream import RecordStream
from hooktrace.trace.tensors import decode_dataset, read_dataset

__all__ = ["MAX_RECORDS", "Trace", "decode_dataset", "in_order", "load", "records_frame"]
# decode_dataset and in_order live in tensors.py and filters.py; imported from here too

MAX_RECORDS = 4_000_000
"""How many records ``Trace.records`` loads at most, by default: about 1.7 GB at its peak
(some 400 bytes a record while pyarrow's table and pandas' frame both exist), within the
2 GB the analyzer keeps to. Past it, ``records`` raises :class:`TraceTooLarge`, which shows the
filtered ways (:meth:`Trace.query`, :meth:`Trace.sql`)."""


_DROPPING = threading.Lock()
"""Held while a damaged part is left out, or asked about: the two streams of a diff of a
trace with itself read it in two threads, and may find the same part damaged at once."""


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
        if not utf8(str(self.path.resolve())):
            raise TraceError(
                f"{printable(self.path)}: the path is not valid UTF-8, which Parquet readers "
                "need: rename the run directory (or a directory above it)"
            )
        manifest_path = self.path / schema.MANIFEST
        self.skipped: list[str] = []
        """Files that could not be read and were left out, each with the reason."""
        self._manifest = read_manifest(manifest_path, self._leave_out)
        self._status = read_statuses(self.path / schema.STATUS_DIR, self._leave_out)
        self._metadata: dict[Path, pq.FileMetaData] = {}
        self._parts: dict[str, list[Path]] = {}
        for name in footers.TABLES:
            found = footers.discover(self.path, name, self._leave_out)
            self._metadata.update(found)
            self._parts[name] = list(found)
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
        found = {rank_of(p) for kind_parts in self._parts.values() for p in kind_parts}
        return sorted(found | set(self._status))

    @property
    def layout(self) -> dict[int, int] | None:
        """Each rank's data-parallel rank (ranks of one hold the same part of the global
        batch), where every rank's final status says it (``data_parallel``, since 1.4: from
        DDP or FSDP2); None where one does not: the logical view then judges from the
        records (:mod:`hooktrace.trace.logical`)."""
        places = {rank: status.get("data_parallel") for rank, status in self._status.items()}
        layout = {rank: int(place["rank"]) for rank, place in places.items() if place is not None}
        return layout if layout and len(layout) == len(places) == len(self.ranks) else None

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
                f"{printable(self.path)} holds {count:,} records, more than trace.records loads "
                f"into memory (max_records={self.max_records:,}; some 400 bytes a record in "
                "pandas): read the part you need, e.g. trace.query(steps=(0, 99), "
                "modules=['encoder.0.fc'], kinds=['grad_param'], columns=['step', 'module', "
                "'norm']), or ask in SQL: trace.sql(\"SELECT module, max(norm) FROM records "
                "WHERE kind = 'grad_param' GROUP BY module\") (of a run of several ranks, "
                "FROM rank_records asks each rank's records, without merging them); or load "
                "it all anyway with hooktrace.load(run, max_records=None)"
            )
        return self.query(logical=False)

    def sql(self, query: str, parameters: Sequence[Any] | None = None) -> pd.DataFrame:
        """The answer of a DuckDB ``query`` over this trace, as a DataFrame.

        The tables are ``records``, ``steps``, ``modules`` and ``histograms`` (with ``rank``), as
        docs/FORMAT.md describes them; DuckDB reads only the columns and row groups the query
        needs, on every core, spilling to disk past its memory limit::

            trace.sql("SELECT module, max(norm) AS norm FROM records "
                      "WHERE kind = 'grad_param' GROUP BY module ORDER BY norm DESC")

        A run of several ranks is answered as :meth:`query` answers: ``records`` holds its
        logical records (with ``ranks``, ``dp`` and ``merged``), ``histograms`` their
        histograms; ``rank_records``, ``rank_histograms`` and ``rank_histogram_spans`` hold
        each rank's, as written (:mod:`hooktrace.trace.sql`).

        ``parameters`` fill the query's ``?`` or ``$1`` placeholders. A query DuckDB refuses
        (a syntax error, an unknown column) raises :class:`TraceError` with DuckDB's reason.
        """
        import duckdb

        if not isinstance(query, str) or not query.strip():
            raise TraceError(
                f"trace.sql() takes a query as a string, not {query!r}: for example "
                "trace.sql('SELECT count(*) FROM records')"
            )
        try:
            answer = self._duckdb().execute(query, parameters)
        except duckdb.Error as exc:
            raise TraceError(
                f"the query over {printable(self.path)} failed: {one_line(exc)} (tables: "
                "records, steps, modules, histograms, histogram_spans, and each rank's "
                "rank_records, rank_histograms, rank_histogram_spans; columns as in "
                "docs/FORMAT.md)"
            ) from exc
        if answer is None or answer.description is None:  # no statement (a comment), or none
            # that answers with a table
            raise TraceError(f"trace.sql({query!r}) returns no table: ask with a SELECT")
        return answer.df()

    def _duckdb(self) -> Any:
        """The DuckDB connection, its views over the parts readable now."""
        from hooktrace.trace import sql

        columns = {
            name: {c for p in kind_parts for c in footers.columns(self._metadata[p])}
            for name, kind_parts in self._parts.items()
        }
        if self._sql is None:
            self._sql = sql.connect(
                self._parts, columns, self.layout, logical_default=self.logical_by_default()
            )
        elif self._sql_parts != self._parts:  # a part found damaged since: left out
            sql.define_views(
                self._sql, self._parts, columns, self.layout,
                logical_default=self.logical_by_default(),
            )  # fmt: skip
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
        logical: bool | None = None,
    ) -> pd.DataFrame:
        """Records matching every filter given, reading only what is needed.

        ``steps`` is either an iterable of step numbers or an inclusive ``(first, last)``
        range given as a tuple of two ints. Rows come in (rank, step, seq) order (logical
        records in (step, seq, rank) order).

        A run of several ranks is answered with its logical tensors (shards pooled,
        replicas once, data-parallel activations pooled into the global batch:
        :mod:`hooktrace.trace.logical`), in (step, seq) order, with the columns ``ranks``,
        ``dp`` and ``merged`` besides (the SQL view ``logical_records`` is the same), unless
        ``ranks`` chooses some or ``logical=False``: then each rank's records, as written
        (:attr:`records` holds them all).
        """
        if logical is None:
            logical = self.logical_by_default(ranks)
        if not logical:
            return records_frame(
                self.query_table(
                    columns=columns, steps=steps, modules=modules, kinds=kinds, ranks=ranks,
                    phases=phases,
                )
            )  # fmt: skip
        from hooktrace.trace.logical import ADDED, NEEDED
        from hooktrace.trace.logical_arrays import logical_table

        asked = [c for c in (columns or ["rank", *schema.RECORD_SCHEMA.names]) if c not in ADDED]
        read = [*asked, *(c for c in NEEDED if c not in asked)]
        table = self.query_table(
            columns=read, steps=steps, modules=modules, kinds=kinds, ranks=ranks, phases=phases
        )
        frame = records_frame(logical_table(table, self.layout).select([*asked, *ADDED]))
        order = [c for c in ("step", "seq", "rank") if c in frame.columns]
        return frame.sort_values(order, kind="stable").reset_index(drop=True) if order else frame

    def query_table(
        self,
        *,
        columns: Sequence[str] | None = None,
        steps: Iterable[int] | tuple[int, int] | None = None,
        modules: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        phases: Iterable[str] | None = None,
    ) -> pa.Table:
        """The records :meth:`query` returns, as the pyarrow Table read, in the order the
        parts hold them (part by part, in the order of their paths; each in (step, seq)
        order): for a question that needs no pandas for most rows. :func:`records_frame`
        makes it :meth:`query`'s frame."""
        steps = steps_given(steps)
        expr = row_filter(steps=steps, modules=modules, kinds=kinds, ranks=ranks, phases=phases)
        span = step_range(steps)
        wanted = None if columns is None else _known(columns)
        return self._read(
            schema.RECORDS_DIR, schema.RECORD_SCHEMA, columns=wanted, filter=expr,
            parts=None if span is None else self._parts_holding(*span),
        )  # fmt: skip

    def stream(
        self,
        *,
        columns: Sequence[str],
        steps: Iterable[int] | tuple[int, int] | None = None,
        modules: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        phases: Iterable[str] | None = None,
    ) -> RecordStream:
        """The records :meth:`query_table` would return, handed out a window of steps at a
        time by :meth:`RecordStream.through`, each row group read once: for a pass over a
        whole trace. Filters as :meth:`query` takes them."""
        steps = steps_given(steps)
        ranks = None if ranks is None else [int(r) for r in ranks]
        # a (first, last) range is kept by the stream, which cuts only the row groups that
        # cross it: a filter would copy every row group to keep all its rows
        chosen = None if isinstance(steps, tuple) else steps
        expr = row_filter(steps=chosen, modules=modules, kinds=kinds, ranks=ranks, phases=phases)
        span = step_range(steps)
        columns = _known(columns)
        parts = self._parts[schema.RECORDS_DIR] if span is None else self._parts_holding(*span)
        if ranks is not None:
            parts = [p for p in parts if rank_of(p) in ranks]
        given = {"step": chosen, "module": modules, "kind": kinds, "rank": ranks, "phase": phases}
        filtered = [name for name, value in given.items() if value is not None]
        return RecordStream(self, columns, expr, list(parts), span, filtered, chosen)

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
        logical: bool | None = None,
    ) -> pd.DataFrame:
        """The histograms matching every filter given (as :meth:`query` takes them), one row
        per histogrammed record in (rank, step, seq) order: ``rank``, ``step``, ``seq``,
        ``module``, ``kind``, ``slot``, ``numel``, the ``zero``, ``nan``, ``pos_inf`` and
        ``neg_inf`` counts, and ``pos`` and ``neg``, each a numpy array of
        ``MAGNITUDE_BINS`` counts by binary exponent (docs/FORMAT.md, "histograms";
        :func:`hooktrace.trace.histograms.exponents` gives each bin's exponent).

        A run of several ranks is answered as :meth:`query` answers (unless ``ranks``
        chooses some or ``logical=False``): one row per logical record (its rank and seq, as
        :meth:`query` gives them), the sum of its parts' histograms (a replica once:
        :func:`hooktrace.trace.sql.logical_spans`).

        Raises :class:`TraceError` when the trace holds no histograms at all."""
        if not self.has_histograms:
            raise TraceError(
                f"{printable(self.path)} holds no histograms: {self.no_histograms_because}"
            )
        if logical is None:
            logical = self.logical_by_default(ranks)
        if logical:
            return self._logical_histograms(steps_given(steps), modules, kinds, ranks)
        steps = steps_given(steps)
        span = step_range(steps)
        expr = row_filter(steps=steps, modules=modules, kinds=kinds, ranks=ranks)
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

    def logical_by_default(self, ranks: Iterable[int] | None = None) -> bool:
        """Whether the analyzer answers about this run's logical tensors unless told
        otherwise: a run of several ranks, no ``ranks`` chosen."""
        return ranks is None and len(self.ranks) > 1

    def _logical_histograms(
        self,
        steps: list[int] | tuple[int, int] | None,
        modules: Iterable[str] | None,
        kinds: Iterable[str] | None,
        ranks: Iterable[int] | None,
    ) -> pd.DataFrame:
        """:meth:`histograms` with ``logical``: the parts summed, whole rows (of ``ranks``'
        records only, where given, as :meth:`query` pools them)."""
        from hooktrace.trace.sql import logical_spans
        from hooktrace.trace.tables import arrow_of

        clauses: list[str] = []
        values: list[Any] = []
        if isinstance(steps, tuple):
            clauses.append("step BETWEEN ? AND ?")
            values += [int(steps[0]), int(steps[1])]
        elif steps is not None:
            clauses.append("list_contains(?::BIGINT[], step)")
            values.append([int(s) for s in steps])
        for column, chosen in (("module", modules), ("kind", kinds)):
            if chosen is not None:
                clauses.append(f"list_contains(?::VARCHAR[], {column})")
                values.append([str(c) for c in chosen])
        if ranks is not None:
            clauses.append("list_contains(?::INTEGER[], rank)")
            values.append([int(r) for r in ranks])
        where = f"WHERE {' AND '.join(clauses)}" if clauses else ""
        source = logical_spans(where, self.layout)
        query = (
            "SELECT rank, step, seq, module::VARCHAR AS module, kind::VARCHAR AS kind, "
            "slot::VARCHAR AS slot, numel, zero, nan, pos_inf, neg_inf, pos_start, pos, "
            f"neg_start, neg FROM {source} AS parts_ ORDER BY rank, step, seq"
        )
        import duckdb

        try:
            table = arrow_of(self._duckdb().sql(query, params=values))
        except duckdb.Error as exc:
            raise TraceError(
                f"the histograms of {printable(self.path)} could not be read as logical "
                f"tensors: {one_line(exc)}; read them rank by rank (logical=False)"
            ) from exc
        key = ["rank", "step", "seq"]
        frame = table.select([*key, "module", "kind", "slot"]).to_pandas()
        first = np.r_[True, (frame[key].to_numpy()[1:] != frame[key].to_numpy()[:-1]).any(axis=1)]
        at = np.flatnonzero(first)  # each logical record's first part: its parts follow it
        out = frame.iloc[at].reset_index(drop=True)
        for name in ("numel", "zero", "nan", "pos_inf", "neg_inf"):
            column = table.column(name).to_numpy().astype(np.int64)
            out[name] = np.add.reduceat(column, at) if len(at) else column[:0]
        for sign in ("pos", "neg"):
            rows = histograms.whole(table.column(f"{sign}_start").to_numpy(), table.column(sign))
            summed = np.add.reduceat(rows, at, axis=0) if len(at) else rows
            out[sign] = list(summed)
        for name in ("module", "kind", "slot"):  # as the per-rank histograms have them
            out[name] = out[name].astype("category")
        return out

    def damaged(self, kind_dir: str) -> list[str]:
        """The parts of ``kind_dir`` (``records``, ``histograms``, ...) left out as damaged,
        each with why (as :attr:`skipped` lists them)."""
        return [entry for entry in self.skipped if entry.startswith(f"{kind_dir}/")]

    @property
    def no_histograms_because(self) -> str:
        """Why the trace holds no histograms, and how to record them, in a clause (where it
        does hold some, what was asked for)."""
        kinds = self.manifest.get("config", {}).get("histograms")
        how = "record with `hooktrace record --histograms param,grad_param`"
        damaged = self.damaged(histograms.HISTOGRAMS_DIR)
        if damaged:
            return (
                f"its {len(damaged)} histograms part(s) are damaged, left out: "
                f"`hooktrace check {printable(self.path)}` says what was lost"
            )
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
        """The single record that matches, as ``rank`` wrote it; raises TensorNotRecorded,
        saying what exists. Of a sharded tensor (FSDP2, tensor parallel), the rank's own
        shard: its ``logical_shape``, ``placements`` and ``shard_offset`` say where it lies in
        the whole, and :meth:`query` merges the ranks' shards into logical records."""
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
        """A saved full tensor, dtype kept exactly (bfloat16 as ``ml_dtypes.bfloat16``), as
        ``rank`` saved it: of a sharded tensor, that rank's shard (:meth:`record` says where
        it lies)."""
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
        return read_dataset(self.path, str(row["segment"]), str(row["tensor_key"]))

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
        return read_dataset(self.path, segment, "activity")

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
        return read_meta(capture_path(self.path, capture, rank))

    def capture_tensors(self, capture: int, *, rank: int = 0) -> dict[str, dict[str, np.ndarray]]:
        """The tensors of one capture, by group (``inputs``, ``outputs``, ``grad_outputs``,
        ``state``) and by slot or parameter name, with their exact dtypes."""
        return read_tensors(capture_path(self.path, capture, rank))

    # -- presentation ------------------------------------------------------------------------

    def __repr__(self) -> str:
        # a trace of 10^8 records too: the steps and kinds are counted by DuckDB, reading two
        # columns, the records from the footers
        try:
            steps = self.sql(
                "SELECT min(step) AS lo, max(step) AS hi, count(DISTINCT step) AS n "
                "FROM rank_records"
            )
            counted = self.sql("SELECT kind, count(*) AS n FROM rank_records GROUP BY kind")
            lo, hi, n_steps = (steps[c].iloc[0] for c in ("lo", "hi", "n"))
            pairs = [(str(k), int(v)) for k, v in zip(counted["kind"], counted["n"], strict=True)]
        except TraceError:  # a part DuckDB cannot decode: hooktrace's reader leaves it out
            column = self.query(columns=["step", "kind"], logical=False)
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
        name = printable(what.relative_to(self.path) if isinstance(what, Path) else what)
        reason = why if isinstance(why, str) else one_line(why)
        self.skipped.append(f"{name}: {reason}")
        warnings.warn(
            f"{printable(self.path)}: left out {name}: {reason}", TraceWarning, stacklevel=4
        )

    def part_spans(self) -> pd.DataFrame:
        """One row per readable records part, from its footer: ``rank``, ``first`` and
        ``last`` step (from its row groups' statistics; -1 where they are missing) and
        ``records``. A part holds whole steps, so this maps steps to files without reading
        a record."""
        rows = []
        for part in self._parts[schema.RECORDS_DIR]:
            span = self._step_span(part) or (-1, -1)
            rows.append((rank_of(part), *span, self._metadata[part].num_rows))
        return pd.DataFrame(rows, columns=["rank", "first", "last", "records"], dtype="int64")

    def value_span(self, column: str) -> tuple[Any, Any] | None:
        """The smallest and largest value of a records column, from the row groups'
        statistics (nothing decoded); None where some row group has none. A part of an older
        minor version without the column counts as ""-valued (``note``) or unknown."""
        records = [self._metadata[p] for p in self._parts[schema.RECORDS_DIR]]
        return footers.value_span(records, column)

    def _parts_holding(
        self, first: int, last: int, kind_dir: str = schema.RECORDS_DIR
    ) -> list[Path]:
        """The parts (of records, or histograms) that may hold a step in ``first``-``last``,
        by the step statistics of their row groups: a window of steps opens a few files."""
        found = []
        for part in self._parts[kind_dir]:
            span = self._step_span(part)
            if span is None or (span[0] <= last and first <= span[1]):
                found.append(part)
        return found

    def _step_span(self, part: Path) -> tuple[int, int] | None:
        """The part's first and last step, from its footer (read once)."""
        if part not in self._step_spans:
            self._step_spans[part] = footers.step_span(self._metadata[part])
        return self._step_spans[part]

    def _read(
        self,
        kind_dir: str,
        file_schema: pa.Schema,
        *,
        columns: list[str] | None = None,
        filter: Any = None,
        parts: list[Path] | None = None,
    ) -> pa.Table:
        """One table's rows (of ``parts``, else all its readable parts) as pyarrow reads
        them; a part found damaged on the way is dropped from every later read."""
        return tables.read_table(
            self.path, kind_dir, file_schema, self._parts[kind_dir] if parts is None else parts,
            columns=columns, filter=filter, drop=functools.partial(self._drop, kind_dir),
        )  # fmt: skip

    def _holds(self, kind_dir: str, part: Path) -> bool:
        """Whether ``part`` is still read (not left out), asked as another thread may be
        leaving a part out: a list that shrinks under a scan of it can skip the part."""
        with _DROPPING:
            return part in self._parts[kind_dir]

    def _drop(self, kind_dir: str, part: Path, why: BaseException | str) -> None:
        """Leave a damaged part out of every later read (``hooktrace check`` finds them);
        once, whoever finds it first."""
        with _DROPPING:
            if part not in self._parts[kind_dir]:
                return
            self._parts[kind_dir].remove(part)
        self._leave_out(part, why)

    def _what_exists(self, module: str, kind: str, rank: int) -> str:
        if rank not in self.ranks:
            return f"the trace has no rank {rank} (ranks: {', '.join(map(str, self.ranks))})"
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


def _known(columns: Sequence[str]) -> list[str]:
    """Record columns, each once (a lone name is one column, not its letters); a TraceError
    names any that records do not have."""
    wanted = list(dict.fromkeys([columns] if isinstance(columns, str) else columns))
    unknown = set(wanted) - set(schema.RECORD_SCHEMA.names) - {"rank"}
    if unknown:
        raise TraceError(
            f"unknown record column(s) {sorted(unknown)}: choose from "
            f"{', '.join(['rank', *schema.RECORD_SCHEMA.names])}"
        )
    return wanted


def records_frame(table: pa.Table) -> pd.DataFrame:
    """Records read as a pyarrow Table (:meth:`Trace.query_table`) as :meth:`Trace.query`
    returns them: a DataFrame in (rank, step, seq) order, notes "" where a 1.0 trace has none."""
    frame = table.to_pandas()
    for name in schema.EMPTY_WHEN_ABSENT:  # an older trace's parts lack them: ""
        if name in frame.columns and frame[name].hasnans:
            frame[name] = _no_notes(frame[name])
    order = [c for c in ("rank", "step", "seq") if c in frame.columns]
    if order and not in_order(frame, order):
        frame = frame.sort_values(order, kind="stable").reset_index(drop=True)
    return frame


def _no_notes(notes: pd.Series) -> pd.Series:
    """Notes (or shard columns) with "" where a trace written before format 1.1 (1.4) has
    none."""
    if isinstance(notes.dtype, pd.CategoricalDtype):
        if "" not in notes.cat.categories:
            notes = notes.cat.add_categories([""])
        return notes.fillna("")
    return notes.fillna("")
