"""What the reliability groups share: running the CLI as a user would, judging its answer, and
recording small real traces.

``run_cli`` calls ``hooktrace.cli.main`` (the console script's entry point) in this process,
with standard output and standard error set up as Python sets them up for a terminal
(UTF-8; strict on stdout, backslashreplace on stderr), and a guard that turns a hang into a
failure instead of a stuck test run.
"""

from __future__ import annotations

import io
import os
import re
import signal
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import click

from hooktrace.cli import COMMANDS, cli

ROOT = Path(__file__).resolve().parents[2]
HANG_SECONDS = 30


class Hung(BaseException):
    """Raised by the alarm in a command that ran past HANG_SECONDS (a BaseException, so
    that hooktrace's own catch-all cannot turn it into an ordinary error)."""


@dataclass
class Outcome:
    argv: list[str]
    code: int | None  # None: it raised instead of exiting
    stdout: str
    stderr: str
    raised: str = ""

    @property
    def text(self) -> str:
        return self.stdout + self.stderr

    def __str__(self) -> str:
        return (
            f"hooktrace {' '.join(self.argv)} -> exit {self.code}{self.raised}\n"
            f"--- stdout\n{self.stdout}--- stderr\n{self.stderr}"
        )


@contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def on_alarm(signum: int, frame: FrameType | None) -> None:
        raise Hung(f"no answer after {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[str]) -> Outcome:
    """``hooktrace ARGV`` as the console script runs it, in this process."""
    out_bytes, err_bytes = io.BytesIO(), io.BytesIO()
    out = io.TextIOWrapper(out_bytes, encoding="utf-8", errors="strict", write_through=True)
    err = io.TextIOWrapper(
        err_bytes, encoding="utf-8", errors="backslashreplace", write_through=True
    )
    code: int | None = None
    raised = ""
    from hooktrace.cli import main

    with redirect_stdout(out), redirect_stderr(err), _alarm(HANG_SECONDS):
        try:
            main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except BaseException as exc:  # a hang, or anything main() let through
            raised = f" (raised {type(exc).__name__}: {exc})"
    return Outcome(
        argv,
        code,
        out_bytes.getvalue().decode("utf-8", "replace"),
        err_bytes.getvalue().decode("utf-8", "replace"),
        raised,
    )


def analyzer_commands() -> list[str]:
    """Every command but ``record``: those added later are covered without editing here; a
    group's by each subcommand (``export tensorboard``)."""
    names = []
    for name in sorted(COMMANDS):
        command = command_named(name)
        if isinstance(command, click.Group):
            names += [f"{name} {sub}" for sub in sorted(command.commands)]
        elif name != "record":
            names.append(name)
    return names


def command_named(name: str) -> click.Command:
    """The command ``name`` (``export tensorboard``: a group's subcommand)."""
    group, *sub = name.split()
    with click.Context(cli) as ctx:
        command = cli.get_command(ctx, group)
    assert command is not None, name
    if sub:
        assert isinstance(command, click.Group), name
        command = command.commands[sub[0]]
    return command


def argv_for(
    command: str, run: str | os.PathLike[str], *, other: str | os.PathLike[str]
) -> list[str]:
    """The argv that points ``command`` at ``run``; commands that take two runs (diff) get
    ``other`` first and ``run`` second, but report, which takes one run or two, gets ``run``
    alone: it draws each run's pictures, and those of an undamaged ``other``, the same every
    time, took half of these tests' time. Required options get a value of their
    kind: a step number, or an output file (a page or a picture) next to ``run``."""
    cmd = command_named(command)
    arguments = [p for p in cmd.params if isinstance(p, click.Argument) and p.nargs == 1]
    runs = [p for p in arguments if p.name != "logdir"]
    words = command.split()
    argv = (
        [*words, os.fsdecode(other), os.fsdecode(run)]
        if len(runs) >= 2 and command != "report"
        else [*words, os.fsdecode(run)]
    )
    if any(p.name == "logdir" for p in arguments):  # a new directory each time: never reused
        beside = Path(os.fsdecode(run)).parent
        where = tempfile.mkdtemp(prefix="logdir-", dir=beside if beside.is_dir() else None)
        argv.append(str(Path(where) / "tb"))
    if command == "replay":  # --step is required unless --nonfinite is given
        argv += ["--step", "0"]
    for option in cmd.params:
        if not (isinstance(option, click.Option) and option.required):
            continue
        if isinstance(option.type, click.types.IntParamType):
            argv += [option.opts[0], "0"]
        elif isinstance(option.type, click.Path):
            suffix = ".html" if "HTML" in (option.help or "") else ".png"
            output = Path(os.fsdecode(run)).parent / f"{command}-{option.name}{suffix}"
            argv += [option.opts[0], str(output)]
        else:
            raise AssertionError(
                f"hooktrace {command} {option.opts[0]} is required: teach argv_for() a value"
            )
    return argv


def problems_with_error(outcome: Outcome) -> list[str]:
    """What is wrong with an answer, whatever the input: tracebacks, hangs, crashes, internal
    errors, unknown exit codes, and errors that are not one line."""
    found = []
    if outcome.raised:
        found.append(f"did not exit cleanly{outcome.raised}")
    if "Traceback" in outcome.text:
        found.append("printed a traceback")
    if "internal error" in outcome.stderr:
        found.append("internal error")
    if outcome.code not in (0, 1, 2):
        found.append(f"exit code {outcome.code}")
    if outcome.code == 2:
        lines = outcome.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("hooktrace: error:")]
        if len(errors) != 1 or (len(lines) - len(errors) > 0 and not _only_warnings(lines)):
            found.append(f"exit 2 without exactly one error line: {lines!r}")
    return found


def _only_warnings(lines: list[str]) -> bool:
    return all(
        line.startswith("hooktrace: error:") or line.startswith("hooktrace: warning:")
        for line in lines
    )


def normalise(text: str, *paths: str | os.PathLike[str]) -> str:
    """``text`` with run paths and timings replaced, to compare answers about two copies."""
    for path in paths:
        text = text.replace(os.fsdecode(path), "RUN")
    return re.sub(r"\d+(\.\d+)? (s|B|kB|MB|GB)\b", "N", text)


def tree(root: Path) -> set[str]:
    """Every path under ``root`` (files, directories, links), relative to it."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            found.add(os.path.relpath(os.path.join(dirpath, name), root))
    return found


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a subprocess that must import this checkout's hooktrace: an
    editable install elsewhere, or a script's own directory first on sys.path, would not."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HOOKTRACE_DEBUG", None)
    env.update(extra)
    return env


PYTHON = sys.executable
