"""``hooktrace export tensorboard RUN LOGDIR``: a trace for another tool to show."""

from __future__ import annotations

from pathlib import Path

import click

from hooktrace.cli.anomalies import steps_option
from hooktrace.cli.common import (
    library_errors,
    listed,
    per_rank_option,
    require_steps,
    run_argument,
)
from hooktrace.cli.progress import ProgressBar

# hooktrace.analyze.export.tensorboard.STATS, repeated so that `hooktrace --help` needs no pandas
STATS = ("mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count")


@click.group()
def export() -> None:
    """Write a trace in another tool's format.

    \b
    Example:
      hooktrace export tensorboard runs/mlp tb/mlp && tensorboard --logdir tb
    """


@export.command("tensorboard")
@run_argument()
@click.argument("logdir", type=click.Path(file_okay=False, path_type=Path))
@steps_option
@click.option("--modules", metavar="REGEX", help="Only modules whose name matches this regex.")
@click.option("--kinds", help="Only these kinds, comma-separated: output,grad_output,param,...")
@click.option("--ranks", help="Only these ranks, comma-separated (a run per rank).")
@per_rank_option("Write the records")
@click.option(
    "--stats",
    help=f"The statistics shown as scalars, comma-separated. [default: all: {','.join(STATS)}]",
)
@click.option(
    "--calls",
    type=click.Choice(["first", "all"]),
    default="first",
    show_default=True,
    help="A module called several times in a micro-step: its first call, or each call "
    "('MODULE [call N]').",
)
@click.option(
    "--histograms/--no-histograms",
    default=True,
    show_default=True,
    help="Write the trace's histograms (where it holds any).",
)
@click.option("--overwrite", is_flag=True, help="Replace an earlier export in LOGDIR.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, nothing on stderr.")
@library_errors
def tensorboard_command(
    run: Path,
    logdir: Path,
    steps: str | None,
    modules: str | None,
    kinds: str | None,
    ranks: str | None,
    per_rank: bool,
    stats: str | None,
    calls: str,
    histograms: bool,
    overwrite: bool,
    quiet: bool,
) -> None:
    """Write RUN as TensorBoard event files into LOGDIR (pip install 'hooktrace[tensorboard]').

    Each statistic of each recorded tensor is a scalar tagged MODULE/KIND/SLOT/STAT over
    steps, each histogram a histogram MODULE/KIND/SLOT/histogram, and the run's command,
    versions, status and options are text. One TensorBoard run, its eval phase beside:
    LOGDIR/rank=0 and LOGDIR/rank=0/eval for a run of one rank; for a run of several,
    LOGDIR/logical, its logical tensors (--per-rank or --ranks: LOGDIR/rank=R, a run per
    rank). At each step: a module's first call (--calls all: each
    call) in the step's last micro-step. LOGDIR must be new or empty (--overwrite replaces
    an earlier export); export several runs into directories side by side to compare them.

    \b
    Example:
      hooktrace export tensorboard runs/a tb/a
      hooktrace export tensorboard runs/b tb/b --kinds grad_param --stats norm,max
      tensorboard --logdir tb
    """
    from hooktrace.analyze.export.tensorboard import export_tensorboard

    require_steps(run, steps)
    with ProgressBar("exporting", quiet=quiet) as progress:
        result = export_tensorboard(
            run,
            logdir,
            steps=steps,
            modules=modules,
            kinds=listed(kinds, str, "--kinds"),
            ranks=listed(ranks, int, "--ranks"),
            per_rank=per_rank,
            stats=STATS if stats is None else listed(stats, str, "--stats") or [],
            calls=calls,
            histograms=histograms,
            overwrite=overwrite,
            progress=progress,
        )
    if quiet:
        return
    for note in result.notes:
        click.echo(f"hooktrace: {note}", err=True)
    span = (
        f"steps {result.first_step}–{result.last_step}"
        if result.steps > 1
        else f"step {result.first_step}"
    )
    click.echo(
        f"hooktrace: wrote {result.charts:,} scalar charts ({result.scalars:,} values), "
        f"{result.histograms:,} histograms{_left_out(result.nonfinite_histograms)} and the "
        f"run's text, {span}, into {logdir} "
        f"(runs {', '.join(result.runs)}); view: tensorboard --logdir {logdir}",
        err=True,
    )


def _left_out(nonfinite: int) -> str:
    if not nonfinite:
        return ""
    return f" ({nonfinite:,} more of only NaN or Inf left out)"
