"""Progress on stderr for commands that take a while.

The library reports progress through a plain callback, ``progress(done, total, what)``,
called before each piece of work (it never draws anything itself). :class:`ProgressBar` is
that callback for the CLI: a click progress bar on stderr when stderr is a terminal, and
nothing at all when it is not (a pipe, a CI log, a test) or with ``--quiet``.
"""

from __future__ import annotations

import sys
from types import TracebackType
from typing import IO, Any, TextIO

import click


class ProgressBar:
    """``progress(done, total, what)``: draws ``label`` and a bar of ``total`` pieces."""

    def __init__(self, label: str, *, quiet: bool = False, file: TextIO | None = None) -> None:
        self.label = label
        self.file = file if file is not None else sys.stderr
        self.enabled = not quiet and _is_terminal(self.file)
        self._bar: Any = None
        self._done = 0

    def __call__(self, done: int, total: int, what: str) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            self._bar = click.progressbar(
                length=max(total, 1),
                label=self.label,
                file=self.file,
                show_eta=False,
                item_show_func=lambda item: item,
            )
            self._bar.__enter__()
        advance = max(done - self._done, 0)
        if advance:
            self._bar.update(advance, current_item=what)
        else:  # click draws only on a step: show what is being done now all the same
            self._bar.current_item = what
            self._bar.render_progress()
        self._done += advance

    def close(self, *, finished: bool = True) -> None:
        """End the bar (filled when ``finished``) and leave the terminal on a new line."""
        if self._bar is not None:
            if finished:
                self._bar.update(self._bar.length - self._done, current_item="done")
            self._bar.__exit__(None, None, None)
            self._bar = None

    def __enter__(self) -> ProgressBar:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close(finished=kind is None)


def _is_terminal(file: IO[str]) -> bool:
    try:
        return bool(file.isatty())
    except (AttributeError, ValueError):  # closed, or not a real stream
        return False
