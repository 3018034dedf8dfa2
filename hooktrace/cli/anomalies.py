"""``hooktrace anomalies RUN``, and the options the finding commands share."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from hooktrace.cli.common import (
    emit_frame,
    library_errors,
    output_options,
    per_rank_option,
    require_steps,
    run_argument,
)

if TYPE_CHECKING:
    from hooktrace.analyze.checks.anomalies import Anomalies

F = TypeVar("F", bound=Callable[..., Any])


def steps_option(func: F) -> F:
    return click.option(
        "--steps",
        metavar="RANGE",
        help="Read only these steps: '5', '0-100' or '100-' (to the end).",
    )(func)


def fail_option(what: str) -> Callable[[F], F]:
    return click.option("--fail", is_flag=True, help=f"Exit 1 when {what} (for CI).")


@click.command()
@run_argument()
@steps_option
@click.option(
    "--window", type=int, default=20, show_default=True, help="Steps in the rolling baseline."
)
@click.option(
    "--spike-factor",
    type=float,
    default=10.0,
    show_default=True,
    help="A norm this many times its baseline is high.",
)
@click.option(
    "--explode-factor",
    type=float,
    default=100.0,
    show_default=True,
    help="High steps that reach this many times the baseline are exploding.",
)
@click.option(
    "--exploding-above",
    type=float,
    default=1e6,
    show_default=True,
    help="A gradient norm above this explodes, whatever its baseline.",
)
@click.option(
    "--vanishing-below",
    type=float,
    default=1e-7,
    show_default=True,
    help="A gradient norm below this (and above 0) vanishes.",
)
@click.option(
    "--saturation",
    type=float,
    default=0.95,
    show_default=True,
    help="Mean square of a tanh/sigmoid output (on [-1, 1]) from which it is saturated.",
)
@click.option(
    "--underflow-above",
    type=float,
    default=0.01,
    show_default=True,
    help="Flag a gradient when more than this fraction of its nonzero values lies below "
    "2^-24, which float16 flushes to zero (needs histograms).",
)
@click.option(
    "--overflow-above",
    type=float,
    default=0.0,
    show_default=True,
    help="Flag a tensor when more than this fraction of its nonzero values is 2^16 or more, "
    "which float16 makes Inf (needs histograms).",
)
@per_rank_option("Check the records")
@fail_option("there are findings")
@output_options
@library_errors
def anomalies(
    run: Path,
    steps: str | None,
    window: int,
    spike_factor: float,
    explode_factor: float,
    exploding_above: float,
    vanishing_below: float,
    saturation: float,
    underflow_above: float,
    overflow_above: float,
    per_rank: bool,
    fail: bool,
    fmt: str,
    output: Path | None,
) -> None:
    """NaN/Inf origins, exploding, vanishing and spiking gradients, and more, in RUN.

    Findings come worst first (error, warning, info), grouped by kind, each with its module,
    step, evidence and a one-line explanation. Statistics-only traces are enough. Where the
    recorder captured the call that made a NaN or Inf, its finding names the aten operation
    and the source line, and `hooktrace replay RUN --nonfinite` shows the capture. Where the
    run has histograms, gradients that float16 would flush to zero and values it would make
    Inf are found too (`hooktrace precision RUN` shows every tensor's fractions). A run of
    several ranks is checked as its logical tensors (shards and the data-parallel ranks'
    batches pooled, a replica once), and data-parallel replicas are compared rank with rank
    (replicas_differ); --per-rank checks each rank's records apart.

    \b
    Example:
      hooktrace anomalies runs/mlp --fail
      hooktrace anomalies runs/mlp --steps 8000- --format csv -o findings.csv
    """
    from hooktrace.analyze.checks.anomalies import anomalies as find

    require_steps(run, steps)
    result = find(
        run,
        steps=steps,
        window=window,
        spike_factor=spike_factor,
        explode_factor=explode_factor,
        exploding_above=exploding_above,
        vanishing_below=vanishing_below,
        saturation=saturation,
        underflow_above=underflow_above,
        overflow_above=overflow_above,
        per_rank=per_rank,
    )
    emit_frame(result.findings, fmt, output, table_text=render(run, result))
    if fail and len(result):
        sys.exit(1)


def render(run: Path, result: Anomalies) -> str:
    frame = result.findings
    scope = f"{result.steps} steps, {result.modules} modules"
    if result.logical:
        scope += "; the ranks' records as logical tensors, --per-rank for apart"
    if frame.empty:
        lines = [f"no anomalies in {run} ({scope})"]
    else:
        counts = frame["severity"].value_counts()
        names = {"error": "errors", "warning": "warnings", "info": "info"}
        parts = [f"{counts[s]} {names[s] if counts[s] > 1 else s}" for s in names if s in counts]
        lines = [f"{len(frame)} findings in {run} ({', '.join(parts)}; {scope})"]
        width = min(max(len(m) for m in frame["module"]), 40)
        ranks = frame["rank"].nunique() > 1
        for (severity, kind), group in frame.groupby(["severity", "kind"], sort=False):
            lines += ["", f"{str(severity).upper():<8}{kind} ({len(group)})"]
            lines += [_finding_lines(row, width, ranks) for row in group.to_dict("records")]
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def _finding_lines(row: dict[Any, Any], width: int, ranks: bool) -> str:
    step = (
        f"{row['step']}" if row["last_step"] == row["step"] else f"{row['step']}–{row['last_step']}"
    )
    where = f"step {step}" + (f" rank {row['rank']}" if ranks else "")
    lines = (
        f"  {where:<14} {row['module']:<{width}}  {row['evidence']}\n"
        f"  {'':<14} {'':<{width}}  {row['explanation']}"
    )
    if row.get("capture"):  # the call that made a NaN/Inf, caught by the recorder
        lines += f"\n  {'':<14} {'':<{width}}  {row['capture']}"
    return lines
