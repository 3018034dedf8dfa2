"""``hooktrace check RUN``."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from hooktrace.cli.common import library_errors, run_argument


@click.command()
@run_argument()
@library_errors
def check(run: Path) -> None:
    """Is RUN whole? Says what was lost; exits 0 whole, 1 incomplete, 2 unreadable.

    Reads every Parquet part in full, and every full tensor a record points to against the
    checksum stored with it: a trace of many full tensors takes as long to check as to read.

    \b
    Example:
      hooktrace check runs/mlp || echo "the trace is not whole"
    """
    from hooktrace.trace.check import check as check_run

    report = check_run(run)
    verdict = "whole" if report.whole else "INCOMPLETE"
    readable = f"{report.steps} step{'' if report.steps == 1 else 's'} readable"
    click.echo(f"{report.path}: {verdict} (status {report.status}, {readable})")
    for problem in report.problems:
        click.echo(f"  lost: {problem}")
    for note in report.notes:
        click.echo(f"  note: {note}")
    sys.exit(0 if report.whole else 1)
