"""``hooktrace report RUN [RUN_B] --output report.html``: one self-contained HTML page."""

from __future__ import annotations

from pathlib import Path

import click

from hooktrace.cli.common import library_errors, run_argument
from hooktrace.cli.diff import ATOL, RTOL
from hooktrace.cli.progress import ProgressBar


@click.command()
@run_argument()
@click.argument("run_b", type=click.Path(path_type=Path), required=False)
@click.option(
    "--output",
    "-o",
    type=click.Path(dir_okay=False, path_type=Path),
    required=True,
    help="The HTML file to write.",
)
@click.option("--rtol", type=float, default=RTOL, show_default=True, help="diff's tolerance.")
@click.option("--atol", type=float, default=ATOL, show_default=True, help="diff's tolerance.")
@click.option(
    "--max-modules",
    type=click.IntRange(min=1),
    default=40,
    show_default=True,
    help="Draw at most this many modules per picture.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, nothing on stderr.")
@library_errors
def report(
    run: Path,
    run_b: Path | None,
    output: Path,
    rtol: float,
    atol: float,
    max_modules: int,
    quiet: bool,
) -> None:
    """Write one HTML page about RUN: its summary, its findings (anomalies, dead ReLU
    units) and its pictures; with RUN_B, that run too and the diff of the two.

    The page is self-contained (pictures inline, no script, nothing fetched): open it
    from disk or attach it to an issue. Without matplotlib it has no pictures.

    \b
    Example:
      hooktrace report runs/mlp -o mlp.html
      hooktrace report runs/before runs/after -o before-after.html
    """
    from hooktrace.analyze.report.report import report as write_report

    with ProgressBar("analysing", quiet=quiet) as progress:
        write_report(
            run,
            run_b,
            output=output,
            rtol=rtol,
            atol=atol,
            max_modules=max_modules,
            progress=progress,
        )
    if not quiet:
        click.echo(f"hooktrace: wrote {output}", err=True)
