"""SQL over a trace, through DuckDB: the tables ``records``, ``steps``, ``modules`` and
``histograms`` as views over the run's Parquet parts (``histograms`` with whole rows of
counts; ``histogram_spans`` as stored, with the macro ``bins_sum``). Never imports torch.

A run of several ranks is answered about its logical tensors (:mod:`hooktrace.trace.logical`):
there ``records`` is ``logical_records`` (each tensor of a step once, the ranks' shards and
parts of the batch pooled, replicas counted once), ``histograms`` is ``logical_histograms``
(a logical record's histogram, the sum of its parts') and ``histogram_spans`` is
``logical_histogram_spans`` (those parts, a row each, under the logical record's ``rank``
and ``seq``). Each rank's records as written are ``rank_records``, ``rank_histograms`` and
``rank_histogram_spans``, in any run; in a run of one rank the plain names are those.

DuckDB is embedded, reads Parquet where it lies (only the columns and row groups a query
needs), runs on every core and spills to disk past its memory limit, so a question over a
trace larger than memory is still one query with a bounded footprint. The views cover the
parts the reader found whole (``Trace.skipped`` lists the others); ``rank`` comes from the
hive partition (``records/rank=R/...``), and every column of the format is there whatever
the minor version of the files (``note`` reads as "" in a 1.0 trace, as ``Trace.query`` has
it).

Each view lists the run's parts by name, so the same SQL runs on any engine that reads
Parquet with hive partitioning (docs/SCALING.md).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import pyarrow as pa

from hooktrace.trace import histograms, logical, schema

if TYPE_CHECKING:
    import duckdb

MEMORY_LIMIT = os.environ.get("HOOKTRACE_DUCKDB_MEMORY", "1GB")
"""DuckDB's memory limit for the analyzer's queries: past it, DuckDB spills to a temporary
directory, so the analyzer stays within the issue's 2 GB whatever the trace's size."""

TABLES = {
    schema.RECORDS_DIR: schema.RECORD_SCHEMA,
    schema.STEPS_DIR: schema.STEP_SCHEMA,
    schema.MODULES_DIR: schema.MODULE_SCHEMA,
    histograms.HISTOGRAMS_DIR: histograms.HISTOGRAM_SCHEMA,
}

RANK_RECORDS: Final = "rank_records"
"""The view of each rank's records as written: what the analyzer's own queries read."""

RANK_HISTOGRAM_SPANS: Final = "rank_histogram_spans"
"""The view of each rank's histograms as stored (a span of bins a row)."""

DEFAULT_VIEWS: Final = ("records", "histograms", "histogram_spans")
"""The views that answer about logical tensors in a run of several ranks (``logical_<name>``)
and about each rank's in a run of one (``rank_<name>``)."""

_SQL_TYPES = {
    pa.int16(): "SMALLINT",
    pa.int32(): "INTEGER",
    pa.int64(): "BIGINT",
    pa.float64(): "DOUBLE",
    pa.bool_(): "BOOLEAN",
    pa.string(): "VARCHAR",
    pa.list_(pa.int64()): "BIGINT[]",
}


def connect(
    parts: dict[str, list[Path]],
    columns: dict[str, set[str]] | None = None,
    layout: logical.Layout | None = None,
    *,
    logical_default: bool = False,
) -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with a view per table over ``parts`` (the reader's
    whole parts, by table directory name); ``columns``, where given, are the columns the
    parts of each table hold between them (else DuckDB reads every footer to learn them);
    ``layout``, each rank's data-parallel rank where known (``Trace.layout``);
    ``logical_default``: whether ``records``, ``histograms`` and ``histogram_spans`` are the
    logical views (a run of several ranks) or each rank's."""
    con = open_connection()
    define_views(con, parts, columns, layout, logical_default=logical_default)
    return con


def config() -> dict[str, Any]:
    """The analyzer's DuckDB settings: its memory limit, and where it spills past it (made
    only when it does). Open connections with :func:`open_connection`."""
    return {
        "memory_limit": MEMORY_LIMIT,
        "temp_directory": str(Path(tempfile.gettempdir()) / "hooktrace-duckdb"),
    }


