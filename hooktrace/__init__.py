"""hooktrace: record what happens inside a PyTorch training run, and analyze it offline.

The analyzer side (``load``, ``Trace`` and the analyses) never imports torch; the recorder
(``record``, ``watch``) is imported on first use.
"""

from __future__ import annotations

import os
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
    TraceTooLarge,
    TraceWarning,
)
from hooktrace.package import __version__

if TYPE_CHECKING:
    import torch

    from hooktrace.analyze.checks.anomalies import anomalies
    from hooktrace.analyze.checks.dead_units import dead_relus
    from hooktrace.analyze.diff.diff import diff
    from hooktrace.analyze.export.tensorboard import export_tensorboard
    from hooktrace.analyze.histograms.histograms import hist
    from hooktrace.analyze.histograms.precision import precision
    from hooktrace.analyze.overview.summary import summary
    from hooktrace.analyze.plots.plots import plot
    from hooktrace.analyze.report.report import report
    from hooktrace.recorder.recording.recorder import Models, Recorder
    from hooktrace.recorder.replay.replay import replay_module
    from hooktrace.trace.check import check
    from hooktrace.trace.reader import Trace, load

# Imported on first use: `hooktrace --help` must not pay for pandas, and nothing on the
# analyzer side may pull in torch.
_LAZY = {
    "load": "hooktrace.trace.reader",
    "Trace": "hooktrace.trace.reader",
    "check": "hooktrace.trace.check",
    "summary": "hooktrace.analyze.overview.summary",
    "diff": "hooktrace.analyze.diff.diff",
    "dead_relus": "hooktrace.analyze.checks.dead_units",
    "anomalies": "hooktrace.analyze.checks.anomalies",
    "hist": "hooktrace.analyze.histograms.histograms",
    "plot": "hooktrace.analyze.plots.plots",
    "precision": "hooktrace.analyze.histograms.precision",
    "report": "hooktrace.analyze.report.report",
    "export_tensorboard": "hooktrace.analyze.export.tensorboard",
    "replay_module": "hooktrace.recorder.replay.replay",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hooktrace' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "ConfigError",
    "FormatVersionError",
    "HooktraceError",
    "RecordingError",
    "TensorNotRecorded",
    "Trace",
    "TraceError",
    "TraceNotFound",
    "TraceTooLarge",
    "TraceWarning",
    "__version__",
    "anomalies",
    "check",
    "dead_relus",
    "diff",
    "export_tensorboard",
    "hist",
    "load",
    "plot",
    "precision",
    "record",
    "replay_module",
    "report",
    "summary",
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
    ``strict`` (faults raise instead of stopping the recording), ``overwrite``,
    ``capture_nonfinite`` (default True: save in full the call where a NaN or Inf first
    appears and name the operation and line that made it; ``Trace.nonfinite_captures()``),
    ``capture_limit`` (captures kept at most, default 3), ``capture_max_mb`` (tensors saved
    per capture at most, default 256), ``histograms`` (the record kinds histogrammed by binary
    exponent, default ``("param", "grad_param")``; None for none: ``Trace.histograms()``),
    ``histogram_every`` (histogram the steps with ``step % N == 0``, default 1).

    Steps advance on every optimizer step; call ``rec.step()`` where there is no optimizer::

        with hooktrace.record(model, "runs/a") as rec:
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()
    """
    from hooktrace.recorder.recording.recorder import Recorder

    if models is None:
        raise ConfigError("record() takes an nn.Module, a dict of them by name, or a list of them")
    return Recorder(models, out, **options)


def watch(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """Record ``tensor`` (kind ``tensor``) and its gradient (``grad_tensor``) under ``name``.

    Call it from inside ``forward()``. Outside a recording it does nothing. Returns
    ``tensor`` unchanged, so it can wrap an expression. Raises :class:`ConfigError` where
    ``tensor`` is not a tensor or ``name`` not a non-empty string, recording or not (in a
    forward that ``torch.compile`` traces, the compiler raises it as an error of its own).
    """
    torch_module = sys.modules.get("torch")  # (imported already, where a tensor exists)
    if torch_module is None or not isinstance(tensor, torch_module.Tensor):
        raise ConfigError(
            f"hooktrace.watch(tensor, name) takes a torch.Tensor, not {type(tensor).__name__}: "
            "give it the tensor itself"
        )
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"hooktrace.watch(tensor, name) takes a non-empty string as the name, not {name!r}: "
            "the name the trace records it under"
        )
    recorder_module = sys.modules.get("hooktrace.recorder.recording.recorder")
    if recorder_module is not None:
        active = recorder_module.active_recorder()
        if active is not None:
            active.watch(tensor, name)
    return tensor
