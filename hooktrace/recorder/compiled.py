"""The compiled kernels beside the one-pass kernel, and when each becomes ready.

Two sets of numba kernels do what numpy already does, faster, with the same results bit for
bit: the small tensors' statistics (:mod:`hooktrace.recorder.staged_kernels`) and the
histograms (:mod:`hooktrace.recorder.histogram_kernel`).

- The small tensors' kernels are compiled (or loaded from numba's cache) with the one-pass
  kernel, before the first large CPU tensor is summarised (:func:`hooktrace.recorder.stats.route`).
- The histogram kernels are made ready in a thread of their own once numba is loaded:
  compiling them takes some 14 s where numba's cache lacks them (0.1 s where it holds
  them), which no training step should wait for; numpy counts (the same) until then.

Compiling the small tensors' kernels in the background too was tried and dropped: a short
run that exits while such a thread compiles, or while a detached compile it started runs,
ended with ``terminate called without an active exception`` (SIGABRT) in about one cold
start in three (docs/PERFORMANCE.md).
"""

from __future__ import annotations

import contextlib
import threading
from types import ModuleType

from hooktrace.recorder.stats import numba_loaded

_histograms: ModuleType | None = None
_loading = threading.Lock()
_started = False


def staged() -> ModuleType | None:
    """:mod:`hooktrace.recorder.staged_kernels` where this process took the one-pass route
    (which loaded it), else None (numpy's route)."""
    if not numba_loaded():
        return None
    from hooktrace.recorder import staged_kernels

    return staged_kernels


def histograms() -> ModuleType | None:
    """:mod:`hooktrace.recorder.histogram_kernel` once ready, else None (numpy's route); the
    first call once numba is loaded starts the thread that makes them ready."""
    global _started
    if not numba_loaded():
        return None
    if _histograms is not None or _started:
        return _histograms
    with _loading:
        if not _started:
            _started = True
            thread = threading.Thread(target=_load_quietly, name="hooktrace-histograms")
            thread.daemon = True
            with contextlib.suppress(RuntimeError):  # no thread to be had: numpy counts
                thread.start()
    return None


def warm_up() -> None:
    """Make both sets ready now, in this thread, if numba is loaded (benchmarks and tests,
    which must know which route they time or check)."""
    if numba_loaded():
        _load()


def _load() -> None:
    global _histograms
    with _loading:
        if _histograms is None:
            from hooktrace.recorder import histogram_kernel

            histogram_kernel.warm_up()
            _histograms = histogram_kernel


def _load_quietly() -> None:
    """:func:`_load`; where compiling fails, numpy goes on counting (the same counts)."""
    with contextlib.suppress(Exception):
        _load()