def open_connection() -> duckdb.DuckDBPyConnection:
    """An in-memory DuckDB connection with :func:`config`, and no progress bar on the
    terminal of a command's user."""
    import duckdb

    con = duckdb.connect(config=config())
    with contextlib.suppress(duckdb.Error):  # in Jupyter, DuckDB may refuse to touch it
        con.execute("SET enable_progress_bar = false")
    return con


def define_views(
    con: duckdb.DuckDBPyConnection,
    parts: dict[str, list[Path]],
    columns: dict[str, set[str]] | None = None,
    layout: logical.Layout | None = None,
    *,
    logical_default: bool = False,
) -> None:
    """(Re)define the views over ``parts`` (the module says which), ``records``,
    ``histograms`` and ``histogram_spans`` logical where ``logical_default``."""
    for name, file_schema in TABLES.items():
        present = None if columns is None else columns[name]
        view = _select(con, file_schema, parts[name], present)
        if name == histograms.HISTOGRAMS_DIR:
            con.execute(f"CREATE OR REPLACE VIEW {RANK_HISTOGRAM_SPANS} AS {view}")
            view = _whole_histograms(view)
        named = f"rank_{name}" if name in DEFAULT_VIEWS else name
        con.execute(f"CREATE OR REPLACE VIEW {named} AS {view}")
    records = ["rank", *schema.RECORD_SCHEMA.names]
    con.execute(
        f"CREATE OR REPLACE VIEW logical_records AS {logical.select(RANK_RECORDS, records, layout)}"
    )
    con.execute(f"CREATE OR REPLACE VIEW logical_histogram_spans AS {logical_spans('', layout)}")
    con.execute(f"CREATE OR REPLACE VIEW logical_histograms AS {_summed_histograms()}")
    for name in DEFAULT_VIEWS:
        chosen = f"logical_{name}" if logical_default else f"rank_{name}"
        con.execute(f"CREATE OR REPLACE VIEW {name} AS SELECT * FROM {chosen}")
    con.execute(BINS_SUM)


def logical_spans(where: str, layout: logical.Layout | None = None) -> str:
    """A query of the histograms (as ``rank_histogram_spans`` holds them) that ``where`` (a
    WHERE clause over ``rank_histogram_spans``, or "") keeps, each part of a logical tensor (see
    :func:`hooktrace.trace.logical.parts`) under its logical record's ``rank`` and ``seq``: a
    replica's copies left out but one, so that the sum of a logical record's rows is its
    histogram. The values are what each rank computed: an activation gradient pooled over
    data-parallel ranks is not divided by their number, as the logical record's statistics are."""
    needed = ", ".join(logical.NEEDED)
    source = f"(SELECT {needed} FROM {RANK_RECORDS} SEMI JOIN spans_ USING (rank, step, seq))"
    return f"""(
WITH spans_ AS (SELECT * FROM {RANK_HISTOGRAM_SPANS} {where}),
parts_ AS ({logical.parts(source, layout)})
SELECT s.* EXCLUDE (rank, seq), p.logical_rank AS rank, p.logical_seq AS seq
FROM spans_ s JOIN parts_ p USING (rank, step, seq)
)"""


BINS_SUM = """
CREATE OR REPLACE MACRO bins_sum(start, span, first, stop) AS coalesce(list_sum(
    span[greatest(first - start, 0) + 1 : greatest(least(stop - start, len(span)), 0)]), 0)
"""
"""``bins_sum(pos_start, pos, first, stop)`` over ``histogram_spans``: the count in magnitude
bins ``first`` to ``stop - 1`` of a span stored from ``start``. Questions about a range of
bins read the spans (a few dozen counts a row) far faster than whole rows of 279."""


