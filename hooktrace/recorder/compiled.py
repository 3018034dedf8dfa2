"""Compiled kernels that may arrive late: loaded in the background, used once ready.

Two sets of numba kernels do what numpy already does, faster, with the same results bit for
bit: the small tensors' statistics (:mod:`hooktrace.recorder.staged_kernels`) and the
histograms (:mod:`hooktrace.recorder.histogram_kernel`). Compiling them takes some 30 s on a
machine where numba's cache lacks them (a fraction of a second where it holds them), which
no training step should wait for. So once the recorder has loaded numba for its large
tensors (:func:`hooktrace.recorder.stats.numba_loaded`), one thread of their own loads them,
and until a set is ready the callers take numpy's route. Because the results are the same,
when a set arrives changes the time a step takes, never what it records.

The one-pass kernel of large tensors is not among them: its sums differ from torch's in the
last bits, so it is loaded before the first large tensor is summarised
(:func:`hooktrace.recorder.stats.route`), never switched in mid-run.
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType

from hooktrace.recorder.stats import numba_loaded

_ready: dict[str, ModuleType] = {}
_lock = threading.Lock()
_started = False


def staged() -> ModuleType | None:
    """:mod:`hooktrace.recorder.staged_kernels` once ready, else None (numpy's route)."""
    return _ready.get("staged") if _start() else None


def histograms() -> ModuleType | None:
    """:mod:`hooktrace.recorder.histogram_kernel` once ready, else None (numpy's route)."""
    return _ready.get("histograms") if _start() else None


def warm_up() -> None:
    """Load both sets now, in this thread, if numba is loaded (benchmarks and tests, which
    must know which route they time or check)."""
    if numba_loaded():
        _load("staged")
        _load("histograms")


def _start() -> bool:
    """Whether numba is loaded; the first time it is, start the thread that loads them."""
    global _started
    if not numba_loaded():
        return False
    if not _started:
        with _lock:
            if not _started:
                _started = True
                threading.Thread(target=_load_all, name="hooktrace-kernels", daemon=True).start()
    return True


def _load(name: str) -> None:
    with _lock:
        if name in _ready:
            return
        if name == "staged":
            from hooktrace.recorder import staged_kernels as module
        else:
            from hooktrace.recorder import histogram_kernel as module  # type: ignore[no-redef]
        module.warm_up()
        _ready[name] = module


def _load_all() -> None:
    """Each set in turn (the statistics' first: every step uses them); where one fails to
    compile, numpy goes on doing its work."""
    for name in ("staged", "histograms"):
        with contextlib.suppress(Exception):
            _load(name)
