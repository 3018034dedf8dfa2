"""What every command shares: loading a run, errors as exit code 2, output formats."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import click

from hooktrace.errors import HooktraceError, TraceWarning

if TYPE_CHECKING:
    import pandas as pd  # imported by the commands that print tables, not by --help

F = TypeVar("F", bound=Callable[..., Any])

EXIT_ERROR = 2
EXIT_INCOMPLETE = 1
"""An answer given without what damaged parts of the trace held (each named in a warning):
``hooktrace check`` exits 1 on such a trace, and so does every command that answered."""


class CommandError(click.ClickException):
    """A one-line error with exit code 2 (1 means 'found something', as with diff and cmp)."""

    exit_code = EXIT_ERROR

    def show(self, file: Any = None) -> None:
        click.echo(f"hooktrace: error: {self.format_message()}", err=True)


def fail(message: str) -> NoReturn:
    click.echo(f"hooktrace: error: {message}", err=True)
    sys.exit(EXIT_ERROR)


def library_errors(func: F) -> F:
    """Turn the library's own exceptions into one-line errors with exit code 2, and say what
    a partial result left out: each file of a trace the reader skipped is one warning line
    on stderr (``hooktrace: warning: ...``), printed however the command ends."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caught: list[warnings.WarningMessage] = []
        answered = False  # the command printed its answer (an error is no answer)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", TraceWarning)
                try:
                    result = func(*args, **kwargs)
                except SystemExit as exc:  # diff's DIFFER, check's INCOMPLETE: answers too
                    answered = exc.code in (None, 0, EXIT_INCOMPLETE)
                    if answered and _damaged(caught):
                        raise SystemExit(EXIT_INCOMPLETE) from None
                    raise
                answered = True
            if _damaged(caught):  # an answer without what damaged parts held: as check exits
                raise SystemExit(EXIT_INCOMPLETE)
            return result
        except HooktraceError as exc:
            raise CommandError(_one_line(str(exc))) from exc
        except OSError as exc:
            raise CommandError(
                _one_line(f"{exc.strerror or exc}: {exc.filename or ''}".strip(": "))
            ) from exc
        finally:  # outside catch_warnings: showing a warning there would record it again
            damaged = False
            for warning in caught:
                if issubclass(warning.category, TraceWarning):
                    click.echo(f"hooktrace: warning: {_one_line(str(warning.message))}", err=True)
                    damaged = True
                else:  # not ours: shown as Python would have shown it
                    warnings.showwarning(
                        warning.message, warning.category, warning.filename, warning.lineno
                    )
            if damaged and answered:
                click.echo(
                    "hooktrace: warning: the answer leaves out what the damaged parts held; "
                    "`hooktrace check RUN` says what was lost",
                    err=True,
                )

    return wrapper  # type: ignore[return-value]


def require_steps(run: Path, steps: str | None) -> None:
    """Refuse ``--steps`` that selects none of ``run``'s recorded steps, naming those it holds:
    an answer about no steps read as a clean one ("no anomalies", exit 0: a CI guard with
    --fail passed on a mistyped range). Where the steps table is damaged, the steps it lost
    may hold records: the command answers, and reports the damage itself."""
    if steps is None:
        return
    from hooktrace.analyze.findings import step_filter
    from hooktrace.trace.reader import load

    chosen = step_filter(steps)
    with warnings.catch_warnings(record=True) as damaged:
        warnings.simplefilter("always", TraceWarning)
        recorded = load(run).steps
    if recorded.empty or chosen is None or _damaged(damaged):
        return
    numbers = recorded["step"].drop_duplicates().sort_values()
    if isinstance(chosen, tuple):
        selected = bool(((numbers >= chosen[0]) & (numbers <= chosen[1])).any())
    else:
        selected = bool(numbers.isin(chosen).any())
    if not selected:
        held = (
            ", ".join(map(str, numbers))
            if len(numbers) <= 8
            else f"{len(numbers):,} steps from {numbers.iloc[0]} to {numbers.iloc[-1]}"
        )
        raise CommandError(f"--steps {steps} selects no recorded step: {run} holds steps {held}")


def _damaged(caught: list[warnings.WarningMessage]) -> bool:
    """Whether the reader left a damaged part of a trace out (its only warnings)."""
    return any(issubclass(w.category, TraceWarning) for w in caught)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def run_argument(name: str = "run") -> Callable[[F], F]:
    """A run directory argument (existence is checked by the library, with a better message)."""
    return click.argument(name, type=click.Path(path_type=Path))


FORMATS = ("table", "csv", "json", "parquet")


