"""Is a trace whole, and if not, what was lost? Never imports torch.

``check`` reads every Parquet part in full, a batch at a time (so a damaged page anywhere is
found, not only in the columns an analysis happens to read, and memory stays bounded whatever
the trace's size), compares what is readable with what each rank's status says was written, and opens every HDF5 segment a record points to: the per-unit
activity is read in full, and every full tensor a record points to is read, a block at a time
(a trace can hold far more of them than memory), and its bytes checked against the CRC-32
the writer stored with it.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from hooktrace.errors import TraceError, TraceWarning
from hooktrace.trace import histograms, schema
from hooktrace.trace.captures import GROUPS, capture_paths, read_meta
from hooktrace.trace.reader import Trace, load

_MAX_LISTED = 5  # ranks named one by one before "and N more"
_BLOCK_BYTES = 64 << 20  # how much of a full tensor is read at a time to check its CRC-32


@dataclass
class CheckReport:
    """The verdict on one run: ``whole`` is True only when nothing was lost."""

    path: Path
    status: str
    steps: int
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def whole(self) -> bool:
        return self.status == schema.STATUS_COMPLETE and not self.problems


def check(run: str | os.PathLike[str] | Trace) -> CheckReport:
    """Check a run directory. Raises :class:`~hooktrace.errors.TraceError` when unreadable.

    Memory stays bounded whatever the trace's size: each part is read a batch at a time, and
    only what the checks compare is kept (per rank its steps, per segment the extent of the
    activity and the full tensors it must hold, the modules named)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)  # the report lists what was left out
        trace = run if isinstance(run, Trace) else load(run)
        seen = _Seen()
        for kind_dir, parts in trace._parts.items():
            for part in list(parts):
                try:
                    found = _read_part(part, kind_dir)
                except (OSError, ValueError, pa.ArrowException) as exc:
                    trace._drop(kind_dir, part, exc)
                    continue
                if found is not None:
                    seen.merge(found)
        table = trace.steps
        modules = trace.modules
    n_steps = len({step for _, step in seen.steps})
    report = CheckReport(path=trace.path, status=trace.status, steps=n_steps)
    _check_ranks(trace, seen, report)
    for skipped in trace.skipped:
        report.problems.append(f"unreadable, left out: {skipped}")
    for leftover in sorted(trace.path.glob("**/.*.tmp")):
        report.problems.append(
            f"interrupted write left {leftover.relative_to(trace.path)}: the steps it held are lost"
        )
    _note_not_summarised(seen, report)
    _check_segments(trace, seen, report)
    _check_captures(trace, report)
    _check_tables(seen, table, modules, report)
    return report


@dataclass
class _Segment:
    """What the records say one segment holds: activity up to ``end`` (from ``start``),
    and these full tensors."""

    counted: bool = False  # records point into its activity
    start: int = 0
    end: int = 0
    tensor_keys: list[str] = field(default_factory=list)


@dataclass
class _Seen:
    """What the readable records parts hold, as much as the checks compare."""

    records: Counter[int] = field(default_factory=Counter)  # rank -> records
    steps: set[tuple[int, int]] = field(default_factory=set)  # (rank, step)
    modules: set[tuple[int, str]] = field(default_factory=set)  # (rank, module), not watched
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> records not summarised
    segments: dict[str, _Segment] = field(default_factory=dict)
    histogram_steps: set[tuple[int, int]] = field(default_factory=set)  # (rank, step)
    histograms_wrong: int = 0  # histogram rows whose counts do not add up to numel

    def merge(self, other: _Seen) -> None:
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


def _read_part(part: Path, kind_dir: str) -> _Seen | None:
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
    seen = _Seen()
    for batch in parquet.iter_batches(batch_size=_BATCH_ROWS):
        batch.validate(full=True)  # names that are not UTF-8 would fail later
        _add_batch(seen, rank, batch)
    return seen


def _read_histograms(parquet: pq.ParquetFile, rank: int) -> _Seen:
    """The steps a histograms part covers, and how many of its rows do not count their
    tensor's values (a span past the last bin included)."""
    seen = _Seen()
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


def _add_batch(seen: _Seen, rank: int, batch: pa.RecordBatch) -> None:
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
        found = _Segment()
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
        seen.merge(_Seen(segments={str(name): found}))


_WATCHED = pa.array(["tensor", "grad_tensor"])


def _strings(column: pa.Array) -> pa.Array:
    """A dictionary column as plain strings (the kernels used here take either)."""
    return column.cast(pa.string()) if pa.types.is_dictionary(column.type) else column


def _rank_of(part: Path) -> int:
    return int(part.parent.name.partition("=")[2])


