"""Run a training script as ``python SCRIPT ARGS`` would, with recording installed first.

The script's output, exit code and exceptions pass through unchanged: an uncaught exception
prints the script's own traceback (hooktrace's frames cut off) and exits 1; SIGINT and
SIGTERM finalize the trace, then end the process as they would have without hooktrace.
"""

from __future__ import annotations

import builtins
import importlib.machinery
import io
import os
import signal
import sys
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

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        if os.getpid() != recording_pid:
            # a process forked from the script (a DataLoader or pool worker) inherited this
            # handler: it dies of the signal, as it would have unrecorded
            _die_by(signal.SIGTERM, signal.SIG_DFL)
            return
        # only raise: finishing the trace here could wait on a lock the interrupted code holds
        raise Terminated()

    if previous_term in (signal.SIG_DFL, None):
        signal.signal(signal.SIGTERM, on_sigterm)
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
        recorder.close(status=schema.STATUS_INCOMPLETE, error="terminated by SIGTERM")
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
        return 1
    finally:
        if signal.getsignal(signal.SIGTERM) is on_sigterm:
            signal.signal(signal.SIGTERM, previous_term or signal.SIG_DFL)
    recorder.close()
    return 0


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
