"""Is a trace whole, and if not, what was lost? Never imports torch.

``check`` reads every Parquet part in full (so a damaged page anywhere is found, not only in
the columns an analysis happens to read), compares what is readable with what each rank's
status says was written, and opens every HDF5 segment a record points to: the per-unit
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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from hooktrace.errors import TraceWarning
from hooktrace.trace import schema
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
    """Check a run directory. Raises :class:`~hooktrace.errors.TraceError` when unreadable."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TraceWarning)  # the report lists what was left out
        trace = run if isinstance(run, Trace) else load(run)
        _decode_every_part(trace)
        rows = trace.query(
            columns=[
                "rank",
                "step",
                "module",
                "kind",
                "units",
                "activity_offset",
                "segment",
                "tensor_key",
                "note",
            ]
        )
        table = trace.steps
        modules = trace.modules
    n_steps = int(rows[["rank", "step"]].drop_duplicates().shape[0] and rows["step"].nunique())
    report = CheckReport(path=trace.path, status=trace.status, steps=n_steps)
    _check_ranks(trace, rows, table, report)
    for skipped in trace.skipped:
        report.problems.append(f"unreadable, left out: {skipped}")
    for leftover in sorted(trace.path.glob("**/.*.tmp")):
        report.problems.append(
            f"interrupted write left {leftover.relative_to(trace.path)}: the steps it held are lost"
        )
    _note_not_summarised(rows, report)
    _check_segments(trace, rows, report)
    _check_tables(rows, table, modules, report)
    return report


def _decode_every_part(trace: Trace) -> None:
    """Read each part in full, a batch at a time: damaged ones are left out of the trace."""
    for kind_dir, parts in trace._parts.items():
        for part in list(parts):
            try:
                for _ in pq.ParquetFile(part, page_checksum_verification=True).iter_batches(
                    batch_size=1 << 16
                ):
                    pass
            except (OSError, ValueError, pa.ArrowException) as exc:
                trace._drop(kind_dir, part, exc)


def _note_not_summarised(rows: pd.DataFrame, report: CheckReport) -> None:
    """Records without statistics, because hooktrace could not summarise their tensor: not a
    loss (each has its record, with the reason), but worth knowing."""
    notes = rows["note"].astype(str)
    skipped = notes[notes.str.startswith(schema.NOTE_SKIPPED)]
    if skipped.empty:
        return
    reasons = skipped.str.removeprefix(schema.NOTE_SKIPPED).value_counts()
    ordered = sorted(reasons.items(), key=lambda item: (-item[1], item[0]))  # the same order always
    listed = "; ".join(f"{reason} ({n:,})" for reason, n in ordered)
    report.notes.append(f"{len(skipped):,} records hold no statistics: {listed}")


def _check_ranks(
    trace: Trace, rows: pd.DataFrame, table: pd.DataFrame, report: CheckReport
) -> None:
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
        mine = rows[rows["rank"] == rank]
        last = str(int(mine["step"].max())) if len(mine) else "none (no step was flushed)"
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
        written, readable = info.get("records_written"), len(mine)
        if isinstance(written, int) and readable < written:
            steps_written = info.get("steps_written")
            report.problems.append(
                f"rank {rank} wrote {written} records of {steps_written} step(s), but only "
                f"{readable} of {mine['step'].nunique()} step(s) are readable: files were "
                "deleted or damaged"
            )


def _check_segments(trace: Trace, rows: pd.DataFrame, report: CheckReport) -> None:
    located = rows[rows["segment"].notna()]
    root = trace.path.resolve()
    for segment, group in located.groupby(located["segment"].astype(str), sort=True):
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
            damage = _segment_damage(path, group, unreadable)
        except Exception as exc:  # h5py raises OSError, KeyError, RuntimeError, ...
            damage = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        if damage:
            report.problems.append(f"segment {segment} is damaged ({damage}): its data is lost")
        elif unreadable:
            report.problems.append(
                f"segment {segment}: {len(unreadable)} full tensor(s) cannot be read "
                f"({_listed(unreadable)}): those are lost, the rest of the segment reads"
            )


def _segment_damage(path: Path, rows: pd.DataFrame, unreadable: list[str]) -> str | None:
    """What makes the whole segment unreadable, if anything; the full tensors that cannot be
    read on their own are added to ``unreadable``."""
    if not path.is_file():
        return "not a regular file"
    with h5py.File(path, "r") as f:
        with_units = rows[rows["units"] > 0]
        if len(with_units):
            activity = f["activity"]
            if not isinstance(activity, h5py.Dataset) or activity.dtype.kind not in "iu":
                return "/activity is not an integer array"
            size = len(activity[()])
            ends = with_units["activity_offset"] + with_units["units"]
            if (with_units["activity_offset"] < 0).any() or int(ends.max()) > size:
                return f"records point past the end of /activity ({size} counts)"
        for key in rows.loc[rows["tensor_key"] != "", "tensor_key"].astype(str):
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
    rows: pd.DataFrame, table: pd.DataFrame, modules: pd.DataFrame, report: CheckReport
) -> None:
    recorded = set(zip(rows["rank"], rows["step"], strict=True))
    listed = set(zip(table["rank"], table["step"], strict=True)) if not table.empty else set()
    if recorded - listed:
        report.problems.append(
            f"{len(recorded - listed)} step(s) have records but no row in the steps table: "
            "their micro-steps, skipped flag and times are lost"
        )
    named = rows.loc[~rows["kind"].isin(["tensor", "grad_tensor"]), ["rank", "module"]]
    seen = set(zip(named["rank"], named["module"].astype(str), strict=True))
    known = (
        set(zip(modules["rank"], modules["module"].astype(str), strict=True))
        if not modules.empty
        else set()
    )
    if seen - known:
        report.problems.append(
            f"{len(seen - known)} module(s) have records but no row in the modules table: "
            "their type, root and parent are lost"
        )
    dropped = int(table["dropped"].sum()) if not table.empty else 0
    if dropped:
        report.notes.append(f"{dropped} full tensor(s) were not saved: larger than max_tensor_mb")
    skipped_steps = int(table["skipped"].sum()) if not table.empty else 0
    if skipped_steps:
        report.notes.append(
            f"{skipped_steps} optimizer step(s) were skipped (e.g. by a GradScaler)"
        )