def _note_not_summarised(seen: _Seen, report: CheckReport) -> None:
    """Records without statistics, because hooktrace could not summarise their tensor: not a
    loss (each has its record, with the reason), but worth knowing."""
    if not seen.skipped:
        return
    ordered = sorted(
        seen.skipped.items(), key=lambda item: (-item[1], item[0])
    )  # the same order always
    listed = "; ".join(f"{reason} ({n:,})" for reason, n in ordered)
    report.notes.append(f"{sum(seen.skipped.values()):,} records hold no statistics: {listed}")


def _check_ranks(trace: Trace, seen: _Seen, report: CheckReport) -> None:
    world = int(trace.manifest.get("world_size", 1) or 1)
    statuses = trace.manifest["ranks"]
    silent = world - sum(1 for r in statuses if int(r) < world)
    listed = 0
    rank = 0
    while listed < min(silent, _MAX_LISTED):  # never walks all of a huge world_size
        if str(rank) not in statuses:
            report.problems.append(
                f"rank {rank} wrote no status: it never started or its status file is lost"
            )
            listed += 1
        rank += 1
    if silent > listed:
        report.problems.append(
            f"{silent - listed} more of the {world} ranks (world_size) wrote no status"
        )
    for key, info in sorted(statuses.items(), key=lambda item: int(item[0])):
        rank = int(key)
        status = info.get("status")
        mine = sorted(step for r, step in seen.steps if r == rank)
        last = str(mine[-1]) if mine else "none (no step was flushed)"
        if status == schema.STATUS_RECORDING:
            report.problems.append(
                f"rank {rank} did not finish (still running, or killed): steps after {last} are lost"
            )
            continue  # its counts were written when it started
        if status in (schema.STATUS_FAILED, schema.STATUS_INCOMPLETE):
            why = " ".join(str(info.get("error") or "no reason given").split())
            report.problems.append(f"rank {rank} is {status} after step {last}: {why}")
        if info.get("steps_lost"):
            report.problems.append(
                f"rank {rank} lost {info['steps_lost']} step(s) the writer could not write"
            )
        written, readable = info.get("records_written"), seen.records[rank]
        if isinstance(written, int) and readable < written:
            steps_written = info.get("steps_written")
            report.problems.append(
                f"rank {rank} wrote {written} records of {steps_written} step(s), but only "
                f"{readable} of {len(mine)} step(s) are readable: files were "
                "deleted or damaged"
            )


def _check_segments(trace: Trace, seen: _Seen, report: CheckReport) -> None:
    root = trace.path.resolve()
    for segment, held in sorted(seen.segments.items()):
        path = (trace.path / segment).resolve()
        if not path.is_relative_to(root):
            report.problems.append(
                f"segment {segment} points outside the run directory: not read, its data is lost"
            )
            continue
        if not path.exists():
            report.problems.append(
                f"segment {segment} is missing: its activity and full tensors are lost"
            )
            continue
        unreadable: list[str] = []
        try:
            damage = _segment_damage(path, held, unreadable)
        except Exception as exc:  # h5py raises OSError, KeyError, RuntimeError, ...
            damage = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if damage:
            report.problems.append(f"segment {segment} is damaged ({damage}): its data is lost")
        elif unreadable:
            report.problems.append(
                f"segment {segment}: {len(unreadable)} full tensor(s) cannot be read "
                f"({_listed(unreadable)}): those are lost, the rest of the segment reads"
            )


def _segment_damage(path: Path, held: _Segment, unreadable: list[str]) -> str | None:
    """What makes the whole segment unreadable, if anything; the full tensors that cannot be
    read on their own are added to ``unreadable``."""
    if not path.is_file():
        return "not a regular file"
    with h5py.File(path, "r") as f:
        if held.counted:
            activity = f["activity"]
            if not isinstance(activity, h5py.Dataset) or activity.dtype.kind not in "iu":
                return "/activity is not an integer array"
            size = _read_through(activity)
            if held.start < 0 or held.end > size:
                return f"records point past the end of /activity ({size} counts)"
        for key in held.tensor_keys:
            dataset = f.get(key)
            if not isinstance(dataset, h5py.Dataset):
                unreadable.append(f"{key} is missing")
            elif dataset.dtype.kind not in "biufc":
                unreadable.append(f"{key} is not a numeric array")
            else:
                try:
                    if not _checksum_matches(dataset):
                        unreadable.append(f"{key} no longer matches its checksum")
                except Exception as exc:  # an HDF5 checksum or decompression error
                    unreadable.append(f"{key}: {type(exc).__name__}")
    return None


