"""hooktrace: record what happens inside a PyTorch training run, and analyze it offline.

The analyzer side (``load``, ``Trace`` and the analyses) never imports torch; the recorder
(``record``, ``watch``) is imported on first use.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from hooktrace.errors import (
    ConfigError,
    FormatVersionError,
    HooktraceError,
    RecordingError,
    TensorNotRecorded,
    TraceError,
    TraceNotFound,
)
from hooktrace.trace.reader import Trace, load

if TYPE_CHECKING:
    import os

    import torch

    from hooktrace.recorder.recorder import Models, Recorder

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "FormatVersionError",
    "HooktraceError",
    "RecordingError",
    "TensorNotRecorded",
    "Trace",
    "TraceError",
    "TraceNotFound",
    "__version__",
    "load",
    "record",
    "watch",
]


def record(models: Models, out: str | os.PathLike[str], **options: Any) -> Recorder:
    """Record ``models`` into the run directory ``out``; a context manager.

    ``models`` is an ``nn.Module``, a dict of them by name, or a list. Keyword-only options:
    ``modules`` / ``exclude`` (a regex, a list of names, or a predicate on the name),
    ``every`` (record every N-th step), ``steps`` (``"0-10,20"`` or ints and ranges),
    ``inputs`` (also record module inputs), ``params`` (parameters and their gradients,
    default True), ``full_every`` / ``full_steps`` / ``full_modules`` (save full tensors),
    ``max_tensor_mb``, ``max_units``, ``compression`` (``"gzip"``, ``"lzf"``), ``buffer_mb``,
    ``strict`` (faults raise instead of stopping the recording), ``overwrite``.

    Steps advance on every optimizer step; call ``rec.step()`` where there is no optimizer::

        with hooktrace.record(model, "runs/a") as rec:
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    """
    from hooktrace.recorder.recorder import Recorder

    return Recorder(models, out, **options)


def watch(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Record ``tensor`` (kind ``tensor``) and its gradient (``grad_tensor``) under ``name``.

    Call it from inside ``forward()``. Outside a recording it does nothing. Returns
    ``tensor`` unchanged, so it can wrap an expression.
    """
    recorder_module = sys.modules.get("hooktrace.recorder.recorder")
    if recorder_module is not None:
        active = recorder_module.active_recorder()
        if active is not None:
            active.watch(tensor, name)
    return tensor
