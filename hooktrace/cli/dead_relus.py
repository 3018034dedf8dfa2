"""``hooktrace dead-relus RUN``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from hooktrace.cli.anomalies import fail_option, steps_option
from hooktrace.cli.common import (
    emit_frame,
    library_errors,
    listed,
    output_options,
    require_steps,
    run_argument,
)

if TYPE_CHECKING:
    import pandas as pd

    from hooktrace.analyze.checks.dead_units import DeadUnits


@click.command("dead-relus")
@run_argument()
@steps_option
@click.option(
    "--threshold",
    type=float,
    default=1e-3,
    show_default=True,
    help="A unit positive in less than this fraction of its values at a step is below it.",
)
@click.option(
    "--layer-threshold",
    type=float,
    default=0.25,
    show_default=True,
    help="Flag a layer whose dead fraction passes this.",
)
@click.option(
    "--min-steps",
    type=int,
    default=3,
    show_default=True,
    help="Recorded steps a unit must stay below the threshold to be dead.",
)
@click.option(
    "--phase",
    type=click.Choice(["train", "eval", "all"]),
    default="train",
    show_default=True,
    help="Which forward passes count.",
)
@click.option(
    "--units",
    "list_units",
    is_flag=True,
    help="List the dead units (the units table, in csv/json).",
)
@click.option(
    "--ranks",
    metavar="RANKS",
    help="Only these ranks' outputs, comma-separated (one rank: its own units).",
)
@fail_option("a layer is flagged")
@output_options
@library_errors
def dead_relus(
    run: Path,
    steps: str | None,
    threshold: float,
    layer_threshold: float,
    min_steps: int,
    phase: str,
    list_units: bool,
    ranks: str | None,
    fail: bool,
    fmt: str,
    output: Path | None,
) -> None:
    """Dead units of every ReLU-family layer of RUN, worst layer first, and since when.

    A unit (a channel of (N, C, ...) outputs, a feature otherwise) is dead when it was positive
    in less than --threshold of its values at every step from some step to the last. A layer
    is flagged when its dead fraction passes --layer-threshold. In a run of several ranks a
    unit's values are those of every rank: the data-parallel ranks' batches, and, where the
    recording told the ranks' places (DDP, FSDP2, tensor parallelism), tensor-parallel peers' parts of a layer
    side by side (--ranks: only those ranks').

    \b
    Example:
      hooktrace dead-relus runs/cnn --units
      hooktrace dead-relus runs/cnn --fail --layer-threshold 0.5
    """
    from hooktrace.analyze.checks.dead_units import dead_relus as find

    require_steps(run, steps)

    result = find(
        run,
        threshold=threshold,
        layer_threshold=layer_threshold,
        min_steps=min_steps,
        steps=steps,
        phases=None if phase == "all" else [phase],
        ranks=listed(ranks, int, "--ranks"),
    )
    frame = result.units if list_units else result.layers
    emit_frame(frame, fmt, output, table_text=render(run, result, list_units=list_units))
    if fail and len(result):
        sys.exit(1)


def render(run: Path, result: DeadUnits, *, list_units: bool) -> str:
    layers = result.layers
    if layers.empty:  # no ReLU-family module, or none whose activity the steps read hold
        what = "activity" if result.relu_modules else "layers"
        return "\n".join([f"no ReLU {what} to analyse in {run}", *result.notes]) + "\n"
    dead = int(layers["dead"].sum())
    lines = [
        f"{len(result.flagged)} of {len(layers)} ReLU layers flagged in {run}; {dead} dead units "
        f"(dead: positive in under {result.threshold:g} of values through the last step; "
        f"flagged: over {result.layer_threshold:.0%} dead)",
        "",
    ]
    names = [_layer_name(row, layers) for row in layers.to_dict("records")]
    width = max(len("layer"), *(len(n) for n in names))
    lines.append(
        f"{'layer':<{width}}  {'':<7}  {'type':<9} {'units':>6} {'dead':>6} {'dead %':>7}  "
        f"{'since':>11}  {'activity':>8}"
    )
    for name, row in zip(names, layers.to_dict("records"), strict=True):
        since = "-" if row["dead"] == 0 else _span(row["since"], row["last_since"])
        lines.append(
            f"{name:<{width}}  {'FLAGGED' if row['flagged'] else '':<7}  {row['type']:<9} "
            f"{row['units']:>6} {row['dead']:>6} {row['dead_fraction']:>7.1%}  {since:>11}  "
            f"{row['activity']:>8.1%}"
        )
        if list_units and row["dead"]:
            lines += _unit_lines(result.units, row["module"], row["call"], width)
    lines += [f"note: {note}" for note in result.notes]
    return "\n".join(lines) + "\n"


def _layer_name(row: dict[object, object], layers: pd.DataFrame) -> str:
    calls = int((layers["module"] == row["module"]).sum())
    return f"{row['module']}" + (f" [call {row['call']}]" if calls > 1 else "")


def _span(first: object, last: object) -> str:
    return f"{first}" if first == last else f"{first}–{last}"


def _unit_lines(units: pd.DataFrame, module: object, call: object, width: int) -> list[str]:
    mine = units[(units["module"] == module) & (units["call"] == call)]
    lines = []
    for since, group in mine.groupby("since", sort=True):
        lines.append(
            f"{'':<{width}}    since step {since}: units {_ranges(group['unit'].tolist())}"
        )
    return lines


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0–2, 5, 7–8'."""
    parts: list[str] = []
    start = previous = numbers[0]
    for n in [*numbers[1:], None]:
        if n is not None and n == previous + 1:
            previous = n
            continue
        parts.append(str(start) if start == previous else f"{start}–{previous}")
        if n is not None:
            start = previous = n
    return ", ".join(parts)