def listed(text: str | None, kind: Callable[[str], Any], option: str) -> list[Any] | None:
    """The comma-separated values of ``option`` (None where it was not given), each made by
    ``kind``; a value ``kind`` refuses is a one-line error."""
    if text is None:
        return None
    try:
        return [kind(part.strip()) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CommandError(
            f"bad {option} {text!r}: give {kind.__name__} values, comma-separated"
        ) from None


def per_rank_option(what: str) -> Callable[[F], F]:
    """``--per-rank``: ``what`` each rank's records, not the logical tensors a command of a
    run of several ranks answers about by default."""
    return click.option(
        "--per-rank",
        is_flag=True,
        help=f"{what} rank by rank, not as logical tensors (the default for runs of several "
        "ranks).",
    )


def output_options(func: F) -> F:
    """``--format`` and ``--output``, shared by every command that prints a table."""
    func = click.option(
        "--output",
        "-o",
        type=click.Path(dir_okay=False, path_type=Path),
        help="Write to this file instead of standard output (required for parquet).",
    )(func)
    func = click.option(
        "--format",
        "fmt",
        type=click.Choice(FORMATS),
        default="table",
        show_default=True,
        help="Output format.",
    )(func)
    return func


def emit_frame(
    frame: pd.DataFrame, fmt: str, output: Path | None, *, table_text: str | None = None
) -> None:
    """Write ``frame`` in the chosen format; ``table_text`` is the human rendering."""
    if fmt == "parquet":
        if output is None:
            raise CommandError("--format parquet writes a binary file: give --output FILE.parquet")
        frame.to_parquet(output, index=False)
        return
    if fmt == "csv":
        text = frame.to_csv(index=False)
    elif fmt == "json":
        text = json.dumps(json.loads(frame.to_json(orient="records")), indent=2) + "\n"
    else:
        text = table_text if table_text is not None else frame.to_string(index=False) + "\n"
    if output is None:
        click.echo(text, nl=False)
    else:
        output.write_text(text)


def _plain_file(path: Path) -> bool:
    """Whether ``path`` is a regular file itself, not a link to one."""
    return path.is_file() and not path.is_symlink()


class FrameWriter:
    """Writes a table chunk by chunk in ``--format`` csv, json (an array, a record a line) or
    parquet, so that memory stays bounded however many rows there are. Parquet takes its
    columns' types from ``schema`` where given (a table with no chunk is then an empty file
    of those columns), else from the first chunk.

    Used as a context manager: the table is ended where the block ends, and only then does
    ``--output`` appear (written beside it under a name of this process, then renamed over
    it, with the mode of the file it replaces). Where the block raises, nothing is ended and
    that file is removed: a command that fails leaves no file that reads as a whole answer,
    and an earlier file of that name as it was. An ``--output`` that is not a plain file (a
    link, a pipe, a device) is written where it is, as it goes."""

    def __init__(self, fmt: str, output: Path | None, *, schema: Any = None) -> None:
        if fmt == "parquet" and output is None:
            raise CommandError("--format parquet writes a binary file: give --output FILE.parquet")
        self.fmt = fmt
        self.output = output
        self.target = output  # where the writing goes: output, or a file beside it
        if output is not None and (not output.exists() or _plain_file(output)):
            self.target = output.with_name(f".{output.name}.{os.getpid()}.partial")
        self.schema = schema
        self.stream: Any = None
        self.parquet: Any = None
        self.chunks = 0

    def __enter__(self) -> FrameWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is not None:
            self.abort()
            return
        try:
            self.close()
        except BaseException:
            self.abort()
            raise

    def write(self, frame: pd.DataFrame) -> None:
        if self.fmt == "parquet":
            import pyarrow as pa

            table = pa.Table.from_pandas(frame, preserve_index=False)
            self._parquet(table.schema).write_table(table.cast(self.parquet.schema))
        elif self.fmt == "csv":
            self._text(frame.to_csv(index=False, header=self.chunks == 0))
        elif len(frame):
            records = frame.to_json(orient="records", lines=True).strip().replace("\n", ",\n")
            self._text(("[\n" if self.chunks == 0 else ",\n") + records)
        else:
            return
        self.chunks += 1

    def _parquet(self, first: Any) -> Any:
        if self.parquet is None:
            import pyarrow.parquet as pq

            self.parquet = pq.ParquetWriter(self.target, self.schema or first)
        return self.parquet

    def close(self) -> None:
        """End the table, and put the file in place."""
        if self.fmt == "json":
            self._text("\n]\n" if self.chunks else "[]\n")
        if self.fmt == "parquet" and self.parquet is None and self.schema is not None:
            self._parquet(self.schema)  # no chunk: an empty file of the columns
        self._close_files()
        output, target = self.output, self.target
        if output is None or target is None or target == output or not target.exists():
            return
        if _plain_file(output):
            shutil.copymode(output, target)
        target.replace(output)

    def abort(self) -> None:
        """Leave the table unended, and remove what was written beside ``--output``."""
        with contextlib.suppress(Exception):  # the error that aborts is the one to report
            self._close_files()
        if self.target is not None and self.target != self.output:
            with contextlib.suppress(OSError):
                self.target.unlink()

    def _close_files(self) -> None:
        parquet, stream, self.parquet, self.stream = self.parquet, self.stream, None, None
        try:
            if parquet is not None:
                parquet.close()
        finally:
            if stream is not None:
                stream.close()

    def _text(self, text: str) -> None:
        if self.output is None:
            click.echo(text, nl=False)
            return
        if self.stream is None:
            self.stream = self.target.open("w")  # type: ignore[union-attr]
        self.stream.write(text)
