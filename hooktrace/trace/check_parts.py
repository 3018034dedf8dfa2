"""What a run's Parquet parts hold, read in full a batch at a time for ``hooktrace check``:
per rank its records and steps, the modules named, the records hooktrace could not
summarise, where each segment's activity and full tensors are, and whether each histogram
counts its tensor's values. Never imports torch.

Apart from :mod:`hooktrace.trace.check` because this is the reading (every page, its
checksum verified, memory bounded whatever the trace's size); ``check`` compares what it
finds with what the statuses and tables say.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hooktrace.trace import histograms, schema


@dataclass
class Segment:
    """What the records say one segment holds: activity up to ``end`` (from ``start``),
    and these full tensors."""

    counted: bool = False  # records point into its activity
    start: int = 0
    end: int = 0
    tensor_keys: list[str] = field(default_factory=list)


@dataclass
class Seen:
    """What the readable records parts hold, as much as the checks compare."""

    records: Counter[int] = field(default_factory=Counter)  # rank -> records
    steps: set[tuple[int, int]] = field(default_factory=set)  # (rank, step)
    modules: set[tuple[int, str]] = field(default_factory=set)  # (rank, module), not watched
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> records not summarised
    segments: dict[str, Segment] = field(default_factory=dict)
    histogram_steps: set[tuple[int, int]] = field(default_factory=set)  # (rank, step)
    histograms_wrong: int = 0  # histogram rows whose counts do not add up to numel

    def merge(self, other: Seen) -> None:
        self.records.update(other.records)
        self.histogram_steps |= other.histogram_steps
        self.histograms_wrong += other.histograms_wrong
        self.steps |= other.steps
        self.modules |= other.modules
        self.skipped.update(other.skipped)
        for name, theirs in other.segments.items():
            ours = self.segments.get(name)
            if ours is None:
                self.segments[name] = theirs
                continue
            if theirs.counted:
                ours.start = min(ours.start, theirs.start) if ours.counted else theirs.start
                ours.end = max(ours.end, theirs.end) if ours.counted else theirs.end
                ours.counted = True
            ours.tensor_keys += theirs.tensor_keys


_BATCH_ROWS = 1 << 16


def read_part(part: Path, kind_dir: str) -> Seen | None:
    """Read every page of ``part`` (checksums verified), a batch at a time; for a records
    part, what it holds. Raises what pyarrow raises on damage."""
    parquet = pq.ParquetFile(part, page_checksum_verification=True)
    if kind_dir == histograms.HISTOGRAMS_DIR:
        return _read_histograms(parquet, _rank_of(part))
    if kind_dir != schema.RECORDS_DIR:
        for _ in parquet.iter_batches(batch_size=_BATCH_ROWS):
            pass
        return None
    rank = _rank_of(part)
    seen = Seen()
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
        batch.validate(full=True)  # names that are not UTF-8 would fail later
        _add_batch(seen, rank, batch)
    return seen


def _read_histograms(parquet: pq.ParquetFile, rank: int) -> Seen:
    """The steps a histograms part covers, and how many of its rows do not count their
    tensor's values (a span past the last bin included)."""
    seen = Seen()
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
        seen.histogram_steps.update((rank, int(s)) for s in pc.unique(batch["step"]).to_pylist())
        counted = sum(batch[name].to_numpy().astype(np.int64) for name in histograms.COUNT_FIELDS)
        wrong = np.zeros(batch.num_rows, dtype=bool)
        for sign in ("pos", "neg"):
            spans = batch[sign]
            lengths = np.diff(spans.offsets.to_numpy()).astype(np.int64)
            starts = batch[f"{sign}_start"].to_numpy().astype(np.int64)
            wrong |= (starts < 0) | (starts + lengths > histograms.MAGNITUDE_BINS)
            sums = np.zeros(batch.num_rows, dtype=np.int64)
            np.add.at(
                sums, np.repeat(np.arange(batch.num_rows), lengths), spans.flatten().to_numpy()
            )
            counted = counted + sums
        wrong |= counted != batch["numel"].to_numpy()
        seen.histograms_wrong += int(wrong.sum())
    return seen


def _add_batch(seen: Seen, rank: int, batch: pa.RecordBatch) -> None:
    """Fold one batch of a records part into ``seen``, with pyarrow's kernels (a batch of a
    large trace is one of thousands)."""
    names = batch.schema.names
    seen.records[rank] += batch.num_rows
    seen.steps.update((rank, int(s)) for s in pc.unique(batch["step"]).to_pylist())
    kind = _strings(batch["kind"])
    named = batch["module"]
    watched = pc.is_in(kind, _WATCHED)
    if pc.any(watched).as_py():
        named = named.filter(pc.invert(watched))
    seen.modules.update((rank, str(m)) for m in pc.unique(_strings(named)).to_pylist())
    if "note" in names:
        note = _strings(batch["note"])
        skipped = note.filter(pc.fill_null(pc.starts_with(note, schema.NOTE_SKIPPED), False))
        for reason, n in Counter(skipped.to_pylist()).items():
            seen.skipped[reason.removeprefix(schema.NOTE_SKIPPED)] += n
    if "segment" not in names:
        return
    segment = _strings(batch["segment"])
    for name in pc.unique(segment.drop_null()).to_pylist():
        here = pc.fill_null(pc.equal(segment, name), False)
        found = Segment()
        if "units" in names and "activity_offset" in names:
            units = batch["units"].filter(here)
            offsets = batch["activity_offset"].filter(here)
            counted = pc.greater(units, 0)
            if pc.any(counted).as_py():
                starts = offsets.filter(counted)
                ends = pc.add(starts, units.filter(counted).cast(pa.int64()))
                found.counted = True
                found.start = int(pc.min(starts).as_py())
                found.end = int(pc.max(ends).as_py())
        if "tensor_key" in names:
            keys = batch["tensor_key"].filter(here)
            found.tensor_keys = keys.filter(pc.not_equal(keys, "")).to_pylist()
        seen.merge(Seen(segments={str(name): found}))


_WATCHED = pa.array(["tensor", "grad_tensor"])


def _strings(column: pa.Array) -> pa.Array:
    """A dictionary column as plain strings (the kernels used here take either)."""
    return column.cast(pa.string()) if pa.types.is_dictionary(column.type) else column


def _rank_of(part: Path) -> int:
    return int(part.parent.name.partition("=")[2])
