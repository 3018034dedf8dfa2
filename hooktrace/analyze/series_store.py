"""One value per (rank, module, step), kept out of pandas: what :func:`hooktrace.anomalies`
collects while it reads a trace, for the series checks it runs at the end. Never imports
torch.

At 10,000 steps of 2,500 modules that is 25 million values, more than should sit in pandas.
Past :data:`MEMORY_ROWS` values the chunks go into a DuckDB table instead (in memory up to
DuckDB's limit, spilled to disk past it); below it they stay in numpy, and DuckDB is not even
imported. Either way they come back a few modules at a time, in (rank, module) order, each
module's steps whole and in order: a series check then holds one batch of modules, whatever
the trace's length.

A store can also live in a connection it is given (the trace's, where :func:`hooktrace.anomalies`
reduces the records in SQL): then :meth:`SeriesStore.insert` appends a query's rows without
them leaving DuckDB, and :meth:`SeriesStore.close` drops its tables.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from hooktrace.trace import sql

COLUMNS = ("rank", "module", "step", "value", "seq")
"""rank, module (an integer id), step, the value, and the module's first seq at that step."""

BATCH_ROWS = 1 << 20
"""About how many values a batch holds (whole modules: more where one module has more)."""

MEMORY_ROWS = 1 << 21
"""How many values (of all series) are held in memory, some 80 MB, before DuckDB holds them."""


class SeriesStore:
    """Named series (``grads``, ``outputs``): append chunks of (rank, module, step, value,
    seq) to one, read it back by module. Past :data:`MEMORY_ROWS` values together, one DuckDB
    database holds them all, so they share its memory limit; given a connection ``con``, that
    one, from the start."""

    def __init__(self, con: Any = None) -> None:
        self._con: Any = con
        self._owned = con is None
        self._made: set[str] = set()
        self._held: dict[str, list[pd.DataFrame]] = {}  # until MEMORY_ROWS are held
        self._rows = 0

    def add(self, series: str, frame: pd.DataFrame) -> None:
        if frame.empty:
            return
        if self._con is None:
            self._held.setdefault(series, []).append(frame[list(COLUMNS)])
            self._rows += len(frame)
            if self._rows <= MEMORY_ROWS:
                return
            self._con = sql.open_connection()
            held, self._held = self._held, {}
            for name, frames in held.items():
                for part in frames:
                    self._insert(name, part)
            return
        self._insert(series, frame)

    def insert(self, series: str, query: str, parameters: list[Any] | None = None) -> None:
        """Append the rows of ``query`` (:data:`COLUMNS`, in order), run in the store's
        connection (the one it was given)."""
        self.table(series)
        self._con.execute(f"INSERT INTO {self.table(series)} {query}", parameters)

    def table(self, series: str) -> str:
        """The name of the DuckDB table that holds ``series`` (made if need be)."""
        name = f'"{series}"' if self._owned else f'"hooktrace_{series}_{id(self):x}"'
        if series not in self._made:
            self._con.execute(
                f"CREATE TABLE {name} (rank BIGINT, module BIGINT, step BIGINT, value DOUBLE, "
                "seq BIGINT)"
            )
            self._made.add(series)
        return name

    def _insert(self, series: str, frame: pd.DataFrame) -> None:
        table = self.table(series)
        self._con.register("chunk", frame[list(COLUMNS)])
        self._con.execute(f"INSERT INTO {table} SELECT * FROM chunk")
        self._con.unregister("chunk")

    def tables(
        self, series: str, names: list[str], *, rows: int | None = None
    ) -> Iterator[pd.DataFrame]:
        """Tables of whole modules, in (rank, module) order, each module's steps in order;
        ``module`` as a categorical of ``names`` (ids index it). About ``rows`` values a
        table (:data:`BATCH_ROWS`), more where one module has more."""
        rows = BATCH_ROWS if rows is None else rows
        if series in self._held:
            yield from _batches(self._held[series], names, rows)
            return
        if series not in self._made:
            return
        ordered = self._con.sql(f"SELECT * FROM {self.table(series)} ORDER BY rank, module, step")
        yield from whole_modules(ordered.to_arrow_reader(max(1, rows)), names)

    def close(self) -> None:
        self._held.clear()
        if self._con is not None:
            if self._owned:
                self._con.close()
                self._con = None
            else:
                for series in list(self._made):
                    self._con.execute(f"DROP TABLE IF EXISTS {self.table(series)}")
            self._made.clear()


def whole_modules(ordered: Iterable[pa.RecordBatch], names: list[str]) -> Iterator[pd.DataFrame]:
    """Batches of (rank, module, step) order (:data:`COLUMNS`) as tables of whole modules:
    the last module of a batch is held back until the next shows where it ends."""
    carry: pd.DataFrame | None = None
    for record_batch in ordered:
        batch = record_batch.to_pandas()
        if batch.empty:
            continue
        if carry is not None:
            batch = pd.concat([carry, batch], ignore_index=True)
        last = (batch["rank"].iloc[-1], batch["module"].iloc[-1])
        tail = (batch["rank"] == last[0]) & (batch["module"] == last[1])
        carry = batch[tail]
        done = batch[~tail]
        if not done.empty:
            yield _named(done, names)
    if carry is not None and not carry.empty:
        yield _named(carry, names)


def _batches(frames: list[pd.DataFrame], names: list[str], rows: int) -> Iterator[pd.DataFrame]:
    """The held chunks in (rank, module, step) order, as tables of whole modules of about
    ``rows`` values: what DuckDB's ORDER BY gives (a (rank, module, step) is in one chunk)."""
    table = pd.concat(frames, ignore_index=True)
    table = table.iloc[
        np.lexsort((table["step"].to_numpy(), table["module"].to_numpy(), table["rank"].to_numpy()))
    ]
    rank, module = table["rank"].to_numpy(), table["module"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (module[1:] != module[:-1])])
    begin = 0
    for end in [*starts[1:].tolist(), len(table)]:
        if end - begin >= max(1, rows) or end == len(table):
            yield _named(table.iloc[begin:end], names)
            begin = end


def _named(table: pd.DataFrame, names: list[str]) -> pd.DataFrame:
    table = table.reset_index(drop=True)
    table["module"] = pd.Categorical.from_codes(
        table["module"].to_numpy(), categories=pd.Index(names)
    )
    return table
