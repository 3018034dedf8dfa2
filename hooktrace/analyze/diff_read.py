"""What :func:`hooktrace.diff` reads: two runs' records a chunk of whole steps at a time, as
pyarrow reads them, the next chunk read in a thread while this one is compared. No torch."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.compute as pc

from hooktrace.analyze.diff_compare import KEYS, VALUES
from hooktrace.trace.reader import Trace

T = TypeVar("T")
R = TypeVar("R")


def read_ahead(chunks: Iterable[T], read: Callable[[T], R]) -> Iterator[tuple[T, R]]:
    """``(chunk, read(chunk))`` for each chunk, the next read in a thread meanwhile: pyarrow
    decodes without the GIL, so reading overlaps the comparison on another core."""
    with ThreadPoolExecutor(1, thread_name_prefix="hooktrace-diff-read") as pool:
        pending: tuple[T, Future[R]] | None = None
        for chunk in chunks:
            future = pool.submit(read, chunk)
            if pending is not None:
                yield pending[0], pending[1].result()
            pending = (chunk, future)
        if pending is not None:
            yield pending[0], pending[1].result()


def read_chunk(
    trace: Trace,
    chunk: list[int],
    ranks: list[int] | None,
    names: list[str] | None,
    kinds: list[str] | None,
    *,
    drop_rank: bool,
) -> pa.Table:
    """The records of ``chunk``'s steps that the filters select, as pyarrow read them."""
    table = trace.query_table(
        columns=[*KEYS, *VALUES], steps=(chunk[0], chunk[-1]), modules=names, kinds=kinds,
        ranks=ranks,
    )  # fmt: skip
    if len(chunk) != chunk[-1] - chunk[0] + 1:
        table = table.filter(pc.is_in(table.column("step"), pa.array(chunk, pa.int64())))
    return table.drop_columns(["rank"]) if drop_rank else table


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
