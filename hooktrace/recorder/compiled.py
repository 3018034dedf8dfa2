"""The compiled kernels beside the one-pass kernel, and when each becomes ready.

Two sets of numba kernels do what numpy already does, faster, with the same results bit for
bit: the small tensors' statistics (:mod:`hooktrace.recorder.staged_kernels`) and the
histograms (:mod:`hooktrace.recorder.histogram_kernel`). Both are loaded from numba's cache,
never compiled in the recording's process (:mod:`hooktrace.recorder.kernel_cache`):

- the small tensors' kernels with the one-pass kernel (:func:`hooktrace.recorder.stats.route`);
- the histogram kernels at the first histogram once that has happened (a tenth of a second).
  Where the cache lacks them, numpy counts (the same) until the process that fills the
  cache has ended, and the kernels are loaded then.
"""

from __future__ import annotations

import threading
from types import ModuleType

from hooktrace.recorder import kernel_cache
from hooktrace.recorder.stats import numba_loaded

_histograms: ModuleType | None = None
_loading = threading.Lock()
_tries = 0
"""Loads tried: one at the first histogram, one more once the filler has ended."""


def staged() -> ModuleType | None:
    """:mod:`hooktrace.recorder.staged_kernels` where this process took the one-pass route
    (which loaded it), else None (numpy's route)."""
    if not numba_loaded():
        return None
    from hooktrace.recorder import staged_kernels

    return staged_kernels


def histograms() -> ModuleType | None:
    """:mod:`hooktrace.recorder.histogram_kernel` once loaded, else None (numpy's route)."""
    if _histograms is None and numba_loaded():
        _load(compile_here=kernel_cache.compile_here(), strict=False)
    return _histograms


def warm_up() -> None:
    """Make both sets ready now, compiling what numba's cache lacks, if numba is loaded
    (benchmarks and tests, which must know which route they time or check)."""
    if numba_loaded():
        _load(compile_here=True, strict=True)


def _load(compile_here: bool, strict: bool) -> None:
    global _histograms, _tries
    with _loading:
        if _histograms is not None:
            return
        if not strict and not (_tries == 0 or (_tries == 1 and kernel_cache.filled())):
            return  # tried: numpy counts until the filler has ended, or for good after
        _tries += 1
        from hooktrace.recorder import histogram_kernel

        try:
            if compile_here:
                histogram_kernel.warm_up()
            elif not kernel_cache.load(histogram_kernel.warm_up):
                kernel_cache.fill()
                return
        except Exception:  # unable to load here: numpy goes on counting (the same counts)
            if strict:
                raise
            return
        _histograms = histogram_kernel
