"""What :func:`hooktrace.diff` reads: two runs' records a chunk of whole steps at a time, as
pyarrow reads them, each run in a thread of its own, the next chunk read while this one is
compared. No torch."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from hooktrace.analyze.diff.compare import KEYS, VALUES
from hooktrace.trace import logical as logical_view
from hooktrace.trace import logical_arrays
from hooktrace.trace.reader import Trace
from hooktrace.trace.stream import RecordStream
from hooktrace.trace.tables import arrow_of

_T = TypeVar("_T")
_R = TypeVar("_R")


def read_ahead(
    chunks: Iterable[_T], reads: Sequence[Callable[[_T], _R]]
) -> Generator[tuple[_T, list[_R]], None, None]:
    """``(chunk, [read(chunk) for read in reads])`` for each chunk, each read in a thread of
    its own (two runs are decoded at once), and the next chunk read while the caller works
    on this one: pyarrow decodes without the GIL. Each read sees its chunks in order, one at
    a time. Closing the generator waits for the reads in flight: no thread of it outlives
    the caller's use of the traces."""
    pools = [
        ThreadPoolExecutor(1, thread_name_prefix=f"hooktrace-diff-read-{i}")
        for i in range(len(reads))
    ]
    tasks = list(zip(pools, reads, strict=True))
    # at most one chunk waits; emptied before its results are handed out
    pending: list[tuple[_T, list[Future[_R]]]] = []
    try:
        for chunk in chunks:
            # no name holds the futures: a chunk's tables live only while the caller has them
            pending.append((chunk, [pool.submit(read, chunk) for pool, read in tasks]))
            if len(pending) == 2:
                yield _take(pending)
        while pending:
            yield _take(pending)
    finally:
        for pool in pools:
            pool.shutdown(wait=True, cancel_futures=True)


def _take(pending: list[tuple[_T, list[Future[_R]]]]) -> tuple[_T, list[_R]]:
    """The oldest chunk's reads, no longer held here (a chunk's tables live only while
    compared)."""
    chunk, futures = pending.pop(0)
    return chunk, [future.result() for future in futures]


def read_chunk(stream: RecordStream, chunk: list[int], *, drop_rank: bool) -> pa.Table:
    """The records of ``chunk``'s steps (in step order, after those already read)."""
    table = stream.through(chunk[-1])
    steps = table.column("step")
    if len(chunk) != chunk[-1] - chunk[0] + 1:
        table = table.filter(pc.is_in(steps, pa.array(chunk, pa.int64())))
    elif table.num_rows and pc.min(steps).as_py() < chunk[0]:  # steps not compared
        table = table.filter(pc.greater_equal(steps, chunk[0]))
    return table.drop_columns(["rank"]) if drop_rank else table


def stream_of(
    trace: Trace,
    ranks: list[int] | None,
    names: list[str] | None,
    kinds: list[str] | None,
    span: tuple[int, int],
    *,
    logical: bool = False,
) -> RecordStream:
    """What the filters select of ``trace``, for :func:`read_chunk` (``logical``: with the
    columns :func:`logical_chunk` needs besides)."""
    shards = [c for c in logical_view.NEEDED if c not in (*KEYS, *VALUES)] if logical else []
    return trace.stream(
        columns=[*KEYS, *VALUES, *shards], steps=span, modules=names, kinds=kinds, ranks=ranks
    )


def logical_chunk(
    table: pa.Table, layout: logical_view.Layout | None = None, *, ranks: int = 2
) -> pa.Table:
    """The logical records of a chunk of every rank's records (:mod:`hooktrace.trace.logical`;
    ``layout`` as ``Trace.layout`` gives it; a run of one rank, ``ranks`` 1, as it is), in
    the columns and types :func:`stream_of` reads without ``logical``, and ``merged``."""
    columns = [*KEYS, *VALUES]
    stored = table.select(columns).schema
    if ranks > 1:
        table = logical_arrays.logical_table(table, layout)
        merged = table.column("merged")
    else:
        merged = pa.nulls(table.num_rows, pa.string())
    return table.select(columns).cast(stored).append_column("merged", merged)


def set_aside_partials(tables: list[pa.Table]) -> tuple[list[pa.Table], int]:
    """``tables`` (of :func:`logical_chunk`) without the records, in either, of a tensor
    one of them holds as partial sums (a ``P(...)`` placement: a tensor-parallel output
    before its reduction, which is no logical tensor to compare), and how many records
    that leaves out; the ``merged`` column dropped."""
    partial = [pc.equal(t.column("merged"), "partial").fill_null(False) for t in tables]
    if not any(pc.any(mask).as_py() for mask in partial):
        return [t.drop_columns(["merged"]) for t in tables], 0
    import duckdb

    keys = ", ".join(k for k in KEYS if k != "rank")
    con = duckdb.connect()
    try:
        for i, (table, mask) in enumerate(zip(tables, partial, strict=True)):
            con.register(f"t{i}", table.drop_columns(["merged"]))
            con.register(f"p{i}", table.filter(mask).select(list(KEYS)))
        union = " UNION ".join(f"SELECT {keys} FROM p{i}" for i in range(len(tables)))
        kept, left_out = [], 0
        for i, table in enumerate(tables):
            relation = con.sql(
                f"SELECT * FROM t{i} ANTI JOIN ({union}) USING ({keys}) ORDER BY step, seq, rank"
            )
            found = arrow_of(relation)
            left_out += table.num_rows - found.num_rows
            kept.append(found.cast(table.drop_columns(["merged"]).schema))
        return kept, left_out
    finally:
        con.close()


def in_chunks(
    steps: list[int], sizes: Any, budget: int, *, first: int | None = None
) -> Iterable[list[int]]:
    """``steps`` in runs of whole steps of about ``budget`` records (``sizes``: per step), the
    first of about ``first`` (default: ``budget``): a small first chunk starts the work on
    the other thread sooner."""
    chunk: list[int] = []
    total = 0
    limit = budget if first is None else first
    for step, n in zip(steps, sizes, strict=True):
        chunk.append(step)
        total += int(n)
        if total >= limit:
            yield chunk
            chunk, total, limit = [], 0, budget
    if chunk:
        yield chunk
