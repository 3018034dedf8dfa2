"""hooktrace.recorder.records.observe and the in-place reads under it: what the hot path keeps
between tensors (the latest ones summarised, the blocks rows are read into) never changes a
record."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import torch

from hooktrace.recorder.records.layout import Meta
from hooktrace.recorder.records.observe import Histograms, Observer
from hooktrace.recorder.records.pending import PendingStep
from hooktrace.recorder.records.staging import Staging, StagingPool
from hooktrace.recorder.stats import numba_kernels
from hooktrace.recorder.stats.stats import route


def _observer() -> tuple[Observer, PendingStep]:
    observer = Observer(max_units=4096, max_tensor_bytes=1 << 20, histograms=Histograms(print))
    return observer, PendingStep(0, 0.0, staging=Staging(StagingPool()))


def test_a_tensor_met_again_where_units_are_counted_gets_its_counts() -> None:
    """A tensor summarised first without units (a parameter, a gradient) and met again as a
    module's output, unchanged, takes its per-unit counts then: the summary remembered
    from the first meeting has none to give. Whether it is still remembered (a few tensors
    came between) must not change the record."""
    generator = torch.Generator().manual_seed(0)
    for between in range(6):
        observer, step = _observer()
        shared = torch.randn(2, 8, generator=generator)
        met = [("p", shared, False)]
        met += [(f"other{k}", torch.randn(2, 8, generator=generator), True) for k in range(between)]
        met += [("m", shared, True)]
        for name, tensor, units in met:
            observer.observe(step, 0, name, 0, "output", "0", tensor, phase="train",
                             full=False, units=units)  # fmt: skip
        first, last_met = Meta(*step.meta[0]), Meta(*step.meta[-1])
        assert first.units == 0 and last_met.units == 8, between
        last = len(step.meta) - 1
        (counts,) = [c for row, c in step.activity if row == last]
        assert np.asarray(counts).tolist() == (shared > 0).sum(dim=0).tolist()


def test_rows_read_in_place_by_several_threads_are_each_their_own() -> None:
    """Hooks may fire in several threads (DataParallel, a backward on a device): each read
    takes its own row and counts in the shared blocks, past the blocks' ends too."""
    route()
    kernels = numba_kernels.staged()
    assert kernels is not None
    # the kernel takes each call's place holding the GIL: compiled with nogil, two threads
    # could take one place (a race this test would very rarely meet)
    from hooktrace.recorder.stats import staged_kernels

    assert not staged_kernels._one_in_place.targetoptions.get("nogil")
    in_place = kernels.InPlace()
    results: list[tuple[torch.Tensor, np.ndarray, np.ndarray]] = []
    lock = threading.Lock()

    def read(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        mine = []
        for _ in range(150):  # more than a block of rows, together
            tensor = torch.randn(3, 5, generator=generator)
            summed = in_place.summarize(tensor, 1)
            assert summed is not None
            mine.append((tensor, summed[0], summed[1]))
        with lock:
            results.extend(mine)

    def switch(frame: object, event: str, arg: object) -> None:
        if event == "c_call":  # another thread runs before each C call: a race shows
            time.sleep(0)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(4)]
    threading.setprofile(switch)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        threading.setprofile(None)
    assert len(results) == 600
    for tensor, row, counts in results:
        values = tensor.double()
        assert row[0] == values.numpy().mean() and row[3] == values.max().item()
        assert counts.tolist() == (tensor > 0).sum(dim=0).tolist()


def test_histograms_of_values_that_moved_or_grew_are_read_where_they_are_now() -> None:
    """A kind's histogram places are kept from step to step: a value that starts where
    another did but holds more values (a view of a longer run) is read whole."""
    route()
    kernels = numba_kernels.histograms()
    assert kernels is not None
    reads = kernels.TensorsInPlace()
    storage = torch.cat([torch.full((4,), 1.0), torch.full((4,), -3.0)])
    for tensors in ([storage[:4]], [storage], [storage[:4], storage[4:]]):
        got = reads.histograms(tensors).rows()  # cut to their spans: read in place
        want = kernels.histogram_tensors(tensors)
        assert np.array_equal(got, want)
        assert got.sum(axis=1).tolist() == [t.numel() for t in tensors]


def test_a_records_metadata_leaves_the_collectors_watch_at_its_first_look() -> None:
    """A step's records stay alive until the writer takes them: held in anything the
    cyclic collector keeps tracking (a NamedTuple, a tuple holding a shape's tuple made
    new), each one alive at a collection of the second generation counts towards the next
    full collection, which took 350 to 450 ms every hundred steps of the 200-layer
    benchmark. Queued as plain tuples of values it does not track, the first young
    collection that sees them stops tracking them, from the second step on (the first
    meets the shapes)."""
    tensors = [torch.randn(2, 8), torch.randn(3, 4, 5, 5), torch.arange(6)]
    for _ in range(2):  # two steps
        observer, step = _observer()
        for k, tensor in enumerate(tensors):
            observer.observe(step, 0, f"m{k}", 0, "output", "0", tensor.clone(),
                             phase="train", full=False, units=True)  # fmt: skip
        gc.collect(1)  # the young generations, once
        assert len(step.meta) == 3
    assert not any(gc.is_tracked(meta) for meta in step.meta)


def test_a_tensor_with_no_memory_of_its_own_is_recorded_from_a_copy() -> None:
    """A module may return an efficient zero tensor, which says it lies at address 0: the
    hook's kernel read there and ended the process (found in review). It is staged, and
    its record is that of six zeros."""
    route()
    observer, step = _observer()
    zero = torch._efficientzerotensor(2, 3)
    for tensor in (torch.ones(2, 3), zero):  # the first loads the kernels the second meets
        observer.observe(step, 0, "m", 0, "output", "0", tensor, phase="train", full=False,
                         units=True)  # fmt: skip
    assert len(step.meta) == 2 and len(step.stats) == 2
    data = step.materialize()
    columns = data.columns
    assert (columns["mean"][1], columns["max"][1], columns["zero_fraction"][1]) == (0, 0, 1)
    (counts,) = [c for row, c in data.activity if row == 1]  # no positive value a unit
    assert np.asarray(counts).tolist() == [0, 0, 0]
