"""How the recorder tells of its own faults: a warning at the user's line, never inside it.

Recording never takes training down: a fault inside hooktrace warns once and stops the
recording (``strict`` makes it fatal instead: :meth:`Recorder._fault`). The warnings are
apart from the recorder because where they point is a question of the call stack, not of
the recording: at the first line outside hooktrace and torch, the user's forward call or
``loss.backward()``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from types import FrameType

import torch

_INTERNAL = tuple(
    str(Path(m.__file__ or "").parent) + os.sep for m in (sys.modules["hooktrace"], torch)
)


def fault_message(exc: BaseException, where: str, step: int) -> str:
    return (
        f"hooktrace failed in {where} at step {step}: {type(exc).__name__}: {str(exc).rstrip('. ')}"
    )


def warn(message: str) -> None:
    """A RuntimeWarning pointing at the user's line. Where the script made warnings errors
    (``-W error``, pytest's ``filterwarnings = error``) it would raise inside the script's
    forward or backward call: the message is printed to stderr instead."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_outside())
    except Warning:
        print(message, file=sys.stderr, flush=True)


def _caller_outside() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first line
    outside hooktrace and torch: the user's forward call or ``loss.backward()``. Hooks that
    autograd runs on its own threads have no such line: the caller's caller then."""
    frame: FrameType | None = sys._getframe(1)  # the function calling warnings.warn: level 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2
