"""A trace's records handed out in step order, each row group read once: what a pass over a
whole trace a few steps at a time reads (``hooktrace diff``). Never imports torch.

:meth:`Trace.query_table` with a step range reads every row group that holds a step of the
range; a row group holding steps on both sides of where one window ends and the next begins
is then read twice, a quarter more reading for windows of four row groups. Here each rank's
row groups are read in order, whole, and what a window has not asked for yet is kept for the
next (``through(step)``): at most one row group a rank is held between windows. A rank's row
groups are read in the order of their first step, whatever the parts' names say.

Where a row group's statistics show the columns that say where full tensors live
(``segment``, ``tensor_key``) to hold one value (a part's one segment; no full tensor, "")
they are made from it, not decoded: an eighth of the reading, on runs that save no full
tensors. Only those two: footers carry no checksum, and a flipped bit there could at worst
make a row group's full tensors be compared by their statistics, never change a value.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hooktrace.errors import TraceError
from hooktrace.trace import schema, tables
from hooktrace.trace.paths import one_line, rank_of


class Parts(Protocol):
    """What a stream asks of the :class:`~hooktrace.trace.reader.Trace` it reads (which
    imports this module): the run's directory, the parts' footers, which parts are still read,
    and where to leave a damaged one out."""

    path: Path
    _metadata: dict[Path, pq.FileMetaData]

    def _holds(self, kind_dir: str, part: Path) -> bool: ...

    def _drop(self, kind_dir: str, part: Path, why: BaseException | str) -> None: ...


@dataclass(frozen=True)
class _Group:
    part: Path
    index: int
    first: float  # its smallest and largest step (-inf, inf where the footer does not say)
    last: float
    constant: dict[str, Any]  # the columns that hold one value in it, and the value


class RecordStream:
    """The records of ``trace`` in ``span`` (None: all steps) matching ``filter`` (a dataset
    expression over the columns ``filtered``, or None), ``columns`` of them (with ``step``),
    rank by rank in the order of the parts' paths. Where ``filter`` keeps a set of steps
    (``steps``), only the row groups that may hold one of them are read."""

    def __init__(
        self,
        trace: Parts,
        columns: Sequence[str],
        filter: Any,
        parts: list[Path],
        span: tuple[int, int] | None,
        filtered: Sequence[str] = (),
        steps: Sequence[int] | None = None,
    ) -> None:
        self._trace = trace
        self._columns = list(dict.fromkeys(["step", *columns]))
        self._filter = filter
        self._span = span
        self._filtered = list(filtered)  # the columns ``filter`` reads
        self._schema = schema.RECORD_SCHEMA.append(schema.PARTITIONING.field("rank"))
        self._groups: dict[int, deque[_Group]] = {}
        self._held: dict[int, pa.Table] = {}
        chosen = None if steps is None else np.unique(np.asarray(steps, dtype=np.int64))
        found: dict[int, list[_Group]] = {}
        for part in parts:
            for group in _with_spans(_groups(part, trace._metadata[part]), trace._metadata[part]):
                if span is not None and not (group.first <= span[1] and span[0] <= group.last):
                    continue
                if chosen is not None and not _holds_one(chosen, group):
                    continue
                found.setdefault(rank_of(part), []).append(group)
        for rank, groups in found.items():
            # by first step (stable: a part's own groups stay in order), whatever the parts'
            # names say: a window then reads every group that may hold its steps
            self._groups[rank] = deque(sorted(groups, key=lambda g: g.first))

    def through(self, step: int) -> pa.Table:
        """Every record up to ``step`` not handed out yet, rank by rank, each rank's in the
        order its parts hold them ((step, seq))."""
        out = []
        for rank, queue in self._groups.items():
            tables_read = [self._held.pop(rank)] if rank in self._held else []
            while queue and queue[0].first <= step:
                tables_read.extend(self._read(rank, queue))
            if not tables_read:
                continue
            held = pa.concat_tables(tables_read) if len(tables_read) > 1 else tables_read[0]
            steps = held.column("step").to_numpy()
            if bool(np.all(steps[1:] >= steps[:-1])):  # as written: the records due are a head
                cut = int(np.searchsorted(steps, step, side="right"))
                due, rest = held.slice(0, cut), held.slice(cut)
            else:
                due_mask = pa.array(steps <= step)
                due, rest = held.filter(due_mask), held.filter(pa.array(steps > step))
            if rest.num_rows:
                self._held[rank] = rest
            out.append(due)
        if not out:
            return self._schema.empty_table().select(self._columns)
        return pa.concat_tables(out) if len(out) > 1 else out[0]

    def _read(self, rank: int, queue: deque[_Group]) -> list[pa.Table]:
        """The next row group, read whole (and filtered); a part found damaged is left out of
        the trace and of the rest of the stream (what was handed out of it stays out)."""
        group = queue.popleft()
        trace = self._trace
        if not trace._holds(schema.RECORDS_DIR, group.part):  # left out meanwhile
            return []
        decoded = [c for c in self._columns if c not in group.constant]
        try:
            # opened for this group alone (the footer is known: no read of it): a stream of
            # a thousand ranks would otherwise hold a thousand files open
            with pq.ParquetFile(
                group.part, metadata=trace._metadata[group.part], page_checksum_verification=True
            ) as parquet:
                found = self._decode(parquet, group.index, decoded, rank)
            found = self._in_span(found, group)
            found.validate(full=True)  # names that are not UTF-8 would fail in to_pandas()
            if len(decoded) < len(self._columns):
                fields = [self._schema.field(c) for c in self._columns]
                found = pa.Table.from_arrays(
                    [
                        found.column(f.name)
                        if f.name in decoded
                        else _repeat(group.constant[f.name], found.num_rows, f.type)
                        for f in fields
                    ],
                    schema=pa.schema(fields),
                )
        except (OSError, pa.ArrowException) as exc:
            if not tables.damaged(trace.path, schema.RECORDS_DIR, group.part, self._schema):
                raise TraceError(
                    f"cannot read {schema.RECORDS_DIR} of {trace.path}: {one_line(exc)}"
                ) from exc
            trace._drop(schema.RECORDS_DIR, group.part, exc)
            while queue and queue[0].part == group.part:
                queue.popleft()
            return []
        return [found]

    def _decode(
        self, parquet: pq.ParquetFile, index: int, columns: list[str], rank: int
    ) -> pa.Table:
        """``columns`` of row group ``index`` of ``parquet`` (a part of ``rank``) as the
        records' schema types them, the rows ``filter`` keeps. Read as one row group of one
        file, its columns decoded in parallel: a dataset scan of it took twice as long. A
        column the part does not hold (a trace older than it) is null, as a dataset reads it;
        ``rank`` comes from the part's directory."""
        wanted = list(dict.fromkeys([*columns, *self._filtered]))
        stored = set(parquet.schema_arrow.names)
        read = parquet.read_row_group(
            index, columns=[c for c in wanted if c in stored and c != "rank"], use_threads=True
        )
        fields = [self._schema.field(c) for c in wanted]
        arrays = []
        for field in fields:
            if field.name == "rank":
                arrays.append(pa.array(np.full(read.num_rows, rank, np.int32)))
            elif field.name not in stored:
                arrays.append(pa.nulls(read.num_rows, field.type))
            else:
                column = read.column(field.name)
                arrays.append(column if column.type == field.type else column.cast(field.type))
        table = pa.Table.from_arrays(arrays, schema=pa.schema(fields))
        if self._filter is not None:
            table = table.filter(self._filter)
        return table.select(columns)

    def _in_span(self, table: pa.Table, group: _Group) -> pa.Table:
        """The rows of ``table`` (of ``group``) in the stream's span: a copy only where the
        group holds steps outside it (or none: a part rewritten by another tool, whose
        statistics leave nulls out)."""
        span = self._span
        steps = table.column("step")
        if span is None or (
            span[0] <= group.first <= group.last <= span[1] and steps.null_count == 0
        ):
            return table
        return table.filter(
            pc.and_(pc.greater_equal(steps, span[0]), pc.less_equal(steps, span[1]))
        )


