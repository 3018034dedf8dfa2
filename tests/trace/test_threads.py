"""Reading two at a time, in order (trace/threads.py): what hooktrace check reads with."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from hooktrace.trace import threads
from hooktrace.trace.threads import read_in_threads


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hooktrace-read")]


def test_results_come_in_order_and_two_are_read_at_once() -> None:
    both = threading.Barrier(2, timeout=5)  # a read of 0 waits for a read of 1: two at once

    def read(item: int) -> int:
        if item < 2:
            both.wait()
        time.sleep(0.01 * (5 - item))  # later items finish first
        return item * 10

    assert list(read_in_threads(read, range(6))) == [(i, i * 10) for i in range(6)]
    assert _threads() == []


def test_an_error_is_handed_out_in_place_of_its_result() -> None:
    def read(item: int) -> int:
        if item == 2:
            raise OSError("damaged")
        return item

    found = list(read_in_threads(read, range(4)))
    assert [item for item, _ in found] == [0, 1, 2, 3]
    assert isinstance(found[2][1], OSError) and [r for _, r in found if isinstance(r, int)] == [
        0,
        1,
        3,
    ]


def test_closing_cancels_the_reads_not_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "WORKERS", 1)  # reads 2 and 3 wait for the one thread
    pulled = threading.Event()  # all four items submitted
    release = threading.Event()
    started: list[int] = []

    def items() -> Iterator[int]:
        for item in range(100):
            if item == threads.AHEAD - 1:
                pulled.set()
            yield item

    def read(item: int) -> int:
        started.append(item)
        if item == 0:
            assert pulled.wait(5)
        else:
            assert release.wait(5)
        return item

    reads = read_in_threads(read, items())
    assert next(reads) == (0, 0)  # meanwhile 1 runs (until released), 2 and 3 wait
    threading.Timer(0.2, release.set).start()
    reads.close()  # cancels 2 and 3, waits for 1
    assert _threads() == []
    # 1 ran, or was cancelled too if the thread had not taken it yet; 2 and 3 never ran
    assert started in ([0], [0, 1])


def test_an_interrupt_does_not_wait_for_the_reads_running() -> None:
    release = threading.Event()

    def read(item: int) -> int:
        if item > 0:
            release.wait(5)
        return item

    reads = read_in_threads(read, range(10))
    assert next(reads) == (0, 0)
    began = time.perf_counter()
    with pytest.raises(KeyboardInterrupt):
        reads.throw(KeyboardInterrupt)
    assert time.perf_counter() - began < 1  # the reads of 1 and 2 still wait
    release.set()
    for _ in range(500):
        if not _threads():
            break
        time.sleep(0.01)
    assert _threads() == []


def test_what_is_held_is_bounded_by_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    # AHEAD 1: each read handed out before the next is submitted, whatever the threads
    monkeypatch.setattr(threads, "AHEAD", 1)
    running = 0
    most = 0
    lock = threading.Lock()

    def read(item: int) -> int:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.005)
        with lock:
            running -= 1
        return item

    held = [item for item, _ in read_in_threads(read, range(20))]
    assert held == list(range(20)) and most == 1
