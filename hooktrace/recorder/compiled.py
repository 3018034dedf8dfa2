"""Compiled kernels that may arrive late: loaded in the background, used once ready.

Two sets of numba kernels do what numpy already does, faster, with the same results bit for
bit: the small tensors' statistics (:mod:`hooktrace.recorder.staged_kernels`) and the
histograms (:mod:`hooktrace.recorder.histogram_kernel`). Compiling them takes some 30 s on a
machine where numba's cache lacks them (a fraction of a second where it holds them), which
no training step should wait for. So once the recorder has loaded numba for its large
tensors (:func:`hooktrace.recorder.stats.numba_loaded`), one thread of their own loads them,
and until a set is ready the callers take numpy's route. Because the results are the same,
when a set arrives changes the time a step takes, never what it records.

A process that ends before they are ready (a short run on a fresh machine) would leave
numba's cache without them, and the next run would compile them again: at its exit, a
detached process of their own finishes the work (``python -m hooktrace.recorder.compiled``),
so that the next run loads them from the cache in a fraction of a second.

The one-pass kernel of large tensors is not among them: its sums differ from torch's in the
last bits, so it is loaded before the first large tensor is summarised
(:func:`hooktrace.recorder.stats.route`), never switched in mid-run.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
import threading
from types import ModuleType

from hooktrace.recorder.stats import numba_loaded

_ready: dict[str, ModuleType] = {}
_lock = threading.Lock()  # held while a set loads (seconds, where it compiles)
_start_lock = threading.Lock()  # held while the loading thread starts (never long)
_started = False
_loader: threading.Thread | None = None

_EXIT_WAIT_S = 1.0
"""How long a process's exit waits for the loading thread: enough to load from numba's cache
(a fraction of a second), so that a detached compile is started only where one is needed."""


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
    global _started, _loader
    if not numba_loaded():
        return False
    if not _started:
        with _start_lock:
            if not _started:
                _started = True  # tried once: where no thread starts, numpy does the work
                loader = threading.Thread(target=_load_all, name="hooktrace-kernels", daemon=True)
                try:
                    loader.start()
                except RuntimeError:  # no thread to be had (a process limit, shutdown)
                    return True
                _loader = loader
                atexit.register(_finish_elsewhere, os.getpid())
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


def _finish_elsewhere(started_in: int) -> None:
    """At the exit of the process that started loading them, if they are not all ready yet:
    compile them in a detached process, into numba's cache, for the next run."""
    if os.getpid() != started_in or _loader is None:
        return
    if getattr(sys, "frozen", False) or not sys.executable:  # no Python to run it with
        return
    with contextlib.suppress(Exception):  # the cache is an optimisation; never fail an exit
        _loader.join(timeout=_EXIT_WAIT_S)
        if len(_ready) == 2 or not _loader.is_alive():  # ready, or failed: nothing to finish
            return
        subprocess.Popen(
            [sys.executable, "-m", "hooktrace.recorder.compiled"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # outlives this process, and its terminal's signals
        )


def _compile_into_cache() -> None:
    """The detached process's work; one such process at a time per cache (a test suite's
    short recordings would start several), the others leave at once."""
    import fcntl
    import hashlib
    import tempfile

    cache = os.environ.get("NUMBA_CACHE_DIR") or os.path.dirname(os.path.abspath(__file__))
    key = hashlib.sha1(cache.encode()).hexdigest()[:12]
    lock = os.path.join(tempfile.gettempdir(), f"hooktrace-kernels-{os.getuid()}-{key}.lock")
    with open(lock, "w") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return
        from hooktrace.recorder import histogram_kernel, staged_kernels

        staged_kernels.warm_up()
        histogram_kernel.warm_up()


if __name__ == "__main__":
    _compile_into_cache()
