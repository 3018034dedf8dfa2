"""The one-pass kernel on torch's own OpenMP threads.

On a CPU, torch runs its operators on a team of OpenMP threads (GNU libgomp, in the Linux
wheels). Between operators the team's workers spin, waiting for the next one, so the cores
they run on are never free: a thread of hooktrace's own takes its time from them
(docs/PERFORMANCE.md). numba's "omp" threading layer calls the same GNU OpenMP entry points,
and the dynamic linker binds them to the copy torch loaded, which torch makes global. A
parallel kernel then runs on torch's own team, on workers that would otherwise spin.

:func:`join` checks that this is so before the kernel takes a second thread, and puts back
what numba's layer changes in torch's library as it starts (the thread count, nesting).
:func:`threads` then says how many threads a kernel call may take: as many as torch uses now.

A forked process keeps to one thread: GNU OpenMP's team does not survive a fork (a parallel
region in the child waits for threads that are not there), and numba stops a forked child
that starts its OpenMP threads. That holds for a process forked after this module joined,
and for one forked after hooktrace was imported, whatever its parent did with OpenMP.

numba is imported by :func:`join` and :func:`run` only: importing this module costs nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from hooktrace import package

T = TypeVar("T")

_limit = 1  # threads numba's layer started with, once joined; 1 while not


def started() -> int:
    """Threads numba's layer started with once :func:`join` succeeded, else 1: the most a
    kernel call may take, whatever torch uses now."""
    return _limit


def threads() -> int:
    """Threads a kernel call may take now: as many as torch uses, or one where that is one
    or more than numba started with (a smaller team would make libgomp end torch's extra
    threads, and torch's next operator start them again)."""
    n = torch.get_num_threads()
    return n if 1 < n <= _limit else 1


def run(kernel: Callable[..., T], size: int, *args: object) -> T:
    """``kernel(*args)``, its parallel loops on ``size`` threads (:func:`threads`). numba's
    own setting is per thread and starts at its limit: only a smaller team (torch told to use
    fewer threads) costs the two calls that set and restore it."""
    if size == _limit:
        return kernel(*args)
    import numba

    before = numba.get_num_threads()
    numba.set_num_threads(size)
    try:
        return kernel(*args)
    finally:
        numba.set_num_threads(before)


def join(start: Callable[[], object]) -> str | None:
    """Start numba's threading layer and compile (or load) the parallel kernel by calling
    ``start`` on a team of one, and let kernel calls use more threads if the layer runs on
    torch's OpenMP team. Returns None if so, else why not: the kernel then keeps to one
    thread. Raises only what ``start`` raises that is not an Exception."""
    global _limit
    try:
        import numba

        if os.getpid() != package.imported_in:
            return "a forked process"
        if numba.config.NUMBA_NUM_THREADS < 2:  # type: ignore[attr-defined]
            return "numba is limited to one thread"
        if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
            return "torch does not run on OpenMP here"
        gomp = _torch_openmp()
        if gomp is None:
            return "torch's OpenMP library was not found"
        saved = gomp.omp_get_max_threads(), gomp.omp_get_max_active_levels()
        nested = gomp.omp_get_nested()
        numba.set_num_threads(1)  # starts the layer; the first call needs no team
        try:
            start()
        finally:
            # numba's count is per thread: back to its limit in this one, also where start()
            # was stopped (a load that found numba's cache cold), else this thread's kernels
            # would keep to one thread once another thread joined
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
            # numba's OpenMP layer sets the thread count to its own and allows nested
            # parallel regions as it starts: in torch's library too, whose settings they are
            # (torch reads its thread count from there)
            gomp.omp_set_nested(nested)
            gomp.omp_set_max_active_levels(saved[1])
            gomp.omp_set_num_threads(saved[0])
        layer = numba.threading_layer()
        if layer != "omp":
            return f"numba's threading layer is {layer}, not torch's OpenMP"
        if _address(ctypes.CDLL(None), "GOMP_parallel") != _address(gomp, "GOMP_parallel"):
            return "numba's OpenMP is not the library torch runs on"
        _limit = numba.config.NUMBA_NUM_THREADS  # type: ignore[attr-defined]
        return None
    except Exception as exc:  # no threading layer here, or it failed to start
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"numba's threads did not start: {reason}"


def _leave() -> None:
    global _limit
    _limit = 1


os.register_at_fork(after_in_child=_leave)


def _torch_openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP library torch loaded: its own copy where it ships one, else the only
    one loaded. None where neither can be told (or off Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            loaded = {line.split()[-1] for line in maps if "/libgomp" in line}
    except OSError:
        return None
    package = Path(torch.__file__).resolve().parent
    homes = (package, package.parent / "torch.libs")  # where wheels keep their libraries
    own = [p for p in loaded if any(Path(p).resolve().is_relative_to(h) for h in homes)]
    chosen = own if own else list(loaded)
    if len(chosen) != 1:
        return None
    try:
        return ctypes.CDLL(chosen[0], mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def _address(library: ctypes.CDLL, name: str) -> int | None:
    try:
        return ctypes.cast(getattr(library, name), ctypes.c_void_p).value
    except AttributeError:
        return None
