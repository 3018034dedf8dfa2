"""numba's cache of hooktrace's kernels: loaded where it holds them, filled elsewhere where not.

Compiling the kernels takes a minute or two on a machine whose numba cache lacks them (a
fresh install, a new numba or hooktrace); loading them from the cache takes about half a
second. A recording must not wait for the compile, so the recorder never compiles a kernel
in its own process (unless ``HOOKTRACE_ONE_PASS=wait`` asks it to):

- :func:`load` runs a kernel set's warm-up only where every kernel it calls is in numba's
  cache. At the first kernel missing it stops, having compiled nothing, and says so: numba
  announces each compile with a ``numba:compile`` event (numba's event API) before it
  starts, and the listener installed here raises there, in this thread only.
- :func:`fill` then starts a process of its own (:func:`main`) that compiles every kernel
  into the cache, detached and at idle priority, while the recording goes on. One compiles at
  a time per user and cache (a file lock): the fillers of other ranks wait for it, then load
  what it compiled, a few seconds.
- :func:`filled` says when the filler this process started has ended, so that the recorder
  loads the kernels then, mid-run (:func:`hooktrace.recorder.stats.stats.route`). Beside a
  training that keeps every core busy, an idle-priority filler may only get to run once the
  training has ended.
- The filler never outlives the process that started it. At that process's exit, a filler
  still compiling is waited for (:func:`_finish_at_exit`: a line on stderr says why, at most
  :data:`EXIT_WAIT_S`, Ctrl-C skips it), so that a short first run still fills the cache; and
  once that process has gone, however it ended (killed by a scheduler, a timeout, SIGKILL),
  the filler ends too, within a moment (:func:`_end_with`). A CI job or a batch scheduler
  finds nothing of hooktrace's left behind.

Why not compile in a thread of the recording's own process: short runs on a cold cache that
exited while such a thread compiled ended with ``terminate called without an active
exception`` (SIGABRT) in up to one try in three. The likely cause: at exit CPython stops a
daemon thread where it next takes the interpreter lock (python/cpython#124149), here inside
LLVM's C++ frames. It never showed on demand, so the design removes the situation: nothing of
hooktrace's runs in the recording's process once the recording has ended.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import os
import select
import sys
import tempfile
import threading
import time
from collections.abc import Callable

_state = "idle"
"""The filler, as this process knows it: ``idle`` (not needed yet), ``running`` (started
here), ``ended``, or ``off`` (it could not start, or a fork's parent started it)."""
_report = -1
"""The read end of the filler's report pipe while it runs."""
_polled = 0.0
_succeeded = False
_said = b""
"""What the filler has written on the report pipe so far."""

EXIT_WAIT_S = 300.0
"""How long a process's exit waits for its filler to finish: about four times what the
compile takes on a free core of the 2-core CI machine (75 to 85 s)."""


class _Cold(BaseException):
    """Raised into a warm-up where numba would compile: a BaseException, so that code between
    the warm-up and numba that keeps going on an Exception (:func:`omp.join`) lets it by."""


def compile_here() -> bool:
    """Whether ``HOOKTRACE_ONE_PASS=wait`` asks this process to compile what the cache lacks."""
    return os.environ.get("HOOKTRACE_ONE_PASS") == "wait"


def compile_in_turn(warm_up: Callable[[], object]) -> None:
    """Run ``warm_up`` here, compiling what numba's cache lacks (``HOOKTRACE_ONE_PASS=wait``),
    once no other process is compiling into the same cache (a filler, or another process
    waiting so: the ranks of a torchrun, the workers of a test run): what that one compiled
    is then loaded, in a few seconds, not compiled again beside it."""
    try:
        lock = open(_lock_path(), "a")  # noqa: SIM115 (held for the warm-up below)
    except OSError:  # no temporary folder to lock in: compile with no turn taken
        warm_up()
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        warm_up()


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


_LAUNCH = """
import os, sys
os.posix_spawn(sys.executable, [sys.executable, "-c", *sys.argv[1:]], os.environ, setsid=True)
"""
"""Run by a short-lived process that starts the filler and ends at once: the filler is then
no child of the recording's process, which a script's own ``os.wait()`` or SIGCHLD handler
would otherwise meet. ``setsid``: a Ctrl-C meant for the training does not stop it."""

_FILL = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "import hooktrace.recorder.stats.kernel_cache as c; c.main(int(sys.argv[2]))"
)
"""The filler, given where this process found hooktrace (not a hooktrace the working folder
holds: it would compile another file, and numba's cache would never match this one)."""

_REPORT_FD = 3
"""The filler's end of a pipe to the recording's process: it writes ``ok`` there once the
cache is full, and the pipe's end of file says it has ended, whatever became of it."""


