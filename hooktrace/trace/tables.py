"""Reading one table of a run (records, steps, modules or histograms) from its Parquet parts
with pyarrow: partitioned by rank, page checksums verified, and a part damaged inside left out
rather than failing the question. Never imports torch.

Apart from the reader because it is the one place that decodes Parquet for it: ``Trace``
decides which parts and columns a question needs (:mod:`hooktrace.trace.footers`,
:mod:`hooktrace.trace.filters`) and what the rows become (DataFrames); this reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.dataset as ds

from hooktrace.errors import TraceError
from hooktrace.trace import schema
from hooktrace.trace.paths import one_line

# pages written with a CRC-32 (hooktrace since 2026-11-21) are verified; older ones have none
PARQUET = ds.ParquetFileFormat(
    default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
)


def read_table(
    run: Path,
    kind_dir: str,
    file_schema: pa.Schema,
    parts: list[Path],
    *,
    columns: list[str] | None = None,
    filter: Any = None,
    drop: Callable[[Path, BaseException], None],
) -> pa.Table:
    """The rows of ``parts`` (of the table in ``kind_dir``) matching ``filter``, as
    ``file_schema`` with ``rank`` added (only ``columns``, where given). A part that cannot
    be read in full on its own is handed to ``drop`` and left out; any other failure is a
    TraceError."""
    full_schema = file_schema.append(schema.PARTITIONING.field("rank"))
    empty = full_schema.empty_table()
    empty = empty.select(columns) if columns else empty
    if not parts:
        return empty

    def read(paths: list[Path]) -> pa.Table:
        table = dataset_of(run, kind_dir, paths, full_schema).to_table(
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
            if not damaged(run, kind_dir, part, full_schema):
                raise TraceError(f"cannot read {kind_dir} of {run}: {one_line(exc)}") from exc
            drop(part, exc)
    return pa.concat_tables(tables) if tables else empty


def dataset_of(run: Path, kind_dir: str, paths: list[Path], full_schema: pa.Schema) -> ds.Dataset:
    return ds.dataset(
        [str(p) for p in paths],
        schema=full_schema,
        format=PARQUET,
        partitioning=ds.partitioning(schema.PARTITIONING, flavor="hive"),
        partition_base_dir=str(run / kind_dir),
    )


def damaged(run: Path, kind_dir: str, part: Path, full_schema: pa.Schema) -> bool:
    """True when ``part`` cannot be read in full, as hooktrace's schema, on its own."""
    try:
        dataset_of(run, kind_dir, [part], full_schema).to_table().validate(full=True)
    except (OSError, pa.ArrowException):
        return True
    return False


def arrow_of(relation: Any) -> pa.Table:
    """A DuckDB relation's rows as a pyarrow Table (DuckDB 2 names it ``to_arrow_table``,
    1.x ``arrow``)."""
    return (getattr(relation, "to_arrow_table", None) or relation.arrow)()
