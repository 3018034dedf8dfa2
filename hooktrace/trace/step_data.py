"""One recorded step as numpy (:class:`StepData`), and how the steps of one flush become the
Arrow tables of its Parquet parts. Never imports torch.

Apart from the writer because this is the step's shape and its conversion, with no thread,
file or timing in it: the recorder builds :class:`StepData` (``recorder.pending``), the
writer thread flushes it, and tests and benchmarks make it by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from hooktrace.trace import histograms, schema


@dataclass
class StepData:
    """One recorded step as numpy, ready to write.

    ``columns`` holds the record columns the recorder knows (see ``RECORD_COLUMNS_IN``); the
    writer adds where activity and tensors land. ``activity`` and ``tensors`` pair a row
    index with its per-unit counts or its full tensor (with the tensor's own dtype name, which
    for bfloat16 travels as uint16 bits). ``histogram_rows`` are the rows histogrammed, in
    order, and ``histograms`` their counts, one row of ``histograms.WIDTH`` each, or
    ``histogram_columns`` their count columns as :func:`histograms.columns` makes them (where
    the recorder made them; ``histograms`` is then empty).
    """

    step: int
    micro_steps: int
    skipped: bool
    start_time: float
    end_time: float
    columns: dict[str, Any]
    activity: list[tuple[int, np.ndarray]] = field(default_factory=list)
    tensors: list[tuple[int, np.ndarray, str]] = field(default_factory=list)
    dropped: int = 0
    nonfinite: bool = False  # a record holds a NaN or Inf
    histogram_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    histograms: np.ndarray = field(
        default_factory=lambda: np.zeros((0, histograms.WIDTH), dtype=np.int64)
    )
    histogram_columns: dict[str, Any] | None = None
    histograms_failed: int = 0  # histograms that could not be made: the records hold

    @property
    def rows(self) -> int:
        return len(self.columns["step"])

    def held_bytes(self) -> int:
        """About what the step holds until it is written: its full tensors, unit counts and
        histograms, and 96 bytes a record."""
        held = 96 * self.rows + self.histograms.nbytes
        held += sum(array.nbytes for _, array, _ in self.tensors)
        held += sum(counts.nbytes for _, counts in self.activity)
        if self.histogram_columns is not None:
            held += sum(column.nbytes for column in self.histogram_columns.values())
        return held


RECORD_COLUMNS_IN = (
    "step", "micro_step", "phase", "seq", "module", "call", "kind", "slot", "dtype", "shape",
    "numel", "mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count",
    "units", "unit_size", "call_spec", "note", *schema.SHARD_COLUMNS,
)  # fmt: skip
_OPTIONAL: dict[str, list[str]] = {name: [] for name in ("call_spec", *schema.EMPTY_WHEN_ABSENT)}


def table(columns: dict[str, Any], table_schema: pa.Schema) -> pa.Table:
    """The columns as a table of ``table_schema``. A name that is not valid Unicode (a lone
    surrogate, from a name decoded with surrogateescape) has no UTF-8 form: it is written
    with backslash escapes instead of failing the whole flush."""
    try:
        return pa.Table.from_pydict(columns).cast(table_schema)
    except UnicodeEncodeError:
        escaped = {
            name: [_escape(v) for v in values] if isinstance(values, list) else values
            for name, values in columns.items()
        }
        return pa.Table.from_pydict(escaped).cast(table_schema)


def _escape(value: Any) -> Any:
    if isinstance(value, str):
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


def arrow_strings(values: list[str], type: pa.DataType) -> pa.Array:
    """``values`` as an Arrow array of ``type`` (a string or dictionary type), with names that
    are not valid Unicode backslash-escaped as :func:`table` does."""
    try:
        return pa.array(values, type=type)
    except UnicodeEncodeError:
        return pa.array([_escape(v) for v in values], type=type)


def concat_columns(steps: list[StepData]) -> dict[str, Any]:
    """The record columns of ``steps``, one after the other (``RECORD_COLUMNS_IN``; the
    writer adds where activity and tensors land)."""
    columns: dict[str, Any] = {}
    for name in RECORD_COLUMNS_IN:
        parts = [d.columns.get(name, _OPTIONAL.get(name, [])) for d in steps]
        if name in _OPTIONAL:  # may be left out by writers that have none
            parts = [
                p if len(p) == d.rows else [""] * d.rows for p, d in zip(parts, steps, strict=True)
            ]
        columns[name] = _concat(parts)
    return columns


def _concat(parts: list[Any]) -> Any:
    """One column from the steps' parts: numpy arrays, Arrow arrays or lists. A part that
    steps share (a :class:`~hooktrace.recorder.records.layout.Layout`'s column) is repeated as a
    whole, not value by value."""
    runs: list[tuple[Any, int]] = []  # (part, how many steps in a row share it)
    for part in parts:
        if runs and runs[-1][0] is part:
            runs[-1] = (part, runs[-1][1] + 1)
        else:
            runs.append((part, 1))
    if all(isinstance(p, np.ndarray) for p, _ in runs):
        return np.concatenate([np.tile(p, k) if k > 1 else p for p, k in runs])
    arrow = next((p.type for p, _ in runs if isinstance(p, pa.Array)), None)
    if arrow is None:
        return [v for p, k in runs for v in (p * k if k > 1 else p)]
    arrays = []
    for part, k in runs:
        array = part if isinstance(part, pa.Array) else arrow_strings(list(part), arrow)
        if k > 1:
            array = array.take(np.tile(np.arange(len(array), dtype=np.int64), k))
        arrays.append(array)
    return pa.concat_arrays(arrays)


def steps_table(steps: list[StepData]) -> pa.Table:
    return pa.Table.from_pylist(
        [
            {
                "step": d.step,
                "micro_steps": d.micro_steps,
                "skipped": d.skipped,
                "records": d.rows,
                "full_tensors": len(d.tensors),
                "dropped": d.dropped,
                "start_time": d.start_time,
                "end_time": d.end_time,
            }
            for d in steps
        ],
        schema=schema.STEP_SCHEMA,
    )


def histograms_table(steps: list[StepData], records: pa.Table) -> pa.Table | None:
    """The steps' histograms, one row per histogrammed record, keyed by its ``records`` row
    (the records table of the same steps); None when the steps hold none."""
    if not any(len(d.histogram_rows) for d in steps):
        return None
    bases = np.cumsum([0] + [d.rows for d in steps[:-1]])
    rows = np.concatenate([d.histogram_rows + base for d, base in zip(steps, bases, strict=True)])
    keys = records.take(pa.array(rows)).select(["step", "seq", "module", "kind", "slot", "numel"])
    columns = {name: keys.column(name) for name in keys.column_names}
    # each step's counts to their columns, then those joined: the dense counts (4.5 kB a
    # histogram) are read once, not copied together first
    counts = [
        d.histogram_columns if d.histogram_columns is not None else histograms.columns(d.histograms)
        for d in steps
        if len(d.histogram_rows)
    ]
    for name in counts[0]:
        parts = [c[name] for c in counts]
        columns[name] = (
            pa.concat_arrays(parts) if isinstance(parts[0], pa.Array) else np.concatenate(parts)
        )
    return table(columns, histograms.HISTOGRAM_SCHEMA)
