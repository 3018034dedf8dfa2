"""Run a training script as ``python SCRIPT ARGS`` would, with recording installed first.

The script's output, exit code and exceptions pass through unchanged: an uncaught exception
prints the script's own traceback (hooktrace's frames cut off) and exits 1; SIGINT and
SIGTERM finalize the trace, then end the process as they would have without hooktrace.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib.machinery
import io
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from hooktrace.recorder.recording.discover import ScriptRecorder
from hooktrace.trace import schema


class Terminated(BaseException):
    """Raised in the main thread by SIGTERM, as SIGINT raises KeyboardInterrupt: not an
    Exception, so neither hooks nor most scripts catch it on the way out."""


def run_script(
    script: str,
    args: list[str],
    *,
    out: Path,
    options: dict[str, Any],
    command: list[str],
    started: Callable[[], object] = lambda: None,
) -> int:
    """Record ``script`` (its path as the user gave it) into ``out``; returns the exit code
    the script would have had. ``started`` is called once the recording has begun.

    Exits the process by the signal itself when the script was ended by SIGINT or SIGTERM.
    """
    recorder = ScriptRecorder(str(out), command=command, **options)
    started()
    # as `python SCRIPT` sets them: argv[0] as given, __file__ absolute but neither normalised
    # nor resolved (a symlinked script reads the files beside the link), and the import path
    # the directory of the file the link points to
    path = script if os.path.isabs(script) else os.path.join(os.getcwd(), script)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.realpath(path))
    previous_term = signal.getsignal(signal.SIGTERM)

    recording_pid = os.getpid()

    finishing = threading.Lock()  # the main thread's or the watch's, whichever comes first

    def finish_terminated() -> None:
        with finishing:
            recorder.close(status=schema.STATUS_INCOMPLETE, error="terminated by SIGTERM")

    watch: _SigtermWatch | None = None

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != recording_pid:
            # a process forked from the script (a DataLoader or pool worker) inherited this
            # handler: it dies of the signal, as it would have unrecorded
            _die_by(signal.SIGTERM, signal.SIG_DFL)
            return
        if watch is not None:
            watch.handling.set()
        # only raise: finishing the trace here could wait on a lock the interrupted code holds
        raise Terminated()

    if previous_term in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, on_sigterm)
        watch = _SigtermWatch.start(
            finish_terminated, ours=lambda: signal.getsignal(signal.SIGTERM) is on_sigterm
        )
    try:
        _run_as_main(path)
    except SystemExit as exc:
        code = _exit_code(exc.code)
        if code == 0:
            recorder.close()
        else:
            recorder.close(status=schema.STATUS_FAILED, error=f"the script exited with code {code}")
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)  # sys.exit("message") prints the message
        return code
    except Terminated:
        finish_terminated()
        _die_by(signal.SIGTERM, signal.SIG_DFL)
        return 128 + signal.SIGTERM  # not reached
    except KeyboardInterrupt as exc:
        recorder.close(status=schema.STATUS_INCOMPLETE, error="interrupted by SIGINT")
        _print_script_traceback(exc, path)
        _die_by(signal.SIGINT, signal.SIG_DFL)
        return 130  # not reached
    except BaseException as exc:
        recorder.close(status=schema.STATUS_FAILED, error=f"{type(exc).__name__}: {exc}")
        _print_script_traceback(exc, path)
        if isinstance(exc, ValueError) and "env:// rendezvous" in str(exc):
            print(
                "hooktrace: the script starts torch.distributed from the environment torchrun "
                "sets: run it as torchrun --nproc-per-node N -m hooktrace record [OPTIONS] "
                f"{script}",
                file=sys.stderr,
            )
        return 1
    finally:
        if watch is not None:
            watch.stop()
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous_term or signal.SIG_DFL)
    recorder.close()
    return 0


class _SigtermWatch:
    """SIGTERM while the script is inside a call that does not come back to Python.

    Unrecorded, SIGTERM ends the process at once, wherever its main thread is. Recorded, it
    raises :class:`Terminated` from a Python handler, which runs only once the main thread is
    back in the interpreter: a script blocked in a rendezvous, or in a collective waiting for
    a dead peer, ignored the SIGTERM torchrun sends until its SIGKILL came 30 s later, and the
    trace was never finished. Python's own signal handler writes the signal's number to the
    wakeup fd at once, whichever thread it interrupts: this watch's thread reads it, and where
    the main thread has not begun to handle it within :data:`GRACE_S`, finishes the trace
    itself (at most :data:`FINISH_S`) and ends the process by the signal.

    A SIGTERM handler the script sets is the script's: the watch acts only while SIGTERM's
    handler is hooktrace's. The wakeup fd is one per process: a script (or a library,
    asyncio's signal handlers) that sets its own takes it over, and SIGTERM then waits for
    the main thread as before; one set before the recording is left alone, and no watch
    starts. A script that sets one gets hooktrace's back where it would have got -1 (trio
    warns of it). A forked child forgets the watch (:func:`_forget_in_child`): its signals
    are its own."""

    GRACE_S = 1.0
    FINISH_S = 10.0

    def __init__(self, finish: Callable[[], object], ours: Callable[[], bool]) -> None:
        self.handling = threading.Event()  # set by the main thread's handler as it starts
        self._finish = finish
        self._ours = ours  # whether SIGTERM's handler is still hooktrace's
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # (as set_wakeup_fd requires)
        self._thread = threading.Thread(target=self._watch, name="hooktrace-sigterm", daemon=True)

    @classmethod
    def start(
        cls, finish: Callable[[], object], *, ours: Callable[[], bool]
    ) -> _SigtermWatch | None:
        """A watch calling ``finish`` before the process dies of a SIGTERM its main thread did
        not handle while ``ours()`` (hooktrace's handler, not one the script set since), or
        None where the wakeup fd is taken, this is not the main thread, or the system forks
        no processes (Windows)."""
        global _watching, _forgets_in_children
        if not hasattr(os, "register_at_fork"):
            return None
        watch = cls(finish, ours)
        try:
            earlier: int | None = signal.set_wakeup_fd(watch._write, warn_on_full_buffer=False)
        except ValueError:
            earlier = None
        if earlier != -1:
            if earlier is not None:
                signal.set_wakeup_fd(earlier)
            watch._close()
            return None
        if not _forgets_in_children:
            os.register_at_fork(after_in_child=_forget_in_child)
            _forgets_in_children = True
        _watching = watch
        watch._thread.start()
        return watch

    def stop(self) -> None:
        """Give the wakeup fd back (unless the script has set its own since) and end the thread."""
        global _watching
        _watching = None
        current = signal.set_wakeup_fd(-1)
        if current != self._write:  # the script's own, set since: it stays
            signal.set_wakeup_fd(current)
        os.close(self._write)  # the thread reads the end of the pipe, and ends
        self._thread.join(timeout=self.GRACE_S + self.FINISH_S)
        if not self._thread.is_alive():
            os.close(self._read)

    def _watch(self) -> None:
        while True:
            try:
                signals = os.read(self._read, 64)
            except OSError:
                return
            if not signals:  # stopped
                return
            if int(signal.SIGTERM) not in signals or not self._ours():
                continue  # (a handler the script set is the script's: it ends as it will)
            if self.handling.wait(self.GRACE_S):  # the main thread took it
                self.handling.clear()
                continue
            finishing = threading.Thread(target=self._finish, daemon=True)
            finishing.start()
            finishing.join(self.FINISH_S)
            _die_from_thread(signal.SIGTERM)

    def _close(self) -> None:
        os.close(self._read)
        os.close(self._write)


_watching: _SigtermWatch | None = None
_forgets_in_children = False


def _forget_in_child() -> None:
    """In a child forked while a watch ran: no watch (its thread is not there), and its
    signals are not written into the parent's pipe, where the parent's watch would take a
    SIGTERM meant for a DataLoader worker for its own."""
    global _watching
    watch, _watching = _watching, None
    if watch is None:
        return
    with contextlib.suppress(ValueError):
        current = signal.set_wakeup_fd(-1)
        if current != watch._write:  # the script's own, set since: it stays
            signal.set_wakeup_fd(current)
    watch._close()


def _die_from_thread(signum: signal.Signals) -> None:
    """End the process by ``signum`` from a thread other than the main one, as the signal
    would have unrecorded: ``signal.signal`` refuses such a thread, and the C library's
    ``signal`` puts the default back for the whole process."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.signal.restype = ctypes.c_void_p
    libc.signal(int(signum), None)  # SIG_DFL
    os.kill(os.getpid(), signum)
    time.sleep(1.0)  # it is delivered at once; should it not be:
    os._exit(128 + int(signum))


def _run_as_main(script: str) -> None:
    """Run ``script`` as ``python script`` does: in a new module ``__main__`` that stays in
    ``sys.modules``. The interpreter's teardown then empties it first, one name at a time, as it
    does a script's: a file the script never closed is flushed before it is freed. (A script
    run by ``runpy.run_path`` leaves a namespace in a reference cycle once it returns; the
    garbage collector may then free a file's raw stream before the buffer that holds its
    last writes.)"""
    module = type(sys)("__main__")
    module.__dict__.update(
        __file__=script,
        __cached__=None,
        __builtins__=builtins,
        __loader__=importlib.machinery.SourceFileLoader("__main__", script),
        __spec__=None,
        __package__=None,
    )
    with io.open_code(script) as source:
        code = compile(source.read(), script, "exec")
    sys.modules["__main__"] = module
    exec(code, module.__dict__)


def _exit_code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    return 1


def _print_script_traceback(exc: BaseException, script: str) -> None:
    """The traceback Python would print, from the script's first frame on."""
    tb: TracebackType | None = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != script:
        tb = tb.tb_next
    compiled = isinstance(exc, SyntaxError) and exc.filename == script
    if tb is None and not compiled:  # not the script's own error: all of it
        tb = exc.__traceback__
    # a script that does not compile never ran: Python shows where, and no frame
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
    sys.stderr.flush()


def _die_by(signum: signal.Signals, handler: Any) -> None:
    """End the process the way ``signum`` would have without hooktrace."""
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(
        signum, handler if callable(handler) or handler == signal.SIG_IGN else signal.SIG_DFL
    )
    os.kill(os.getpid(), signum)