def _summed_histograms() -> str:
    """The histograms of the logical records: one row each, the sums of its parts' counts
    and bins (``logical_histogram_spans``), whole rows as ``rank_histograms`` has them."""
    columns = [f.name for f in histograms.HISTOGRAM_SCHEMA if f.name not in ("step", "seq")]
    names = [c for c in columns if c not in _SPAN_COLUMNS]
    kept = ", ".join(
        f"sum({c})::BIGINT AS {c}" if c in _COUNT_COLUMNS else f"any_value({c}) AS {c}"
        for c in names
    )
    bins = histograms.MAGNITUDE_BINS
    summed = ", ".join(
        f"list_transform(range(1, {bins + 1}), lambda i: "
        f"list_sum(list_transform({sign}_, lambda r: r[i]))::BIGINT) AS {sign}"
        for sign in ("pos", "neg")
    )
    whole = _whole_histograms("SELECT * FROM logical_histogram_spans")
    return f"""
SELECT rank, step, seq, {", ".join(names)}, {summed}
FROM (
    SELECT rank, step, seq, {kept}, list(pos) AS pos_, list(neg) AS neg_
    FROM ({whole})
    GROUP BY rank, step, seq
)"""


_COUNT_COLUMNS = ("numel", "zero", "nan", "pos_inf", "neg_inf")


def _whole_histograms(view: str) -> str:
    """The histograms with whole rows: ``pos`` and ``neg`` of ``MAGNITUDE_BINS`` counts each,
    ``pos[k + 1]`` the count of magnitude bin ``k`` (the files hold each row's occupied span
    and where it starts: docs/FORMAT.md)."""
    bins = histograms.MAGNITUDE_BINS

    def whole(sign: str) -> str:
        zeros = "[]::BIGINT[]"
        return (
            f"list_concat(list_resize({zeros}, {sign}_start, 0), {sign}, "
            f"list_resize({zeros}, {bins} - {sign}_start - len({sign}), 0)) AS {sign}"
        )

    kept = [f.name for f in histograms.HISTOGRAM_SCHEMA if f.name not in _SPAN_COLUMNS]
    return f"SELECT rank, {', '.join(kept)}, {whole('pos')}, {whole('neg')} FROM ({view})"


_SPAN_COLUMNS = ("pos_start", "pos", "neg_start", "neg")


def _select(
    con: duckdb.DuckDBPyConnection,
    file_schema: pa.Schema,
    parts: Sequence[Path],
    columns_present: set[str] | None,
) -> str:
    """``SELECT rank, <every column of the format> FROM read_parquet([...])``: columns the
    files lack (an older minor version) are NULL of their type; ``note`` is "" there."""
    if not parts:
        nulls = ", ".join(f"CAST(NULL AS {_sql_type(f.type)}) AS {f.name}" for f in file_schema)
        return f"SELECT CAST(NULL AS INTEGER) AS rank, {nulls} WHERE false"
    files = "[" + ", ".join(_literal(str(p)) for p in parts) + "]"
    source = (
        f"read_parquet({files}, hive_partitioning = true, hive_types = {{'rank': INTEGER}}, "
        "union_by_name = true)"
    )
    present = (
        set(columns_present)
        if columns_present is not None
        else {row[0] for row in con.execute(f"DESCRIBE SELECT * FROM {source}").fetchall()}
    )
    columns = []
    for f in file_schema:
        if f.name not in present:
            empty = f.name in schema.EMPTY_WHEN_ABSENT
            value = "''" if empty else f"CAST(NULL AS {_sql_type(f.type)})"
            columns.append(f"{value} AS {f.name}")
        elif f.name in schema.EMPTY_WHEN_ABSENT:
            columns.append(f"coalesce({f.name}, '') AS {f.name}")
        else:
            columns.append(f'"{f.name}"')
    return f"SELECT rank, {', '.join(columns)} FROM {source}"


def _sql_type(arrow_type: Any) -> str:
    if pa.types.is_dictionary(arrow_type):
        arrow_type = arrow_type.value_type
    return _SQL_TYPES[arrow_type]


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"
