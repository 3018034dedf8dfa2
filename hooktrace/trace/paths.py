"""A run directory's paths as the reader checks and names them. Never imports torch.

Apart from the reader because every reading module checks the same things (a ``rank=R``
directory, a regular file, a UTF-8 name) and writes the same messages (a path that prints
anywhere, an error on one line).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

LeaveOut = Callable[[str | Path, BaseException | str], None]
"""Where a reading module reports a damaged file (or a field of one) it leaves out, with
why: ``Trace._leave_out`` lists it in ``Trace.skipped`` and warns."""

MAX_RANK = 2**31 - 1  # the rank partition column is int32


def rank_of(path: Path) -> int:
    """The rank of the nearest ``rank=R`` directory (or ``rank=R.json`` file) on ``path``;
    ValueError when there is none or R is not a rank."""
    for part in reversed(path.parts):
        if part.startswith("rank="):
            text = part.partition("=")[2].removesuffix(".json")
            if not (text.isascii() and text.isdigit()):
                raise ValueError(f"{part} is not rank=R with R a number")
            rank = int(text)
            if not 0 <= rank <= MAX_RANK:
                raise ValueError(f"rank {rank} is out of range")
            return rank
    raise ValueError(f"{path} is not under a rank=R directory")


def regular(path: Path) -> bool:
    """A regular file (symbolic links followed): not a directory, a pipe or a device."""
    try:
        return stat.S_ISREG(path.stat().st_mode)
    except OSError:
        return False


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a name decoded with surrogateescape
        return False
    return True


def printable(path: str | os.PathLike[str]) -> str:
    """A path that prints anywhere: bytes that are not UTF-8 shown as \\xNN escapes."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")


def one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
