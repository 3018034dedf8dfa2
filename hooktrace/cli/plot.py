"""``hooktrace plot RUN --output FILE.png``: a picture of a run, or of two runs' differences."""

from __future__ import annotations

from pathlib import Path

import click

from hooktrace.cli.anomalies import steps_option
from hooktrace.cli.common import CommandError, library_errors, require_steps, run_argument
from hooktrace.cli.progress import ProgressBar

# hooktrace.analyze.plots.plots.WHAT, repeated so that `hooktrace --help` needs no pandas
WHAT = ("grad-norms", "activations", "dead-units", "histograms", "diff")


@click.command()
@run_argument()
@click.option(
    "--what",
    type=click.Choice(WHAT),
    help="The picture. [default: grad-norms; diff with --against]",
)
@click.option(
    "--against",
    type=click.Path(path_type=Path),
    metavar="RUN_B",
    help="Draw where RUN and RUN_B differ (the diff picture).",
)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The picture file; its suffix names the format (.png, .svg, .pdf).",
)
@steps_option
@click.option("--modules", metavar="REGEX", help="Only modules whose name matches this regex.")
@click.option(
    "--kinds",
    metavar="KINDS",
    help="--what histograms: only these kinds, comma-separated: param,grad_param,...",
)
@click.option(
    "--rank",
    type=int,
    help="Draw this rank's records. [default: every rank's, as logical tensors]",
)
@click.option(
    "--max-modules",
    type=click.IntRange(min=1),
    default=40,
    show_default=True,
    help="Draw at most this many modules (those with the largest values).",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, nothing on stderr.")
@library_errors
def plot(
    run: Path,
    what: str | None,
    against: Path | None,
    output: Path,
    steps: str | None,
    modules: str | None,
    kinds: str | None,
    rank: int | None,
    max_modules: int,
    quiet: bool,
) -> None:
    """Draw RUN as a heatmap of modules over steps, into --output.

    \b
    --what grad-norms    each module's parameter gradient norm (log scale)
    --what activations   RMS and fraction of zeros of each module's outputs
    --what dead-units    share of silent units per ReLU layer, and dead at the end
    --what histograms    distribution of |x| by power of two over steps, for up to 8
                         histogrammed records (choose with --modules/--kinds),
                         float16's limits drawn across
    --against RUN_B      largest relative difference per module and step, the
                         first divergence circled (the same as --what diff)

    A run of several ranks is drawn as its logical tensors (--rank R: rank R's). Red
    cells hold a NaN or an Inf; white cells were not recorded. Needs matplotlib
    (pip install 'hooktrace[plot]').

    \b
    Example:
      hooktrace plot runs/mlp --what grad-norms -o grads.png
      hooktrace plot runs/before --against runs/after -o diff.png
      hooktrace plot runs/mlp --what histograms --modules 'fc1$' -o hist.png
    """
    from hooktrace.analyze.plots.plots import plot as draw

    what = what or ("diff" if against is not None else "grad-norms")
    if what == "diff" and against is None:
        raise CommandError("--what diff compares two runs: give --against RUN_B")
    if kinds is not None and what != "histograms":
        raise CommandError(f"--kinds chooses the records of --what histograms, not of {what}")
    if against is not None and what != "diff":
        raise CommandError(f"--against draws the diff picture, not {what}: leave out --what")
    require_steps(run, steps)
    with ProgressBar(f"drawing {what}", quiet=quiet) as progress:
        draw(
            run,
            what=what,
            against=against,
            steps=steps,
            modules=modules,
            kinds=kinds,
            rank=rank,
            max_modules=max_modules,
            output=output,
            progress=progress,
        )
    if not quiet:
        click.echo(f"hooktrace: wrote {output}", err=True)
