"""numba's cache of hooktrace's kernels: loaded where it holds them, filled elsewhere where not.

Compiling the kernels takes some 20 s on a machine whose numba cache lacks them (a fresh
install, a new numba or hooktrace); loading them from the cache takes about half a second.
A recording must not wait the 20 s, so the recorder never compiles a kernel in its own
process (unless ``HOOKTRACE_ONE_PASS=wait`` asks it to):

- :func:`load` runs a kernel set's warm-up only where every kernel it calls is in numba's
  cache. At the first kernel missing it stops, having compiled nothing, and says so: numba
  announces each compile with a ``numba:compile`` event (numba's event API) before it
  starts, and the listener installed here raises there, in this thread only.
- :func:`fill` then starts a process of its own (this module, run as ``python -m``) that
  compiles every kernel into the cache, detached: it runs on after the recording ends, and
  the next run loads. One filler runs at a time per machine and user (a file lock); the
  others wait for it, then find the cache full.
- :func:`filled` says when the filler this process started has ended, so that the recorder
  loads the kernels then, mid-run (:func:`hooktrace.recorder.stats.route`).

Why not compile in a thread of the recording's own process: short runs on a cold cache that
exited while such a thread compiled ended with ``terminate called without an active
exception`` (SIGABRT) in up to one try in three. The likely cause: at exit CPython stops a
daemon thread where it next takes the interpreter lock (python/cpython#124149), here inside
LLVM's C++ frames. It never showed on demand, so the design removes the situation: nothing of
hooktrace's runs in the recording's process once the recording has ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable

_state = "idle"
"""The filler, as this process knows it: ``idle`` (not needed yet), ``running`` (started
here), ``ended``, or ``off`` (it could not start, or a fork's parent started it)."""
_filler = 0
_polled = 0.0


class _Cold(BaseException):
    """Raised into a warm-up where numba would compile: a BaseException, so that code between
    the warm-up and numba that keeps going on an Exception (:func:`omp.join`) lets it by."""


def compile_here() -> bool:
    """Whether ``HOOKTRACE_ONE_PASS=wait`` asks this process to compile what the cache lacks."""
    return os.environ.get("HOOKTRACE_ONE_PASS") == "wait"


def load(warm_up: Callable[[], object]) -> bool:
    """Run ``warm_up`` if numba's cache holds every kernel it calls (loading them), and return
    True; else False, with nothing compiled (kernels loaded before the first missing one stay
    loaded). Other exceptions (numba missing) propagate."""
    from numba.core import event

    class Refuse(event.Listener):
        """Stops a compile before it starts, in this thread only."""

        def on_start(self, happening: event.Event) -> None:
            if threading.get_ident() == thread:
                raise _Cold

        def on_end(self, happening: event.Event) -> None:
            pass

    thread = threading.get_ident()
    try:
        with event.install_listener("numba:compile", Refuse()):
            warm_up()
    except _Cold:
        return False
    return True


def fill() -> bool:
    """Start the process that compiles the kernels into numba's cache, once per process, and
    say whether it runs; where it cannot start, the kernels stay unloaded (the eager routes
    give the statistics)."""
    global _state, _filler
    if _state != "idle":
        return _state == "running"
    try:
        _filler = os.posix_spawn(
            sys.executable,
            [sys.executable, "-m", __name__],
            # where this process found hooktrace and numba (a script's own folder, say)
            {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
            file_actions=[(os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)],
            setsid=True,  # its own session: a Ctrl-C meant for the training does not stop it
        )
    except (OSError, AttributeError, TypeError):  # no posix_spawn or no setsid here
        _state = "off"
    else:
        _state = "running"
    return _state == "running"


def filled() -> bool:
    """Whether the filler this process started has ended (successfully or not): checked at
    most once a second, so that the hot path may ask on every call."""
    global _state, _polled
    if _state != "running":
        return _state == "ended"
    now = time.monotonic()
    if now - _polled < 1.0:
        return False
    _polled = now
    try:
        ended = os.waitpid(_filler, os.WNOHANG)[0] != 0
    except ChildProcessError:  # reaped by the script's own os.wait()
        ended = True
    if ended:
        _state = "ended"
    return ended


def _forget() -> None:
    """A forked child neither waits for its parent's filler nor starts one of its own."""
    global _state
    if _state == "running":
        _state = "off"


os.register_at_fork(after_in_child=_forget)


def _lock_path() -> str:
    return os.path.join(tempfile.gettempdir(), f"hooktrace-kernels-{os.getuid()}.lock")


def _compile_all() -> None:
    """Compile every kernel hooktrace loads into numba's cache (what :func:`load` would find)."""
    from hooktrace.recorder import histogram_kernel, kernel, staged_kernels

    kernel.warm_up()
    staged_kernels.warm_up()
    histogram_kernel.warm_up()


def _yield_to_training() -> None:
    """Run only on cores nothing else wants: beside a training on every core (torch's
    OpenMP threads), a filler at normal priority made the first recording's steps slower by
    far more than the core it took."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # Linux
    with contextlib.suppress(OSError):
        os.nice(19)


if __name__ == "__main__":
    _yield_to_training()
    with open(_lock_path(), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one filler at a time; a later one finds the cache full
        _compile_all()
