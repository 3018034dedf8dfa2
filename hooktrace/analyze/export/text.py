"""The text of an export to TensorBoard: what the run was and how it was exported, as
markdown that TensorBoard's text plugin renders (tables and code blocks). Never imports torch."""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any

from hooktrace.trace.reader import Trace

HISTOGRAMS = (
    "hooktrace's exponent histogram: one bucket per power of 2 of |x|, by sign, and one "
    "around 0 for the zeros. NaN and Inf are not in it: see the nan_count and inf_count scalars."
)
"""What a histogram holds: the export's text says it, and so does each histogram tag's
description."""


def texts(
    trace: Trace, rank: int, *, stats: Sequence[str], calls: str, logical: bool = False
) -> list[tuple[str, str]]:
    """(tag, markdown): the run's command, what recorded it and how it ended (``rank``'s
    status beside the run's), its recording options, and what this export shows
    (``logical``: the logical tensors of the ranks' records)."""
    manifest = trace.manifest
    status = manifest.get("ranks", {}).get(str(rank), {})
    command = manifest.get("command") or []
    run = [
        ("run", f"`{trace.path}`"),
        ("status", f"{trace.status} (rank {rank}: {status.get('status', 'unknown')})"),
        ("error", status.get("error") or ""),
        ("format", f"hooktrace {manifest.get('format_version', '?')}"),
        ("recorded with", f"hooktrace {manifest.get('hooktrace_version', '?')}, torch "
         f"{manifest.get('torch_version', '?')}, python {manifest.get('python_version', '?')}"),
        ("platform", manifest.get("platform", "")),
        ("roots", ", ".join(manifest.get("roots") or [])),
        ("world size", str(manifest.get("world_size", 1))),
        ("started", when(manifest.get("start_time"))),
        ("ended", when(status.get("end_time"))),
        ("steps written", str(status.get("steps_written", ""))),
        ("records written", str(status.get("records_written", ""))),
    ]  # fmt: skip
    config = [(k, _value(v)) for k, v in sorted((manifest.get("config") or {}).items())]
    export = [
        ("exported", f"{when(time.time())} by hooktrace {version()}"),
        ("statistics", ", ".join(stats)),
        ("tags", "`MODULE/KIND/SLOT/STAT` scalars, `MODULE/KIND/SLOT/histogram` histograms; "
         "the eval phase in the run `eval` beside"),
        ("calls", "each call its own series, `MODULE [call N]` after the first"
         if calls == "all" else "the first call of a module in a micro-step"),
        ("micro-steps", "the step's last"),
        *([("ranks", f"{', '.join(map(str, trace.ranks))} as logical tensors: shards and "
            "the data-parallel ranks' batches pooled, a replica once, partial sums left out; "
            "histograms summed over the parts")] if logical else []),
        ("scalars", "float32, as TensorBoard keeps them"),
        ("histograms", HISTOGRAMS),
    ]  # fmt: skip
    return [
        ("hooktrace/command", "```\n" + shlex.join(str(c) for c in command) + "\n```"),
        ("hooktrace/run", table(run, header=("run", ""))),
        ("hooktrace/config", table(config, header=("recording option", "value"))),
        ("hooktrace/export", table(export, header=("export", ""))),
    ]


def table(rows: list[tuple[str, str]], *, header: tuple[str, str]) -> str:
    """A two-column markdown table under ``header`` (markdown tables have one: an empty one
    shows as an empty row)."""
    lines = [f"| {_cell(header[0])} | {_cell(header[1])} |", "|---|---|"]
    for key, value in rows:
        lines.append(f"| {_cell(key)} | {_cell(str(value))} |")
    return "\n".join(lines)


def _value(value: Any) -> str:
    """A recording option as code: a string as it was given (a regex keeps its single
    backslashes), anything else as JSON (``null``, ``true``, lists)."""
    shown = value if isinstance(value, str) else json.dumps(value)
    return f"`{shown}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def when(timestamp: Any) -> str:
    """A Unix time as UTC, or "" for none."""
    if not isinstance(timestamp, int | float):
        return ""
    return datetime.fromtimestamp(float(timestamp), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def version() -> str:
    from hooktrace.package import __version__

    return __version__
