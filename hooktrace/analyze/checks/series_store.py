"""One value per (rank, module, step), kept out of pandas: the norms that
:func:`hooktrace.anomalies` reduces chunk by chunk where DuckDB cannot read the trace's
parts, for the series checks it runs at the end. Never imports torch.

At 10,000 steps of 2,500 modules that is 25 million values, more than should sit in pandas:
they go into a DuckDB table of the connection the store is given (in memory up to DuckDB's
limit, spilled to disk past it), a query's rows at a time, and come back a few modules at a
time, in (rank, module) order, each module's steps whole and in order: a series check then
holds one batch of modules, whatever the trace's length.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

COLUMNS = ("rank", "module", "step", "value", "seq")
"""rank, module (an integer id), step, the value, and the module's first seq at that step."""

BATCH_ROWS = 1 << 20
"""About how many values a batch holds (whole modules: more where one module has more)."""


class SeriesStore:
    """Named series (``grads``, ``outputs``) in DuckDB tables of the connection ``con``:
    append a query's rows (rank, module, step, value, seq) to one, read it back by module."""

    def __init__(self, con: Any) -> None:
        self._con = con
        self._made: set[str] = set()

    def insert(self, series: str, query: str, parameters: list[Any] | None = None) -> None:
        """Append the rows of ``query`` (:data:`COLUMNS`, in order), run in the store's
        connection."""
        self._con.execute(f"INSERT INTO {self.table(series)} {query}", parameters)

    def table(self, series: str) -> str:
        """The name of the DuckDB table that holds ``series`` (made if need be)."""
        name = f'"hooktrace_{series}_{id(self):x}"'
        if series not in self._made:
            self._con.execute(
                f"CREATE TABLE {name} (rank BIGINT, module BIGINT, step BIGINT, value DOUBLE, "
                "seq BIGINT)"
            )
            self._made.add(series)
        return name

    def tables(
        self, series: str, names: list[str], *, rows: int | None = None
    ) -> Iterator[pd.DataFrame]:
        """Tables of whole modules, in (rank, module) order, each module's steps in order;
        ``module`` as a categorical of ``names`` (ids index it). About ``rows`` values a
        table (:data:`BATCH_ROWS`), more where one module has more."""
        rows = BATCH_ROWS if rows is None else rows
        if series not in self._made:
            return
        ordered = self._con.sql(f"SELECT * FROM {self.table(series)} ORDER BY rank, module, step")
        yield from whole_modules(ordered.to_arrow_reader(max(1, rows)), names)

    def close(self) -> None:
        """Drop the store's tables (the connection stays open)."""
        for series in list(self._made):
            self._con.execute(f"DROP TABLE IF EXISTS {self.table(series)}")
        self._made.clear()


def whole_modules(ordered: Iterable[pa.RecordBatch], names: list[str]) -> Iterator[pd.DataFrame]:
    """Batches of (rank, module) order (:data:`COLUMNS`) as tables of whole modules: the
    last module of a batch is held back until the next shows where it ends. Batches are cut
    and joined in Arrow; each table goes to pandas once."""
    held: list[pa.RecordBatch] = []  # the rows of the module not known to be whole yet
    for batch in ordered:
        if not batch.num_rows:
            continue
        rank = batch.column("rank").to_numpy()
        module = batch.column("module").to_numpy()
        other = np.flatnonzero((rank != rank[-1]) | (module != module[-1]))
        cut = int(other[-1]) + 1 if len(other) else 0  # where the batch's last module starts
        if cut or (held and _last(held[-1]) != (rank[-1], module[-1])):
            yield _named(pa.Table.from_batches([*held, batch.slice(0, cut)]), names)
            held = []
        held.append(batch.slice(cut))
    if held:
        yield _named(pa.Table.from_batches(held), names)


def _last(batch: pa.RecordBatch) -> tuple[Any, Any]:
    """The (rank, module) of the last row of ``batch``."""
    return batch.column("rank")[-1].as_py(), batch.column("module")[-1].as_py()


def _named(table: pa.Table, names: list[str]) -> pd.DataFrame:
    frame = table.to_pandas()
    frame["module"] = pd.Categorical.from_codes(
        frame["module"].to_numpy(), categories=pd.Index(names)
    )
    return frame
