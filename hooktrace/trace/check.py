"""Is a trace whole, and if not, what was lost? Never imports torch.

``check`` reads every Parquet part in full, a batch at a time (so a damaged page anywhere is
found, not only in the columns an analysis happens to read, and memory stays bounded whatever
the trace's size), compares what is readable with what each rank's status says was written,
and opens every HDF5 segment a record points to: the per-unit activity is read in full, and
every full tensor a record points to is read, a block at a time (a trace can hold far more of
them than memory), and its bytes checked against the CRC-32 the writer stored with it.

This module draws the verdict; the Parquet parts are read in
:mod:`hooktrace.trace.check_parts`, the HDF5 files in :mod:`hooktrace.trace.check_segments`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from hooktrace.errors import TraceWarning
from hooktrace.trace import schema
from hooktrace.trace.check_parts import Seen, read_part
from hooktrace.trace.check_segments import MAX_LISTED, check_captures, check_segments
from hooktrace.trace.reader import Trace, load
from hooktrace.trace.threads import read_in_threads


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
        seen = Seen()
        for kind_dir, parts in trace._parts.items():
            read = functools.partial(read_part, kind_dir=kind_dir)
            with contextlib.closing(read_in_threads(read, list(parts))) as reads:
                for part, found in reads:
                    if isinstance(found, (OSError, ValueError, pa.ArrowException)):
                        trace._drop(kind_dir, part, found)
                    elif isinstance(found, Exception):
                        raise found
                    elif found is not None:
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
    check_segments(trace.path, seen, report.problems)
    check_captures(trace.path, trace.manifest["ranks"], report.problems, report.notes)
    _check_tables(seen, table, modules, report)
    written = int(table["step"].nunique()) if not table.empty else 0
    if written and not seen.records and not trace.skipped:
        selected = int(modules["module"].nunique()) if not modules.empty else 0
        config = trace.manifest.get("config") or {}
        report.notes.append(nothing_recorded(config, written, selected))
    return report


def nothing_recorded(config: dict[str, Any], written: int, modules: int) -> str:
    """Why a trace whose ``written`` steps are all readable holds no record, given the
    recording's options (its manifest's ``config``) and the number of ``modules`` it selected
    (its modules table): what ``summary`` and ``check`` say, where a trace without records
    would read as damaged."""
    chosen = "; ".join(
        f"{o} {config[o]!r}" for o in ("modules", "exclude") if config.get(o) is not None
    )
    if not modules and chosen:
        return (
            f"{written} step(s) written hold no record: the recording's {chosen} left no "
            "module of its models (names as in [n for n, _ in model.named_modules()])"
        )
    return (
        f"{written} step(s) written hold no record: none of the {modules} module(s) it "
        "selected was called"
    )


def _note_not_summarised(seen: Seen, report: CheckReport) -> None:
    """Records without statistics, because hooktrace could not summarise their tensor: not a
    loss (each has its record, with the reason), but worth knowing."""
    if not seen.skipped:
        return
    ordered = sorted(
        seen.skipped.items(), key=lambda item: (-item[1], item[0])
    )  # the same order always
    listed = "; ".join(f"{reason} ({n:,})" for reason, n in ordered)
    report.notes.append(f"{sum(seen.skipped.values()):,} records hold no statistics: {listed}")


def _check_ranks(trace: Trace, seen: Seen, report: CheckReport) -> None:
    world = int(trace.manifest.get("world_size", 1) or 1)
    statuses = trace.manifest["ranks"]
    silent = world - sum(1 for r in statuses if int(r) < world)
    listed = 0
    rank = 0
    while listed < min(silent, MAX_LISTED):  # never walks all of a huge world_size
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
        when = f"after step {mine[-1]}" if mine else "before any step was flushed"
        if status == schema.STATUS_RECORDING:
            lost = f"steps after {mine[-1]} are lost" if mine else "no step was flushed"
            report.problems.append(f"rank {rank} did not finish (still running, or killed): {lost}")
            continue  # its counts were written when it started
        if status in (schema.STATUS_FAILED, schema.STATUS_INCOMPLETE):
            why = " ".join(str(info.get("error") or "no reason given").split())
            report.problems.append(f"rank {rank} is {status} {when}: {why}")
        if info.get("steps_lost"):
            report.problems.append(
                f"rank {rank} lost {info['steps_lost']} step(s) the writer could not write"
            )
        written, readable = info.get("records_written"), seen.records[rank]
        if isinstance(written, int) and readable < written:
            steps_written = info.get("steps_written")
            report.problems.append(
                f"rank {rank} wrote {written} records of {steps_written} step(s), but only "
                f"{readable} records, of {len(mine)} step(s), are readable: files were "
                "deleted or damaged"
            )


def _check_tables(
    seen: Seen, table: pd.DataFrame, modules: pd.DataFrame, report: CheckReport
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
