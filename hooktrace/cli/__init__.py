"""The ``hooktrace`` command: a thin Click layer over the library.

Each command lives in its own module and is imported only when it runs, so ``hooktrace
--help`` starts fast and never imports torch. A command parses its options, calls one public
library function of the same name, and formats the result.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import threading
from typing import Any, NoReturn

import click

from hooktrace import __version__
from hooktrace.cli.common import fail

# command name -> "module:attribute" (modules under hooktrace.cli)
COMMANDS = {
    "record": "hooktrace.cli.record:record",
    "summary": "hooktrace.cli.summary:summary",
    "check": "hooktrace.cli.check:check",
    "hist": "hooktrace.cli.hist:hist",
    "diff": "hooktrace.cli.diff:diff",
    "replay": "hooktrace.cli.replay:replay",
    "dead-relus": "hooktrace.cli.dead_relus:dead_relus",
    "anomalies": "hooktrace.cli.anomalies:anomalies",
    "precision": "hooktrace.cli.precision:precision",
    "plot": "hooktrace.cli.plot:plot",
    "report": "hooktrace.cli.report:report",
    "export": "hooktrace.cli.export:export",
}


class LazyGroup(click.Group):
    """A group whose commands are imported on first use."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = COMMANDS.get(cmd_name)
        if target is None:
            return None
        module_name, _, attribute = target.partition(":")
        command = getattr(importlib.import_module(module_name), attribute)
        assert isinstance(command, click.Command)
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hooktrace")
def cli() -> None:
    """Record what happens inside a PyTorch training run, and analyze it offline.

    \b
    Example:
      hooktrace record train.py -- --epochs 1
      hooktrace summary runs/train-20261120-101500
    """


def main(argv: list[str] | None = None) -> Any:
    """Entry point. Every error is one line on stderr and exit code 2: usage errors, the
    library's own errors, and anything unexpected (HOOKTRACE_DEBUG=1 shows the traceback)."""
    try:
        code = cli.main(args=argv, prog_name="hooktrace", standalone_mode=False)
    except click.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "hooktrace"
        fail(f"{exc.format_message()} (see `{where} --help`)")
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.Abort:
        fail("aborted")
    except Exception as exc:
        if os.environ.get("HOOKTRACE_DEBUG"):
            raise
        fail(f"internal error: {type(exc).__name__}: {exc} (set HOOKTRACE_DEBUG=1 to see where)")
    sys.exit(code if isinstance(code, int) else 0)


def run() -> NoReturn:
    """The ``hooktrace`` command and ``python -m hooktrace``: :func:`main`, then the exit.

    After an analyzer command, once its output is flushed and the ``atexit`` handlers have
    run, the process ends without the interpreter's teardown, which frees every object of
    pandas, pyarrow and h5py one by one: 0.05 to 0.1 s of a command that takes 1 s. Not
    after ``record`` (the user's script may count on a normal exit), nor while a thread
    other than the main one still runs.
    """
    recording = sys.argv[1:2] == ["record"]  # before it runs: record hands the script its argv
    try:
        main()
        code: Any = 0
    except SystemExit as exc:
        code = exc.code
    if recording or threading.active_count() > 1:
        sys.exit(code)
    _exit_now(code)


def _exit_now(code: Any) -> NoReturn:
    """Exit with ``code`` as ``sys.exit`` would, but without tearing the interpreter down."""
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:  # sys.exit("message")
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: as Python reports a failed flush
            status = status or 120
    os._exit(status)


if __name__ == "__main__":
    run()
