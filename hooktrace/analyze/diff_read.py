"""What :func:`hooktrace.diff` reads: two runs' records a chunk of whole steps at a time, as
pyarrow reads them, the next chunk read in a thread while this one is compared. No torch."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from hooktrace.analyze.diff_compare import KEYS, VALUES
from hooktrace.trace.reader import Trace
from hooktrace.trace.stream import RecordStream

_T = TypeVar("_T")
_R = TypeVar("_R")


def read_ahead(
    chunks: Iterable[_T], read: Callable[[_T], _R]
) -> Generator[tuple[_T, _R], None, None]:
    """``(chunk, read(chunk))`` for each chunk, the next read in a thread meanwhile: pyarrow
    decodes without the GIL, so reading overlaps the comparison on another core. Closing the
    generator waits for the read in flight, if any: no thread of it outlives the caller's use
    of the traces."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="hooktrace-diff-read")
    pending: list[tuple[_T, Future[_R]]] = []  # at most one; emptied before its result is yielded
    try:
        for chunk in chunks:
            pending.append((chunk, pool.submit(read, chunk)))
            if len(pending) == 2:
                yield _take(pending)
        while pending:
            yield _take(pending)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _take(pending: list[tuple[_T, Future[_R]]]) -> tuple[_T, _R]:
    """The oldest read, no longer held here (a chunk's tables live only while compared)."""
    chunk, future = pending.pop(0)
    return chunk, future.result()


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
) -> RecordStream:
    """What the filters select of ``trace``, for :func:`read_chunk`."""
    return trace.stream(
        columns=[*KEYS, *VALUES], steps=span, modules=names, kinds=kinds, ranks=ranks
    )


def in_chunks(steps: list[int], sizes: Any, budget: int) -> Iterable[list[int]]:
    """``steps`` in runs of whole steps of about ``budget`` records (``sizes``: per step)."""
    chunk: list[int] = []
    total = 0
    for step, n in zip(steps, sizes, strict=True):
        chunk.append(step)
        total += int(n)
        if total >= budget:
            yield chunk
            chunk, total = [], 0
    if chunk:
        yield chunk
