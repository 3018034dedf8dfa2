"""Kills: recordings ended by SIGKILL, SIGTERM and SIGINT at seeded random moments.

A step is flushed once its records part is renamed into place, and parts only ever appear,
whole. So the parts listed just before a signal name the steps that must survive it: after
the process is gone, the trace must load without repair, hold every one of those steps with
as many records as a step of an undisturbed run, hold no partial step, and say it is not
whole. SIGKILL leaves status ``recording``; SIGTERM and SIGINT under ``hooktrace record``
(and SIGINT under ``hooktrace.record()``) finalize the trace as ``incomplete`` and say why.

Kill moments are drawn from a seeded generator: some before the first flush, most anywhere in
the run, and some as soon as an HDF5 segment of large full tensors is being written. Where
each one landed (before any flush, during a write, between writes) is read from what the
process left behind. The processes (see children.py) are forked, a few at a time, from a
forkserver that imported torch once.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

import hooktrace

from . import children
from .conftest import Figures
from .helpers import run_cli

SEED = 20261120
PARALLEL = 4
CONTEXT = children.forkserver()


@dataclass
class Kill:
    """One process, one signal, and what was on disk just before it."""

    name: str
    signum: int
    target: Callable[..., None]
    args: tuple[object, ...]
    run: Path
    ready: Path
    delay: float = 0.0  # seconds after `after`
    after: str = "ready"  # "ready" (recording began), "first flush", or "segment write"
    flushed: list[Path] = field(default_factory=list)
    exitcode: int | None = None


def _parts(run: Path) -> list[Path]:
    return sorted((run / "records" / "rank=0").glob("part-*.parquet"))


def _tmp_files(run: Path) -> list[Path]:
    return sorted(run.glob("**/.*.tmp"))


# Process.start() polls every other child of this process (multiprocessing.process._cleanup),
# and a poll reads the exit status that the forkserver writes once: a start in one thread and a
# join in another can both read it, and the one left at EOF records exit code 255 instead of
# -9 (about 1 kill in 100 with four threads). Every call that polls holds this lock; waiting
# for a process to end is done on its sentinel, outside it.
_POLLING = threading.Lock()


def _start(process: BaseProcess) -> None:
    with _POLLING:
        process.start()


def _alive(process: BaseProcess) -> bool:
    with _POLLING:
        return process.is_alive()


def _wait(process: BaseProcess, timeout: float | None) -> int | None:
    """The exit code once the process has ended, None if it is still running at timeout."""
    connection.wait([process.sentinel], timeout)
    with _POLLING:
        return process.exitcode


def _execute(kill: Kill) -> Kill:
    process = CONTEXT.Process(target=kill.target, args=kill.args, daemon=True)
    _start(process)
    assert process.pid is not None
    deadline = time.monotonic() + 60
    while not kill.ready.exists() and _alive(process) and time.monotonic() < deadline:
        time.sleep(0.002)
    if kill.ready.exists():
        tensors = kill.run / "tensors" / "rank=0"
        while time.monotonic() < deadline and (
            (kill.after == "first flush" and not _parts(kill.run))
            or (kill.after == "segment write" and not list(tensors.glob(".seg-*.tmp")))
        ):
            time.sleep(0.0005)
        time.sleep(kill.delay)
        kill.flushed = _parts(kill.run)  # parts appear whole and never go away
        os.kill(process.pid, kill.signum)
    kill.exitcode = _wait(process, 120)
    if kill.exitcode is None:
        process.kill()
        kill.exitcode = _wait(process, None)
    return kill


def _run_all(kills: list[Kill]) -> list[Kill]:
    with ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(_execute, kills))


def _steps_in(parts: list[Path]) -> set[int]:
    return {
        int(s) for part in parts for s in pq.read_table(part, columns=["step"])["step"].to_pylist()
    }


def _where(kill: Kill) -> str:
    if _tmp_files(kill.run):
        return "during a write"
    if not kill.flushed:
        return "before the first flush"
    return "between writes"


def _verify(kill: Kill, per_step: int, *, final_status: str, reason: str) -> tuple[list[str], int]:
    """What is wrong with the trace a signal left, and how many flushed steps it lost.

    A trace finalized after SIGTERM or SIGINT also holds the step the signal interrupted,
    with the records taken before it: only that last step may have fewer."""
    problems = []
    trace = hooktrace.load(kill.run)
    records = trace.records
    counts = records.groupby("step").size()
    flushed = _steps_in(kill.flushed)
    lost = sorted(s for s in flushed if counts.get(s, 0) != per_step)
    if lost:
        problems.append(f"flushed steps lost or partial: {lost}")
    interrupted = int(counts.index.max()) if final_status != "recording" and len(counts) else None
    partial = {
        int(s): int(n)  # type: ignore[call-overload]
        for s, n in counts.items()
        if n != per_step and s != interrupted
    }
    if partial:
        problems.append(f"steps that are not whole: {partial} (a step has {per_step} records)")
    if interrupted is not None and counts[interrupted] > per_step:
        problems.append(f"the interrupted step {interrupted} has too many records")
    if trace.skipped:
        problems.append(f"unreadable files: {trace.skipped}")
    if trace.status != final_status:
        problems.append(f"status {trace.status}, not {final_status}")
    error = trace.manifest["ranks"]["0"].get("error") or ""
    if reason not in error:
        problems.append(f"the status does not say {reason!r}: {error!r}")
    for row in records[records["tensor_key"] != ""].head(6).itertuples():
        step = int(row.step)  # type: ignore[arg-type]
        array = trace.tensor(str(row.module), str(row.kind), step=step, slot=str(row.slot))
        if array.size != row.numel:
            problems.append(
                f"full tensor {row.module} {row.kind} step {row.step}: {array.size} values"
            )
    if len(records) and len(pd.read_parquet(kill.run / "records")) != len(records):
        problems.append("pandas, without hooktrace, reads another number of records")
    check = run_cli(["check", str(kill.run)])
    if check.code != 1 or "INCOMPLETE" not in check.stdout:
        problems.append(f"check does not say the trace is not whole:\n{check}")
    return problems, len(lost)


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("script") / "train.py"
    path.write_text(children.SCRIPT)
    return path


@pytest.fixture(scope="module")
def records_per_step(tmp_path_factory: pytest.TempPathFactory) -> dict[str, int]:
    """Records per step of runs nobody disturbed, for each mode."""
    counts = {}
    for mode in ("small", "big"):
        folder = tmp_path_factory.mktemp("undisturbed")
        process = CONTEXT.Process(
            target=children.train, args=(str(folder / "run"), 4, mode, str(folder / "ready"))
        )
        process.start()
        process.join(120)
        assert process.exitcode == 0
        per_step = hooktrace.load(folder / "run").records.groupby("step").size()
        assert len(per_step) == 4 and per_step.nunique() == 1, per_step
        counts[mode] = int(per_step.iloc[0])
    return counts


def test_sigkill_at_random_moments_loses_no_flushed_step(
    records_per_step: dict[str, int], tmp_path: Path, figures: Figures
) -> None:
    rng = random.Random(SEED)
    kills = []
    for i in range(24):
        if i < 4:
            mode, after, delay = "small", "ready", rng.uniform(0.0, 0.05)  # before a flush
        elif i < 19:
            mode, after, delay = "small", "first flush", rng.uniform(0.0, 1.5)
        else:
            mode, after, delay = "big", "segment write", 0.0
        folder = tmp_path / f"kill-{i:02d}"
        folder.mkdir()
        run, ready = folder / "run", folder / "ready"
        args = (str(run), 100_000, mode, str(ready))
        kills.append(
            Kill(f"{mode} {i}", signal.SIGKILL, children.train, args, run, ready, delay, after)
        )
    failures = []
    for kill in _run_all(kills):
        where = _where(kill)
        mode = kill.name.split()[0]
        with figures.case("kills", f"SIGKILL {where}") as case:
            assert kill.exitcode == -signal.SIGKILL, kill
            problems, case.lost = _verify(
                kill, records_per_step[mode], final_status="recording", reason=""
            )
            if problems:
                failures.append(f"{kill.name} ({where}): " + "; ".join(problems))
            assert not problems
    assert len(kills) >= 20
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_finalize_the_trace(
    signum: int, script: Path, records_per_step: dict[str, int], tmp_path: Path, figures: Figures
) -> None:
    rng = random.Random(SEED + signum)
    name = signal.Signals(signum).name
    kills = []
    for i in range(4):  # an unmodified script under `hooktrace record`
        folder = tmp_path / f"record-{i}"
        folder.mkdir()
        run, ready = folder / "run", folder / "ready"
        args: tuple[object, ...] = (str(run), str(script), 100_000, str(ready))
        delay, after = rng.uniform(0, 1.0), "ready" if i % 2 else "first flush"
        kills.append(
            Kill("hooktrace record", signum, children.record_script, args, run, ready, delay, after)
        )
    if signum == signal.SIGINT:  # KeyboardInterrupt through hooktrace.record()'s context
        for i in range(2):
            folder = tmp_path / f"api-{i}"
            folder.mkdir()
            run, ready = folder / "run", folder / "ready"
            args = (str(run), 100_000, "small", str(ready))
            delay, after = rng.uniform(0, 1.0), "first flush"
            kills.append(
                Kill("hooktrace.record()", signum, children.train, args, run, ready, delay, after)
            )
    failures = []
    for kill in _run_all(kills):
        with figures.case("kills", f"{name} ({kill.name})") as case:
            # ended as without hooktrace: by the signal itself, or (KeyboardInterrupt out of a
            # multiprocessing target) exit code 1
            assert kill.exitcode in (-signum, 1), kill
            reason = name if kill.name == "hooktrace record" else "KeyboardInterrupt"
            problems, case.lost = _verify(
                kill, records_per_step["small"], final_status="incomplete", reason=reason
            )
            if problems:
                failures.append(f"{kill.name}: " + "; ".join(problems))
            assert not problems
    assert not failures, "\n".join(failures)