def _check_captures(trace: Trace, report: CheckReport) -> None:
    """Each non-finite capture opens, holds its description, and every tensor of it has the
    CRC-32 stored with it; as many are there as each rank's status says were written."""
    found: dict[int, int] = {}
    for rank, _, path in capture_paths(trace.path):
        where = path.relative_to(trace.path)
        try:
            read_meta(path)
            with h5py.File(path, "r") as f:
                bad = [
                    f"{group}/{name}"
                    for group in GROUPS
                    if group in f
                    for name, dataset in f[group].items()
                    if not _checksum_matches(dataset)
                ]
        except (OSError, TraceError) as exc:
            report.problems.append(f"capture {where} is damaged ({exc}): it is lost")
            continue
        if bad:
            report.problems.append(
                f"capture {where}: {len(bad)} tensor(s) no longer match their checksum "
                f"({_listed(bad)}): it cannot be replayed"
            )
        found[rank] = found.get(rank, 0) + 1
    for rank, status in sorted(trace.manifest["ranks"].items()):
        written = status.get("nonfinite_captures")
        if isinstance(written, int) and written > found.get(int(rank), 0):
            report.problems.append(
                f"rank {rank}: {written} non-finite capture(s) written, "
                f"{found.get(int(rank), 0)} readable: the others are lost"
            )
    if found:
        total = sum(found.values())
        report.notes.append(
            f"{total} non-finite capture(s), each whole: `hooktrace replay {trace.path} "
            "--nonfinite` shows them"
        )


def _read_through(activity: h5py.Dataset) -> int:
    """Read the whole activity array, a block at a time (a damaged chunk raises), and return
    its length."""
    for _ in _blocks(activity):
        pass
    return int(activity.shape[0]) if activity.ndim else 1


def _checksum_matches(dataset: h5py.Dataset) -> bool:
    """Whether a full tensor's bytes, read a block at a time, have the CRC-32 stored with it.
    Segments written before hooktrace stored one were checksummed per chunk by HDF5
    (fletcher32), which reading verifies: an error is raised then instead."""
    crc = 0
    for block in _blocks(dataset):
        crc = zlib.crc32(np.ascontiguousarray(block).data, crc)
    expected = dataset.attrs.get(schema.TENSOR_CHECKSUM)
    return expected is None or crc == int(expected)


def _blocks(dataset: h5py.Dataset) -> Iterator[np.ndarray]:
    """The dataset's values in C order, in pieces of at most ``_BLOCK_BYTES`` (or of one
    value): along the first axis whose slices fit, for each index of the axes before it."""
    if dataset.ndim == 0 or dataset.size == 0:
        yield np.asarray(dataset[()])
        return
    shape = dataset.shape
    axis = 0
    while axis < len(shape) - 1 and math.prod(shape[axis + 1 :]) * dataset.dtype.itemsize > (
        _BLOCK_BYTES
    ):
        axis += 1
    count = max(1, _BLOCK_BYTES // (math.prod(shape[axis + 1 :]) * dataset.dtype.itemsize))
    for lead in itertools.product(*(range(n) for n in shape[:axis])):
        for start in range(0, shape[axis], count):
            yield np.asarray(dataset[(*lead, slice(start, start + count))])


def _listed(items: list[str]) -> str:
    more = len(items) - _MAX_LISTED
    return "; ".join(items[:_MAX_LISTED]) + (f"; and {more} more" if more > 0 else "")


def _check_tables(
    seen: _Seen, table: pd.DataFrame, modules: pd.DataFrame, report: CheckReport
) -> None:
    listed = set(zip(table["rank"], table["step"], strict=True)) if not table.empty else set()
    if seen.steps - listed:
        report.problems.append(
            f"{len(seen.steps - listed)} step(s) have records but no row in the steps table: "
            "their micro-steps, skipped flag and times are lost"
        )
    known = (
        set(zip(modules["rank"], modules["module"].astype(str), strict=True))
        if not modules.empty
        else set()
    )
    if seen.modules - known:
        report.problems.append(
            f"{len(seen.modules - known)} module(s) have records but no row in the modules "
            "table: their type, root and parent are lost"
        )
    if seen.histogram_steps - seen.steps:
        report.problems.append(
            f"{len(seen.histogram_steps - seen.steps)} step(s) have histograms but no records"
        )
    if seen.histograms_wrong:
        report.problems.append(
            f"{seen.histograms_wrong} histogram row(s) do not count their tensor's values: "
            "their bins do not add up to numel"
        )
    dropped = int(table["dropped"].sum()) if not table.empty else 0
    if dropped:
        report.notes.append(f"{dropped} full tensor(s) were not saved: larger than max_tensor_mb")
    skipped_steps = int(table["skipped"].sum()) if not table.empty else 0
    if skipped_steps:
        report.notes.append(
            f"{skipped_steps} optimizer step(s) were skipped (e.g. by a GradScaler)"
        )
