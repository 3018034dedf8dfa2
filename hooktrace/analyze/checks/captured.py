"""What the non-finite captures of a run add to what the analyzer says. Never imports torch.

A capture (see :mod:`hooktrace.trace.captures`) is the call where a NaN or Inf began, saved in
full by the recorder and run again there to name the aten operation and the source line that
made it. Here: a capture in a few words (:func:`described`), the command that shows it
(:func:`replay_command`), which capture belongs to which non-finite finding
(:func:`capture_column`), and why a run holds none (:func:`why_none`).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from hooktrace.errors import TraceError
from hooktrace.trace.captures import FIELDS
from hooktrace.trace.reader import Trace
from hooktrace.trace.schema import parse_version

PASS_OF_KIND = {"nonfinite_forward": "forward", "nonfinite_backward": "backward"}
"""The findings a capture can explain, and the pass of the capture that does."""

FIRST_VERSION = (1, 2)
"""The trace format that brought captures."""


def read_captures(trace: Trace, notes: list[str]) -> pd.DataFrame:
    """``trace.nonfinite_captures()``, or an empty table and a note when a capture file cannot
    be read (the rest of an analysis goes on without them)."""
    try:
        return trace.nonfinite_captures()
    except TraceError as exc:
        notes.append(f"the non-finite captures were not read: {exc}")
        return pd.DataFrame(columns=list(FIELDS))


def described(capture: Mapping[Any, Any]) -> str:
    """A capture (a row of ``nonfinite_captures()``) in a few words: ``aten::log at
    model.py:12``, ``aten::div.Tensor in SqrtBackward0 at model.py:4``, or why no operation
    was named (``no operation named: not reproduced``)."""
    if capture.get("analysis") != "found" or not known(capture.get("op")):
        return f"no operation named ({capture.get('analysis') or 'not analysed'})"
    text = str(capture["op"])
    if known(capture.get("node")):
        text += f" in {capture['node']}"
    if known(capture.get("file")):
        line: Any = capture.get("line")
        text += f" at {capture['file']}" + (f":{int(line)}" if known(line) else "")
    return text


def replay_command(run: Path, *, rank: int = 0) -> str:
    """The shell command that shows a run's captures."""
    command = f"hooktrace replay {shlex.quote(str(run))} --nonfinite"
    return command + (f" --rank {rank}" if rank else "")


def failed_captures(trace: Trace, *, rank: int | None = None) -> int:
    """Captures that failed while the run was recorded (no file was written for them), from
    the status of ``rank`` (None: of every rank); 0 for traces that predate captures."""
    return _status_count(trace, "nonfinite_captures_failed", rank)


def why_none(trace: Trace, *, rank: int | None = None) -> str:
    """One line: why ``trace`` holds no non-finite capture (on ``rank``; None: on any)."""
    config = trace.manifest.get("config") or {}
    on = f" on rank {rank}" if rank is not None else ""
    failed = failed_captures(trace, rank=rank)
    if "capture_nonfinite" not in config or _version(trace) < FIRST_VERSION:
        reason = (
            f"it was recorded before captures existed (format {trace.format_version}); "
            "record it again to capture where a NaN or Inf begins"
        )
    elif not config["capture_nonfinite"] or config.get("capture_limit") == 0:
        setting = "capture_limit=0" if config["capture_nonfinite"] else "capture_nonfinite=False"
        reason = f"capture was off when it was recorded ({setting})"
    elif failed:
        reason = (
            f"{_count(failed, 'capture')} failed while it was recorded (the recording's "
            "warnings say why)"
        )
    elif _status_count(trace, "nonfinite_captures", rank):
        reason = "its status counts captures, but no capture file is there: run `hooktrace check`"
    else:
        reason = "no NaN or Inf began inside a recorded module while capture was on"
    return f"{trace.path} holds no non-finite capture{on}: {reason}"


def capture_column(findings: pd.DataFrame, captures: pd.DataFrame, run: Path) -> pd.Series:
    """For each finding (a row of a findings table), the capture that explains it, as a
    sentence with the command that shows it; "" where none does or for other kinds.

    A ``nonfinite_forward`` / ``nonfinite_backward`` finding takes a capture of the same pass,
    rank and steps (``step`` to ``last_step``), of its own module where one is; where the run
    holds captures only at other steps, the finding points at the earliest of them (of its
    own module where one is)."""
    texts = [""] * len(findings)
    if captures.empty:
        return pd.Series(texts, index=findings.index, dtype=object)
    for i, row in enumerate(findings.to_dict("records")):
        pass_ = PASS_OF_KIND.get(str(row["kind"]))
        if pass_ is None:
            continue
        rank, first, last = int(row["rank"]), int(row["step"]), int(row["last_step"])
        on_rank = captures[captures["rank"] == rank]
        same = on_rank[
            (on_rank["pass"] == pass_) & (on_rank["step"] >= first) & (on_rank["step"] <= last)
        ]
        if not same.empty:
            chosen = _first(same, str(row["module"]))
            where = "" if chosen["module"] == row["module"] else f" in {chosen['module']}"
            more = len(same) - 1
            text = f"captured{where}: {described(chosen)} (capture {chosen['capture']}"
            text += f", and {more} more in these steps)" if more else ")"
        else:
            chosen = _first(on_rank if not on_rank.empty else captures, str(row["module"]))
            steps = f"step {first}" if first == last else f"steps {first}–{last}"
            text = (
                f"not captured in {steps}; captured at step {chosen['step']} in "
                f"{chosen['module']} ({chosen['pass']}): {described(chosen)} "
                f"(capture {chosen['capture']})"
            )
        texts[i] = f"{text}; {replay_command(run, rank=int(chosen['rank']))}"
    return pd.Series(texts, index=findings.index, dtype=object)


def unmatched_note(findings: pd.DataFrame, captures: pd.DataFrame, run: Path) -> str | None:
    """A note for captures that no finding shown points at (e.g. the steps read leave out
    where the NaN began), or None."""
    if captures.empty or findings["kind"].isin(list(PASS_OF_KIND)).any():
        return None
    steps = ", ".join(str(s) for s in sorted(set(captures["step"].tolist())))
    return (
        f"the run holds {_count(len(captures), 'non-finite capture')} (step(s) {steps}): "
        f"{replay_command(run)}"
    )


def _first(captures: pd.DataFrame, module: str) -> dict[str, Any]:
    """The capture of ``module`` where one is, else the earliest."""
    order = captures.assign(_other=captures["module"] != module).sort_values(
        ["_other", "step", "rank", "capture"], kind="stable"
    )
    return dict(order.iloc[0])


def _status_count(trace: Trace, key: str, rank: int | None) -> int:
    total = 0
    for name, status in trace.manifest.get("ranks", {}).items():
        if rank is not None and str(rank) != name:
            continue
        value = status.get(key)
        total += value if isinstance(value, int) and not isinstance(value, bool) else 0
    return total


def _version(trace: Trace) -> tuple[int, int]:
    try:
        return parse_version(trace.format_version)
    except ValueError:
        return (0, 0)


def known(value: Any) -> bool:
    """Whether a field of a capture holds something (not None, NA, NaN or "")."""
    return value is not None and value is not pd.NA and value == value and value != ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
