"""Small synthetic runs of many parts, for the analyzer's scale paths: made through the real
writer by ``benchmarks/synthetic.py``, without torch."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from synthetic import generate_trace, module_names

__all__ = ["generate_trace", "many_parts", "module_names", "with_nulls"]


def many_parts(path: Path, *, steps: int = 40, modules: int = 10, **faults: object) -> Path:
    """A run of ``steps`` steps of 40 records each (10 modules), a part about every step (the writer flushes as each step waits)."""
    generate_trace(
        path, steps=steps, modules=modules, writer_options={"max_buffer_bytes": 1},
        **faults,  # type: ignore[arg-type]
    )  # fmt: skip
    return path


def with_nulls(part: Path, column: str, rows: list[int]) -> None:
    """Rewrite a records part as another tool might, with ``column`` null at ``rows`` where
    hooktrace's schema has no nulls (as plain values: strings stay strings)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(part)
    kind = table.schema.field(column).type
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    values = table.column(column).to_pylist()
    for row in rows:
        values[row] = None
    at = table.schema.get_field_index(column)
    pq.write_table(table.set_column(at, pa.field(column, kind), pa.array(values, kind)), part)
