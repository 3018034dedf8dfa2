"""``hooktrace summary RUN``."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hooktrace.cli.common import library_errors, run_argument

if TYPE_CHECKING:
    from hooktrace.analyze.overview.summary import Summary


@click.command()
@run_argument()
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
@library_errors
def summary(run: Path, as_json: bool) -> None:
    """What RUN recorded: steps, modules, kinds, sizes and status.

    \b
    Example:
      hooktrace summary runs/mlp
    """
    from hooktrace.analyze.overview.summary import summary as summary_of

    result = summary_of(run)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, default=str))
    else:
        click.echo(render(result), nl=False)


def _steps_line(s: Summary, span: str) -> str:
    if not s.steps and s.written_steps and s.damaged_parts:  # none readable: damaged parts
        return (
            f"steps     none readable of {s.written_steps} written ({s.micro_steps} "
            "micro-steps): their records are in damaged parts"
        )
    if not s.steps and s.written_steps:  # all readable, and holding nothing
        from hooktrace.trace.check import nothing_recorded

        return "steps     " + nothing_recorded(s.config, s.written_steps, s.modules)
    return (
        f"steps     {s.steps} {'trained' if s.micro_steps else 'recorded'} (steps {span}), "
        f"{s.micro_steps} micro-steps, {s.skipped_steps} skipped" + _evaluation_only(s)
    )


def render(s: Summary) -> str:
    span = f"{s.first_step}–{s.last_step}" if s.steps else "none"
    duration = f", {s.duration_s:.1f} s" if s.duration_s is not None else ""
    lines = [
        f"run       {s.path}",
        f"status    {s.status}{duration}" + (f"  ({s.error})" if s.error else ""),
        f"format    {s.format_version}; hooktrace {s.versions['hooktrace']}, torch {s.versions['torch']}, "
        f"python {s.versions['python']}",
    ]
    if s.command:
        lines.append(f"command   {shlex.join(s.command)}")  # as a shell would take it again
    lines += [
        f"ranks     {', '.join(map(str, s.ranks)) or 'none'}"
        + (f" (data-parallel {s.data_parallel})" if s.data_parallel is not None else ""),
        _steps_line(s, span),
        f"modules   {s.modules} (roots: {', '.join(s.roots) or '-'}"
        + (f"; only evaluated: {', '.join(s.evaluated_roots)}" if s.evaluated_roots else "")
        + ")",
        f"records   {s.records:,}"
        + "".join(
            (": " if i == 0 else ", ") + f"{k} {v:,}" for i, (k, v) in enumerate(s.kinds.items())
        ),
        *(
            [
                f"logical   {s.logical_records:,} records: the ranks' merged into logical tensors "
                "(what diff and query() answer with)"
            ]
            if s.logical_records is not None
            else []
        ),
        "phases    " + (", ".join(f"{k} {v:,}" for k, v in s.phases.items()) or "-"),
        f"tensors   {s.full_tensors:,} full tensors saved",
        f"histogram {_histograms(s)}",
        "on disk   " + ", ".join(f"{k} {_human(v)}" for k, v in s.bytes_on_disk.items()),
    ]
    if s.notes:
        lines.append("not recorded:")
        lines += _notes(s.notes, len(s.ranks))
    if not s.not_summarised.empty:
        total = int(s.not_summarised["records"].sum())
        lines.append(f"not summarised: {total:,} records (no statistics; the recording went on):")
        lines += [
            f"  {row.module} {row.kind}: {row.reason} ({row.records:,})"
            for row in s.not_summarised.head(10).itertuples()
        ]
    if not s.largest.empty:
        lines.append("most records:")
        lines += [f"  {row.module:<40} {row.records:>8,}" for row in s.largest.head(5).itertuples()]
    return "\n".join(lines) + "\n"


def _notes(notes: dict[int, list[str]], ranks: int) -> list[str]:
    """Each note once: plainly where every one of the run's ``ranks`` wrote it, else with
    the ranks that did."""
    by: dict[str, list[int]] = {}
    for rank, texts in notes.items():
        for text in texts:
            by.setdefault(text, []).append(rank)
    return [
        f"  {text}" if len(r) >= ranks else f"  rank {', '.join(map(str, r))}: {text}"
        for text, r in by.items()
    ]


def _histograms(s: Summary) -> str:
    if s.histogram_kinds is None:
        return "none (format 1.3 added them)"
    if not s.histogram_kinds:
        return "none (recorded with histograms off)"
    every = "every step" if s.histogram_every == 1 else f"every {s.histogram_every} steps"
    return f"{s.histograms:,} records of {', '.join(s.histogram_kinds)}, {every}"


def _evaluation_only(s: Summary) -> str:
    ended = (
        f"; step {s.ended_in_training} ended before its backward"
        if s.ended_in_training is not None
        else ""
    )
    if not s.evaluation_only:
        return ended
    listed = ", ".join(map(str, s.evaluation_only[:5])) + (
        ", ..." if len(s.evaluation_only) > 5 else ""
    )
    plural = "s" if len(s.evaluation_only) > 1 else ""
    return f"; evaluation only: step{plural} {listed}{ended}"


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"