def _holds_one(steps: np.ndarray, group: _Group) -> bool:
    """Whether ``group``'s step span holds one of ``steps`` (distinct, in order)."""
    at = int(np.searchsorted(steps, group.first))
    return at < len(steps) and steps[at] <= group.last


def _groups(part: Path, metadata: Any) -> list[_Group]:
    """The row groups of a part, each with its step span and its constant columns, from the
    footer."""
    names = metadata.schema.names
    column = names.index("step") if "step" in names else None
    found = []
    for i in range(metadata.num_row_groups):
        row_group = metadata.row_group(i)
        stats = None if column is None else row_group.column(column).statistics
        constant = _constant(row_group)
        if stats is None or not stats.has_min_max:
            found.append(_Group(part, i, float("-inf"), float("inf"), constant))
        else:
            found.append(_Group(part, i, int(stats.min), int(stats.max), constant))
    return found


def _with_spans(groups: list[_Group], metadata: Any) -> list[_Group]:
    """A part's ``groups``, each with its step span, read from its ``step`` column where the
    footer (``metadata``) does not say (a part rewritten without statistics): else such a
    group would sort first, and every one be read and held at the first window. Where that
    column cannot be read, the span stays open, and the reading of the group says why."""
    if all(group.first != float("-inf") for group in groups):
        return groups
    try:
        opened = pq.ParquetFile(groups[0].part, metadata=metadata)
    except (OSError, pa.ArrowException):
        return groups
    found = []
    for group in groups:
        if group.first != float("-inf"):
            found.append(group)
            continue
        try:
            span = pc.min_max(opened.read_row_group(group.index, columns=["step"]).column(0))
        except (OSError, pa.ArrowException):
            found.append(group)
            continue
        first, last = span["min"].as_py(), span["max"].as_py()
        if first is None:  # no step: nothing a window asks for
            first = last = float("inf")
        found.append(_Group(group.part, group.index, first, last, group.constant))
    return found


