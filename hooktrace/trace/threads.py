"""Reading files two at a time, in order: what ``hooktrace check`` uses to read a run's parts
and segments. pyarrow and zlib decode without the GIL, so a second thread reads while the
first folds what it read. Never imports torch."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

_T = TypeVar("_T")
_R = TypeVar("_R")

WORKERS = 2
"""Reads running at once."""
AHEAD = 4
"""Reads submitted and not yet handed out, at most (the one handed out included): what is
held is a few files' results."""


def read_in_threads(
    read: Callable[[_T], _R], items: Iterable[_T]
) -> Generator[tuple[_T, _R | Exception], None, None]:
    """``(item, read(item))`` for each item, in the items' order, :data:`WORKERS` read at a
    time and at most :data:`AHEAD` ahead; an exception a read raises is handed out in place
    of its result, for the caller to judge. Closing the generator cancels the reads not
    started and waits for those running; an interrupt (Ctrl-C) does not wait for them."""
    pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="hooktrace-read")
    pending: deque[tuple[_T, Future[_R]]] = deque()
    wait = True
    try:
        for item in items:
            pending.append((item, pool.submit(read, item)))
            while len(pending) >= AHEAD or (pending and pending[0][1].done()):
                done, future = pending.popleft()
                found = _outcome(future)
                yield done, found
        while pending:
            done, future = pending.popleft()
            found = _outcome(future)
            yield done, found
    except (KeyboardInterrupt, SystemExit):
        wait = False
        raise
    finally:
        pool.shutdown(wait=wait, cancel_futures=True)


def _outcome(future: Future[_R]) -> _R | Exception:
    try:
        return future.result()
    except Exception as exc:  # the caller's to judge, as if it had read the item itself
        return exc
