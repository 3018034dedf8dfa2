"""``hooktrace replay RUN --nonfinite``: the calls where a NaN or Inf began, as the recorder
captured them, one block each."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from hooktrace.analyze.checks.captured import (
    described,
    failed_captures,
    known,
    replay_command,
    why_none,
)
from hooktrace.errors import TraceError

if TYPE_CHECKING:
    import pandas as pd

    from hooktrace.trace.reader import Trace

_WIDTH = 11  # the labels' column


def render_captures(
    trace: Trace, captures: pd.DataFrame, *, rank: int | None, step: int | None
) -> str:
    """The captures of ``trace`` (rows of ``nonfinite_captures()``, already filtered to
    ``rank`` and ``step``) as text; one line saying why when there is none."""
    failed = failed_captures(trace, rank=rank)
    if captures.empty:
        return _none(trace, rank=rank, step=step) + "\n"
    on = f" on rank {rank}" if rank is not None else ""
    at = f" at step {step}" if step is not None else ""
    lines = [f"{trace.path}: {_count(len(captures), 'non-finite capture')}{on}{at}"]
    for row in captures.to_dict("records"):
        info = trace.capture_info(int(row["capture"]), rank=int(row["rank"]))
        lines += ["", *_block(trace.path, row, info)]
    if failed:
        lines += ["", f"{_count(failed, 'more capture')} failed while the run was recorded "
                  "(the recording's warnings say why)"]  # fmt: skip
    return "\n".join(lines) + "\n"


def step_lines(trace: Trace, run: Path, *, step: int, rank: int) -> list[str]:
    """For the step view: a line per capture taken at ``step``, with the command that shows
    it; none where the step has none (or its captures cannot be read: the step view holds)."""
    try:
        captures = trace.nonfinite_captures(rank=rank)
    except TraceError:
        return []
    at = captures[captures["step"] == step]
    return [
        f"captured: {row['pass']} of {row['module']!r} (call {row['call']}, micro-step "
        f"{row['micro_step']}): {described(row)}; {replay_command(run, rank=rank)} --step {step}"
        for row in at.to_dict("records")
    ]


def _none(trace: Trace, *, rank: int | None, step: int | None) -> str:
    if step is not None:
        held = trace.nonfinite_captures(rank=rank)
        if not held.empty:
            steps = ", ".join(str(s) for s in sorted(set(held["step"].tolist())))
            return (
                f"{trace.path} holds no non-finite capture at step {step} (it holds some at "
                f"step(s) {steps}): leave --step out to see them"
            )
    return why_none(trace, rank=rank)


def _block(run: Path, row: dict[Any, Any], info: dict[str, Any]) -> list[str]:
    analysis = info.get("analysis") or {}
    found = row["analysis"] == "found"
    lines = [
        f"capture {row['capture']}, rank {row['rank']}: step {row['step']}, micro-step "
        f"{row['micro_step']}, {row['phase']}, {row['pass']} pass",
        _field("module", f"{row['module']} ({row['module_type']}), call {row['call']}"),
        _field("trigger", str(row["trigger"])),
    ]
    if found:
        lines.append(_field("operation", described({**row, "file": None})))
        if known(row["file"]):
            line = f":{int(row['line'])}" if known(row["line"]) else ""
            function = f", in {row['function']}" if known(row["function"]) else ""
            backward = " (its backward ran the operation)" if known(row["node"]) else ""
            lines.append(_field("line", f"{row['file']}{line}{function}{backward}"))
            if known(row["code"]):
                lines.append(_field("", f"  {row['code']}"))
        else:
            lines.append(_field("line", "unknown (no frame of the model's code was running)"))
    else:
        message = analysis.get("message") or "no message"
        lines.append(_field("operation", f"not named ({row['analysis']}): {message}"))
    lines.append(_field("standalone", _standalone(row, found)))
    lines += _op_inputs(analysis.get("op_inputs") or [])
    lines += _left_out(info.get("left_out") or [])
    rank = f", rank={row['rank']}" if row["rank"] else ""
    lines.append(
        _field(
            "in Python",
            f"hooktrace.replay_module({str(run)!r}, {row['module']!r}, module=<your module>, "
            f"capture={row['capture']}{rank})",
        )
    )
    return lines


def _standalone(row: dict[Any, Any], found: bool) -> str:
    if row["reproduces"] and found:
        return "reproduces: run again on the captured tensors, the value comes out again"
    if row["reproduces"]:
        return "reproduces, though no single aten operation made a new NaN or Inf"
    return "does not reproduce on the captured tensors alone (the RNG, or state changed earlier)"


def _op_inputs(inputs: list[dict[str, Any]]) -> list[str]:
    """The statistics of the operation's inputs that explain a NaN or an Inf: zeros (log,
    division), negatives (sqrt, log), the smallest magnitude (overflow of 1/x), the range."""
    if not inputs:
        return []
    lines = []
    for i, stats in enumerate(inputs):
        label = "op inputs" if i == 0 else ""
        lines.append(_field(label, f"{i}: {_tensor(stats)}"))
    return lines


def _tensor(stats: dict[str, Any]) -> str:
    shape = "x".join(str(n) for n in stats.get("shape") or []) or "scalar"
    text = f"{stats.get('dtype', '?')} {shape}"
    numel = stats.get("numel")
    if numel is None:
        return text
    if stats.get("min") is None:
        text += ", no finite value"
    else:
        text += f", range {_number(stats['min'])} to {_number(stats['max'])}"
    if stats.get("smallest_nonzero") is not None:
        text += f", smallest nonzero {_number(stats['smallest_nonzero'])}"
    text += (
        f", zeros {stats.get('zeros', 0)}/{numel}, negatives {stats.get('negatives', 0)}/{numel}"
    )
    for key, name in (("nan", "NaN"), ("inf", "Inf")):
        if stats.get(key):
            text += f", {name} {stats[key]}/{numel}"
    return text


def _left_out(entries: list[dict[str, Any]]) -> list[str]:
    if not entries:
        return [_field("left out", "none: every tensor of the call was saved")]
    lines = []
    for i, entry in enumerate(entries):
        shape = "x".join(str(n) for n in entry.get("shape") or []) or "scalar"
        size = entry.get("bytes")
        text = (
            f"{entry.get('group', '?')} {entry.get('name', '?')} ({entry.get('dtype', '?')} "
            f"{shape}{f', {size:,} bytes' if isinstance(size, int) else ''}): "
            f"{entry.get('why', 'not saved')}"
        )
        lines.append(_field("left out" if i == 0 else "", text))
    return lines


def _field(label: str, text: str) -> str:
    return f"  {label:<{_WIDTH}} {text}"


def _number(value: Any) -> str:
    return f"{float(value):.4g}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
