"""The compiled kernels beside the one-pass kernel, once loaded.

Two sets of numba kernels do what numpy already does, faster, with the same results bit for
bit: the small tensors' statistics (:mod:`hooktrace.recorder.stats.staged_kernels`) and the
histograms (:mod:`hooktrace.recorder.stats.histogram_kernel`). They are loaded with the one-pass
kernel (:func:`hooktrace.recorder.stats.stats.route`), from numba's cache; until then, or without
numba, numpy computes the same (on a first run, while the kernels compile aside:
:mod:`hooktrace.recorder.stats.kernel_cache`).
"""

from __future__ import annotations

from types import ModuleType

from hooktrace.recorder.stats.stats import numba_loaded, route


def staged() -> ModuleType | None:
    """:mod:`hooktrace.recorder.stats.staged_kernels` where this process took the one-pass route
    (which loaded it), else None (numpy's route)."""
    if not numba_loaded():
        return None
    from hooktrace.recorder.stats import staged_kernels

    return staged_kernels


def staged_loading() -> ModuleType | None:
    """:func:`staged`, the kernels loaded first where this process has not yet decided its
    route: what a small CPU tensor met in a hook asks. Reading it in place costs a fifth of
    staging it (and its NaN check and histogram then come from the same pass); loading takes
    about half a second once, from numba's cache (where the cache lacks them, they compile
    in a process aside and the staged route serves until then)."""
    route()
    return staged()


def histograms() -> ModuleType | None:
    """:mod:`hooktrace.recorder.stats.histogram_kernel` where this process took the one-pass route
    (which loaded it), else None (numpy's route)."""
    if not numba_loaded():
        return None
    from hooktrace.recorder.stats import histogram_kernel

    return histogram_kernel
