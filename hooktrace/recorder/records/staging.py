"""Small tensors' values, copied aside in the hook for the writer to summarise.

A hook that meets a small CPU tensor (``stats.STAGED_MAX_VALUES`` values or fewer) copies its
values into the step's float64 buffer, one ``copy_``, and queues where they went
(:class:`Staged`); the writer thread summarises all of a step's staged tensors together
(``stats.summarize_staged``). For small tensors that beats a handful of reductions in the
hook, each a dispatch and a ``.item()``. Apart from :mod:`hooktrace.recorder.records.pending` because
the buffers outlive a step: the pool hands them from step to step.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
from torch._utils import _flatten_dense_tensors

from hooktrace.trace.writer import HOLD_STEPS


class Staged(NamedTuple):
    """Statistics still to compute, of the tensor staged ``position``-th in the step."""

    position: int


class StagedUnits(NamedTuple):
    """Per-unit activity still to count, of a staged tensor of ``shape`` along ``dim``."""

    position: int
    shape: tuple[int, ...]
    dim: int

    @property
    def units(self) -> int:
        return self.shape[self.dim]


class StagingPool:
    """Buffers that outlive a step, reused from step to step: float64 ones that small tensors'
    values are copied into (the default), int64 ones that histograms are counted into (a
    block a step for each kind histogrammed together: parameters, buffers, gradients). The
    writer thread gives them back once the step's statistics and histograms are computed.

    Why not a copy per tensor: a few dozen allocations a step fewer in the hooks, and no
    concatenation in the writer. Small allocations that live for a step also change how the
    C allocator reuses the heap: in one measurement (the reference CNN, one thread) the
    training's own large tensors then took about 1,500 more page faults a step, more time than
    the statistics themselves; with the pool, no more than without recording. New megabytes
    of counts each step took the training thread 545 to 755 faults a step in two runs of three
    (``getrusage``, the 200-layer model of ``bench_host.py``, 2026-11-30).
    """

    def __init__(
        self,
        *,
        dtype: torch.dtype = torch.float64,
        keep: int = HOLD_STEPS + 4,
        keep_values: int = 1 << 20,
    ) -> None:
        self._lock = threading.Lock()
        self._dtype = dtype
        self._free: list[torch.Tensor] = []
        self._keep = keep  # buffers held between steps, at most: the steps the writer
        # holds, the step being recorded, and a few in the writer's queue
        self._keep_values = keep_values  # larger buffers are freed after use
        self.capacity = 1024  # values: the largest buffer asked for so far
        self.allocated = 0  # buffers made, over the pool's life

    def take(self, at_least: int) -> torch.Tensor:
        """A buffer of ``at_least`` values or more: one given back, or a new one of the
        largest size asked for so far; one larger than worth holding is made to measure."""
        with self._lock:
            size = at_least
            if at_least <= self._keep_values:
                self.capacity = size = max(self.capacity, at_least)
                while self._free:
                    buffer = self._free.pop()
                    if buffer.numel() >= size:
                        return buffer
            self.allocated += 1
        with torch.inference_mode(False):  # hooks may fire inside inference mode: a buffer
            # made there could not be written outside it; on the CPU whatever the script's
            # default device (torch.set_default_device)
            return torch.empty(size, dtype=self._dtype, device="cpu")

    def give_back(self, buffer: torch.Tensor) -> None:
        """Keep ``buffer`` for a later step, unless the pool holds enough, or it is smaller
        than steps now need, or larger than worth holding between steps."""
        with self._lock:
            fits = self.capacity <= buffer.numel() <= self._keep_values
            if fits and len(self._free) < self._keep and all(b is not buffer for b in self._free):
                self._free.append(buffer)


@dataclass
class Staging:
    """One step's small tensors, their values one after the other in a float64 buffer."""

    pool: StagingPool | None = None
    buffer: torch.Tensor | None = None
    lengths: list[int] = field(default_factory=list)
    used: int = 0

    def add(self, tensor: torch.Tensor) -> int:
        """Copy ``tensor``'s values in now, before anything can change them; its position.

        float64 holds every real dtype's values exactly (integers up to 2**53)."""
        n = tensor.numel()
        if self.buffer is None or self.used + n > self.buffer.numel():
            self._grow(self.used + n)
        assert self.buffer is not None
        target = self.buffer[self.used : self.used + n]
        values = tensor.detach()
        if values.dim() > 1:
            if values.is_contiguous():
                values = values.view(-1)
            else:  # copied straight from its strides, with no contiguous copy between
                target = target.view(values.shape)
        target.copy_(values)
        self.used += n
        self.lengths.append(n)
        return len(self.lengths) - 1

    def add_many(self, tensors: list[torch.Tensor]) -> int:
        """:meth:`add` for several tensors of one dtype, with one copy; the first one's
        position (the others follow it)."""
        flat = _flatten_dense_tensors([t.detach() for t in tensors])
        n = flat.numel()
        if self.buffer is None or self.used + n > self.buffer.numel():
            self._grow(self.used + n)
        assert self.buffer is not None
        self.buffer[self.used : self.used + n].copy_(flat)
        self.used += n
        first = len(self.lengths)
        self.lengths.extend(t.numel() for t in tensors)
        return first

    def _grow(self, needed: int) -> None:
        size = max(needed, 2 * self.buffer.numel() if self.buffer is not None else 0)
        if self.pool is not None:
            bigger = self.pool.take(size)
        else:
            with torch.inference_mode(False):
                bigger = torch.empty(size, dtype=torch.float64, device="cpu")
        if self.buffer is not None:
            bigger[: self.used].copy_(self.buffer[: self.used])
        self.buffer = bigger

    @property
    def nbytes(self) -> int:
        """The memory this step holds for staging: its whole buffer."""
        return self.buffer.numel() * 8 if self.buffer is not None else 0

    def values(self) -> np.ndarray:
        """The staged values, a view of the buffer: read them before :meth:`release`."""
        if self.buffer is None:
            return np.zeros(0)
        return self.buffer[: self.used].numpy()

    def bounds(self) -> np.ndarray:
        """Where each tensor's values begin, and after the last one, where they end."""
        bounds = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=bounds[1:])
        return bounds

    def lengths_array(self) -> np.ndarray:
        return np.array(self.lengths, dtype=np.int64)

    def release(self) -> None:
        """Give the buffer back for another step. Arrays from :meth:`values` point into it:
        another step's values overwrite them from here on."""
        buffer, self.buffer = self.buffer, None
        if buffer is not None and self.pool is not None:
            self.pool.give_back(buffer)
