"""The run directory a recording writes into: made ready, cleared of an earlier recording
of this rank, and the manifest that says what recorded it.

Apart from the recorder because none of it runs while recording: it is set-up, done once
before the first hook, and what a rank may remove under torchrun is a question of its own.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from hooktrace.errors import ConfigError
from hooktrace.trace import schema
from hooktrace.trace.captures import CAPTURES_DIR
from hooktrace.trace.histograms import HISTOGRAMS_DIR

_RANK_DIRS = (schema.RECORDS_DIR, schema.STEPS_DIR, schema.MODULES_DIR, schema.TENSORS_DIR)
_TRACE_ENTRIES = frozenset(
    (*_RANK_DIRS, CAPTURES_DIR, HISTOGRAMS_DIR, schema.STATUS_DIR, schema.MANIFEST)
)


def prepare_out(out: Path, *, rank: int, overwrite: bool) -> None:
    """Make ``out`` ready for this rank's trace; refuse a file, a directory of other files
    (a trace would be written in among them), or a trace already there unless
    ``overwrite``."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file: give a directory for the trace")
    others = _other_files(out)
    if others:
        listed = ", ".join(others[:3]) + (", ..." if len(others) > 3 else "")
        raise ConfigError(
            f"{out} holds other files ({listed}) and no trace: give a new or empty directory "
            "for the trace"
        )
    if not overwrite and _earlier_trace(out, rank):
        raise ConfigError(
            f"{out} already holds a trace: choose another output directory, delete it, or "
            "overwrite it (hooktrace record --overwrite; overwrite=True in Python)"
        )
    if overwrite:
        clear_trace(out, rank=rank, world_size=world_size())
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create {out}: {exc.strerror}; choose a writable directory"
        ) from exc


def _earlier_trace(out: Path, rank: int) -> bool:
    """Whether ``out`` holds a trace an earlier run wrote, as this rank sees it. Rank 0 writes
    the manifest, so any manifest is an earlier one; another rank may find this run's, just
    written by rank 0, and goes by what only an earlier run can have left: its own status,
    or a manifest older than this process (a run of fewer ranks). Each rank refuses by
    itself: rank 0 alone refusing left the others to write over the earlier trace's parts."""
    manifest = out / schema.MANIFEST
    if rank == 0:
        return manifest.exists()
    if (out / schema.STATUS_DIR / f"rank={rank}.json").exists():
        return True
    try:
        written = json.loads(manifest.read_text())["start_time"]
    except (OSError, ValueError, KeyError, TypeError):
        return False  # none yet, or rank 0 is writing it
    started = _process_start()
    return (
        started is not None
        and isinstance(written, (int, float))
        and written < started - _CLOCKS_APART_S
    )


_CLOCKS_APART_S = 300.0
"""How much older than this process rank 0's manifest must be to be an earlier run's: rank 0
may run on another machine, with another clock, and this process may have started after it
wrote its manifest (a slow container's start)."""


def _process_start() -> float | None:
    """When this process started (seconds since the epoch), where the system says."""
    try:
        fields = Path("/proc/self/stat").read_text().rpartition(")")[2].split()
        ticks = int(fields[19])  # starttime: field 22, in clock ticks after boot
        boot = next(
            float(line.split()[1])
            for line in Path("/proc/stat").read_text().splitlines()
            if line.startswith("btime ")
        )
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def _other_files(out: Path) -> list[str]:
    """The names in ``out`` that no recording writes, sorted, where it holds no trace: a
    directory of the user's own. Hidden names (``.gitkeep``) do not count. A trace is there
    where a manifest is, or a rank's part of one (another rank's, being written now); a
    folder of a trace's name is one of its parts only if it holds nothing but ranks' parts
    (a project's ``modules/`` package is the user's)."""
    try:
        entries = [p for p in out.iterdir() if not p.name.startswith(".")]
    except OSError:  # missing, or unreadable: mkdir below says what is wrong
        return []
    kept: set[str] = set()  # the trace's parts among them
    trace = False
    for entry in entries:
        if entry.name == schema.MANIFEST:
            kept.add(entry.name)
            trace = True
        elif entry.name in _TRACE_ENTRIES and entry.is_dir():
            try:
                ranks = [c.name.startswith("rank=") for c in entry.iterdir()]
            except OSError:
                continue
            if all(ranks):  # (empty: being made, its rank's part next)
                kept.add(entry.name)
                trace = trace or bool(ranks)
    others = sorted(e.name for e in entries if e.name not in kept)
    return [] if trace else others


def clear_trace(out: Path, *, rank: int, world_size: int) -> None:
    """Remove what an earlier recording left of this rank; rank 0 also removes the manifest
    and the ranks beyond this run's. Each rank removes its own only: under torchrun, rank 0
    removing every rank's folders killed the writer of a rank that had begun writing."""
    ranks = {rank} | (set() if rank else ranks_in(out) - set(range(world_size)))
    for name in (*_RANK_DIRS, CAPTURES_DIR, HISTOGRAMS_DIR):
        for r in ranks:
            shutil.rmtree(out / schema.rank_dir(name, r), ignore_errors=True)
    for r in ranks:
        (out / schema.STATUS_DIR / f"rank={r}.json").unlink(missing_ok=True)
    if rank == 0:
        (out / schema.MANIFEST).unlink(missing_ok=True)


def ranks_in(out: Path) -> set[int]:
    found = set()
    for path in out.glob("*/rank=*"):
        number = path.name.removeprefix("rank=").removesuffix(".json")
        if number.isdigit():
            found.add(int(number))
    return found


def rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def manifest(
    *, config: dict[str, Any], roots: list[str], command: list[str] | None
) -> dict[str, Any]:
    """The run's manifest (docs/FORMAT.md): written by rank 0 when its writer starts."""
    return {
        "format": schema.FORMAT_NAME,
        "format_version": schema.FORMAT_VERSION,
        "hooktrace_version": _version(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "command": command if command is not None else list(sys.argv),
        "config": config,
        "roots": roots,
        "start_time": time.time(),
        "world_size": world_size(),
    }


def describe(spec: Any) -> Any:
    """An option as the manifest's config holds it: JSON, a function by its name."""
    if spec is None or isinstance(spec, (str, int, float, bool)):
        return spec
    if callable(spec):
        return f"<function {getattr(spec, '__qualname__', repr(spec))}>"
    try:
        return [describe(s) if not isinstance(s, range) else str(s) for s in spec]
    except TypeError:
        return repr(spec)


def _version() -> str:
    from hooktrace.package import __version__

    return __version__