def fill() -> bool:
    """Start the process that compiles the kernels into numba's cache, once per process, and
    say whether it runs; where it cannot start (a frozen application, a process limit), the
    kernels stay unloaded and the eager routes give the statistics."""
    global _state, _report
    if _state != "idle":
        return _state == "running"
    _state = "off"
    if getattr(sys, "frozen", False) or not sys.executable:
        return False  # sys.executable is the application itself, or nothing
    from hooktrace.package import FOLDER

    read, write = os.pipe()
    try:
        if write == _REPORT_FD:  # dup2 onto itself would keep close-on-exec
            write, old = os.dup(write), write
            os.close(old)
        package_parent = str(FOLDER.parent)
        launcher = os.posix_spawn(
            sys.executable,
            [sys.executable, "-I", "-S", "-c", _LAUNCH, _FILL, package_parent, str(_REPORT_FD)],
            os.environ,
            file_actions=[  # the pipe first: in a process without stdout it may be fd 1
                (os.POSIX_SPAWN_DUP2, write, _REPORT_FD),
                *((os.POSIX_SPAWN_OPEN, fd, os.devnull, os.O_RDWR, 0) for fd in (0, 1, 2)),
            ],
        )
        with contextlib.suppress(ChildProcessError):  # the script's SIGCHLD handler took it
            os.waitpid(launcher, 0)
    except (OSError, AttributeError, TypeError):  # no posix_spawn, or no process to be had
        os.close(read)
        return False
    finally:
        os.close(write)
    os.set_blocking(read, False)
    _report, _state = read, "running"
    atexit.register(_finish_at_exit)
    return True


def filled() -> bool:
    """Whether the filler this process started has ended (successfully or not): checked at
    most once a second, so that the hot path may ask on every call."""
    global _polled
    if _state != "running":
        return _state == "ended"
    now = time.monotonic()
    if now - _polled < 1.0:
        return False
    _polled = now
    return _drain()


def _drain() -> bool:
    """Read what the filler has written, and whether it has ended (its end of the pipe is
    closed, whatever became of it); on its end, close this end and keep what it said."""
    global _state, _said, _succeeded
    try:
        while chunk := os.read(_report, 16):
            _said += chunk
    except BlockingIOError:
        return False  # still compiling
    os.close(_report)
    _state, _succeeded = "ended", _said.startswith(b"ok")
    return True


def _wait(seconds: float) -> bool:
    """Wait at most ``seconds`` for the filler to end; say whether it has."""
    deadline = time.monotonic() + seconds
    while _state == "running":
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        select.select([_report], [], [], left)
        _drain()
    return True


def _finish_at_exit() -> None:
    """At this process's exit, let a filler still compiling finish, so that the next run
    loads the kernels; it ends with this process otherwise (:func:`_end_with`). A Ctrl-C
    anywhere in here, even before the line that offers it, skips the wait."""
    if _state != "running":
        return
    try:
        if _wait(0.5):
            return
        _say(
            "hooktrace: compiling its faster statistics kernels for this machine, once, before"
            f" exiting (a minute or two, at most {EXIT_WAIT_S / 60:.0f} min; Ctrl-C skips it,"
            " and the next run compiles them again)"
        )
        if _wait(EXIT_WAIT_S):
            return
    except KeyboardInterrupt:
        pass
    _say("hooktrace: the kernels were not compiled; the next run starts again")


def _say(line: str) -> None:
    with contextlib.suppress(Exception):  # no stderr left to say it on
        print(line, file=sys.stderr, flush=True)


def succeeded() -> bool:
    """Whether the filler this process started said it filled the cache."""
    return _succeeded


def _forget() -> None:
    """A forked child neither waits for its parent's filler nor starts one of its own."""
    global _state
    if _state == "running":
        with contextlib.suppress(OSError):
            os.close(_report)
        _state = "off"


os.register_at_fork(after_in_child=_forget)


def _lock_path() -> str:
    """One filler at a time per user and numba cache."""
    cache = hashlib.sha256(os.environ.get("NUMBA_CACHE_DIR", "").encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"hooktrace-kernels-{os.getuid()}-{cache}.lock")


def warm_up() -> str | None:
    """Compile, or load from numba's cache, every kernel the recorder uses: what the filler
    compiles is what the recording loads. Returns why the one-pass kernel keeps to one
    thread, or None (:func:`hooktrace.recorder.stats.kernel.warm_up`)."""
    from hooktrace.recorder.stats import histogram_kernel, kernel, staged_kernels

    single = kernel.warm_up()
    staged_kernels.warm_up()  # the small tensors' kernels, and the histograms', with it
    histogram_kernel.warm_up()
    return single


def _yield_to_training() -> None:
    """Run only on cores nothing else wants: beside a training on every core (torch's
    OpenMP threads), a filler at normal priority made the first recording's steps slower by
    far more than the core it took."""
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # Linux
    with contextlib.suppress(OSError):
        os.nice(19)


def _end_with(report: int) -> None:
    """End this filler as soon as the process that started it has gone, however it ended: a
    thread waits for the report pipe to lose its reader (``POLLERR``: the pipe's far end was
    that process's, and its forks drop theirs, :func:`_forget`)."""

    def watch() -> None:
        poller = select.poll()
        poller.register(report, 0)  # only errors and hang-ups: no reader left
        poller.poll()
        os._exit(1)  # numba writes each cache file whole (a rename), or not at all

    threading.Thread(target=watch, name="hooktrace-filler-watch", daemon=True).start()


def main(report: int | None = None) -> None:
    """The filler: wait for any other (another rank's), then compile what the cache lacks
    (loading what it holds), and say so on the ``report`` pipe where :func:`fill` gave one."""
    _yield_to_training()
    if report is not None:
        _end_with(report)
    with open(_lock_path(), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        warm_up()
    if report is not None:
        os.write(report, b"ok")


if __name__ == "__main__":
    main()