_MADE = ("segment", "tensor_key")
"""The columns made from a row group's statistics where they hold one value (see above)."""


def _constant(row_group: Any) -> dict[str, Any]:
    """The columns of :data:`_MADE` that hold one value in ``row_group``, with it."""
    found: dict[str, Any] = {}
    for j in range(row_group.num_columns):
        chunk = row_group.column(j)
        if chunk.path_in_schema not in _MADE:
            continue
        stats = chunk.statistics
        try:
            if (
                stats is None
                or not stats.has_min_max
                or not stats.has_null_count
                or stats.null_count != 0
                or stats.min != stats.max
            ):
                continue
            value = stats.min
        except (UnicodeDecodeError, ValueError):  # not UTF-8: decoding will say damaged
            continue
        if isinstance(value, str) and len(value.encode()) * row_group.num_rows < 2**31:
            found[chunk.path_in_schema] = value
    return found


def _repeat(value: str, n: int, kind: pa.DataType) -> pa.Array:
    """``n`` times ``value``, as an array of ``kind`` (a string, or a dictionary of them)."""
    if pa.types.is_dictionary(kind):
        indices = pa.array(np.zeros(n, dtype=np.int32), kind.index_type)
        return pa.DictionaryArray.from_arrays(indices, pa.array([value], kind.value_type))
    data = value.encode()
    offsets = np.arange(n + 1, dtype=np.int32) * len(data)
    return pa.Array.from_buffers(
        pa.string(), n, [None, pa.py_buffer(offsets), pa.py_buffer(data * n)]
    )
