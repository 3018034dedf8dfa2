"""Reading ahead for diff (analyze/diff/read.py): order, overlap, errors, memory, threads."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from hooktrace.analyze.diff.read import in_chunks, read_ahead


class Box:
    """A read's result that a weak reference can watch."""

    def __init__(self, chunk: int) -> None:
        self.chunk = chunk


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("hooktrace-diff-read")]


def test_chunks_come_in_order_and_the_next_is_read_meanwhile() -> None:
    started: list[int] = []
    release = {i: threading.Event() for i in range(4)}

    def read(chunk: int) -> Box:
        started.append(chunk)
        if chunk > 0:
            assert release[chunk].wait(5), f"chunk {chunk} was never released"
        return Box(chunk)

    seen = []
    for chunk, (box,) in read_ahead(range(4), [read]):
        assert box.chunk == chunk
        seen.append(chunk)
        # the caller works on this chunk while the next one is being read
        for _ in range(500):
            if chunk + 1 >= 4 or chunk + 1 in started:
                break
            threading.Event().wait(0.01)
        assert chunk + 1 >= 4 or chunk + 1 in started
        if chunk + 1 < 4:
            release[chunk + 1].set()
    assert seen == [0, 1, 2, 3]
    assert _threads() == []


def test_a_chunk_is_held_only_while_the_caller_holds_it() -> None:
    alive: list[weakref.ref[Box]] = []

    def read(chunk: int) -> Box:
        box = Box(chunk)
        alive.append(weakref.ref(box))
        return box

    for chunk, (box,) in read_ahead(range(5), [read]):
        del box
        gc.collect()
        # what was handed out before this chunk is gone; at most this chunk's and the next
        assert all(ref() is None for ref in alive[:chunk]), chunk
        assert alive[chunk]() is None


def test_an_error_in_a_read_reaches_the_caller_and_no_thread_is_left() -> None:
    def read(chunk: int) -> Box:
        if chunk == 2:
            raise OSError("disk gone")
        return Box(chunk)

    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for chunk, _ in read_ahead(range(5), [read]):
            seen.append(chunk)
    assert seen == [0, 1]
    assert _threads() == []


def test_stopping_early_waits_for_the_read_in_flight_and_reads_no_more() -> None:
    started: list[int] = []

    def read(chunk: int) -> Box:
        started.append(chunk)
        return Box(chunk)

    reads = read_ahead(range(100), [read])
    for chunk, _ in reads:
        if chunk == 3:
            break
    reads.close()
    assert _threads() == []
    assert started == [0, 1, 2, 3, 4]  # one chunk past the last asked for


def test_each_read_has_a_thread_of_its_own_and_sees_its_chunks_in_order() -> None:
    # read "a" of a chunk waits until read "b" of the same chunk has begun: one thread for
    # both would never get there
    begun = {chunk: threading.Event() for chunk in range(4)}
    seen: dict[str, list[int]] = {"a": [], "b": []}

    def read_a(chunk: int) -> Box:
        assert begun[chunk].wait(5), f"read b of chunk {chunk} never began"
        seen["a"].append(chunk)
        return Box(chunk)

    def read_b(chunk: int) -> Box:
        begun[chunk].set()
        seen["b"].append(chunk)
        return Box(chunk)

    got = [(chunk, a.chunk, b.chunk) for chunk, (a, b) in read_ahead(range(4), [read_a, read_b])]
    assert got == [(c, c, c) for c in range(4)]
    assert seen == {"a": [0, 1, 2, 3], "b": [0, 1, 2, 3]}
    assert _threads() == []


def test_chunks_are_whole_steps_of_about_the_budget() -> None:
    steps, sizes = [0, 1, 2, 5, 6], [3, 3, 3, 10, 1]
    assert list(in_chunks(steps, sizes, 6)) == [[0, 1], [2, 5], [6]]
    assert list(in_chunks(steps, sizes, 100)) == [steps]
    assert list(in_chunks([], [], 6)) == []
    # a small first chunk, then the budget
    assert list(in_chunks(steps, sizes, 6, first=3)) == [[0], [1, 2], [5], [6]]
    assert list(in_chunks(steps, sizes, 100, first=1)) == [[0], [1, 2, 5, 6]]
