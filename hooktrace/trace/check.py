"""Is a trace whole, and if not, what was lost? Never imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import h5py

from hooktrace.trace import schema
from hooktrace.trace.reader import Trace, load


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
    trace = run if isinstance(run, Trace) else load(run)
    steps = trace.query(columns=["step", "segment"])
    n_steps = int(steps.drop_duplicates().shape[0] and steps["step"].nunique())
    report = CheckReport(path=trace.path, status=trace.status, steps=n_steps)

    world = int(trace.manifest.get("world_size", 1) or 1)
    statuses = trace.manifest["ranks"]
    for rank in range(world):
        info = statuses.get(str(rank))
        if info is None:
            report.problems.append(
                f"rank {rank} wrote no status: it never started or its status file is lost"
            )
            continue
        status = info.get("status")
        last = _last_step(trace, rank)
        if status == schema.STATUS_RECORDING:
            report.problems.append(
                f"rank {rank} did not finish (still running, or killed): steps after {last} are lost"
            )
        elif status in (schema.STATUS_FAILED, schema.STATUS_INCOMPLETE):
            why = info.get("error") or "no reason given"
            report.problems.append(f"rank {rank} is {status} after step {last}: {why}")
        if info.get("steps_lost"):
            report.problems.append(
                f"rank {rank} lost {info['steps_lost']} step(s) the writer could not write"
            )

    for skipped in trace.skipped:
        report.problems.append(f"unreadable, left out: {skipped}")
    for leftover in sorted(trace.path.glob("**/.*.tmp")):
        report.problems.append(
            f"interrupted write left {leftover.relative_to(trace.path)}: the steps it held are lost"
        )

    for segment in sorted(s for s in steps["segment"].dropna().astype(str).unique()):
        path = trace.path / segment
        if not path.exists():
            report.problems.append(
                f"segment {segment} is missing: its activity and full tensors are lost"
            )
            continue
        try:
            with h5py.File(path, "r"):
                pass
        except OSError as exc:
            report.problems.append(f"segment {segment} is unreadable ({exc}): its tensors are lost")

    table = trace.steps
    recorded = set(steps["step"].unique())
    listed = set(table["step"].unique()) if not table.empty else set()
    if recorded - listed:
        report.notes.append(
            f"{len(recorded - listed)} step(s) have records but no row in the steps table"
        )
    dropped = int(table["dropped"].sum()) if not table.empty else 0
    if dropped:
        report.notes.append(f"{dropped} full tensor(s) were not saved: larger than max_tensor_mb")
    skipped_steps = int(table["skipped"].sum()) if not table.empty else 0
    if skipped_steps:
        report.notes.append(
            f"{skipped_steps} optimizer step(s) were skipped (e.g. by a GradScaler)"
        )
    return report


def _last_step(trace: Trace, rank: int) -> str:
    steps = trace.query(columns=["step"], ranks=[rank])["step"]
    return str(int(steps.max())) if len(steps) else "none (no step was flushed)"
