"""A run's Parquet parts as their footers tell them: found, checked to be hooktrace's, and
described (columns, the steps each holds, a column's smallest and largest value) without
decoding a row. Never imports torch.

Apart from the reader because this is all the reader knows of the parts before it reads
one: a question over a window of steps opens only the parts whose footers say they may hold
it, and a part that is not hooktrace's (a missing column, text where numbers belong) is left
out here, once, rather than failing every later read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from hooktrace.trace import histograms, schema
from hooktrace.trace.paths import LeaveOut, rank_of, regular, utf8

TABLES = (schema.RECORDS_DIR, schema.STEPS_DIR, schema.MODULES_DIR, histograms.HISTOGRAMS_DIR)
"""The directories of Parquet parts, one a table."""

_SCHEMAS = {
    schema.RECORDS_DIR: schema.RECORD_SCHEMA,
    schema.STEPS_DIR: schema.STEP_SCHEMA,
    schema.MODULES_DIR: schema.MODULE_SCHEMA,
    histograms.HISTOGRAMS_DIR: histograms.HISTOGRAM_SCHEMA,
}

# A part without these is not hooktrace's (other columns may be missing from files of an
# older minor version: they read as null)
_REQUIRED = {
    schema.RECORDS_DIR: {"step", "seq", "module", "kind", "slot"},
    schema.STEPS_DIR: {"step"},
    schema.MODULES_DIR: {"module"},
    histograms.HISTOGRAMS_DIR: {"step", "seq", "module", "kind", "pos", "neg"},
}


def discover(run: Path, kind_dir: str, leave_out: LeaveOut) -> dict[Path, pq.FileMetaData]:
    """The readable parts of one table (``kind_dir``), in name order, with their footers;
    each part that cannot be read, or is not hooktrace's, goes to ``leave_out``."""
    base = run / kind_dir
    if not base.is_dir():
        return {}
    required = _REQUIRED[kind_dir]
    good: dict[Path, pq.FileMetaData] = {}
    checked: list[pq.ParquetSchema] = []  # the schemas found right: parts share a few
    for part in sorted(base.glob("rank=*/part-*.parquet")):
        try:
            rank_of(part)
            if not utf8(str(part)):
                raise ValueError("the file name is not valid UTF-8")
            if not regular(part):  # a directory, or a pipe that would block a read
                raise ValueError("not a regular file")
            metadata = pq.read_metadata(part)
            missing = required - set(columns(metadata))
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
            leave_out(part, exc)
            continue
        good[part] = metadata
    return good


def columns(metadata: pq.FileMetaData) -> list[str]:
    """The part's columns by name (a list column's one, not its leaf's ``element``)."""
    return [metadata.schema.column(i).path.split(".")[0] for i in range(metadata.num_columns)]


def step_span(metadata: pq.FileMetaData) -> tuple[int, int] | None:
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


def value_span(footers: Iterable[pq.FileMetaData], column: str) -> tuple[Any, Any] | None:
    """The smallest and largest value of a records column over the parts' ``footers``, from
    their row groups' statistics; None where some row group has none. A part of an older
    minor version without the column counts as ""-valued (``note``) or unknown."""
    low: Any = None
    high: Any = None
    for metadata in footers:
        names = metadata.schema.names
        if column not in names:
            if column not in schema.EMPTY_WHEN_ABSENT:
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
