"""A tensor's histogram over the fixed exponent bins of :mod:`hooktrace.trace.histograms`.

Computed where the tensor's statistics are, by the same rule: on the tensor's own device,
queued without a host synchronisation (no ``.item()``, no ``bincount``, whose output size
depends on a value); on the CPU, as a numpy array. Small CPU tensors staged for the writer
are histogrammed there, from their float64 copies (:func:`histogram_staged`).

On the CPU, a value's bin is read off its bits (:mod:`hooktrace.recorder.stats.histogram_bits`):
once the recorder has loaded numba for its statistics and the kernel is ready
(:mod:`hooktrace.recorder.stats.numba_kernels`), by a compiled kernel that reads each
value once (:mod:`hooktrace.recorder.stats.histogram_kernel`), float32, float64, float16 and
bfloat16 tensors where they lie, a list of them in one call; before that, or without numba,
by numpy, in a few passes. Integers and bool are binned as their float64 values. On other
devices, torch computes the same counts from ``frexp`` (float16 and bfloat16 as float32,
integers as float64: an exact conversion keeps the exponent: ``torch_route.py``), or, where
Triton is, by one kernel (``device_kernels.py``).
"""

from __future__ import annotations

import numpy as np
import torch

from hooktrace.recorder.stats import device_kernels, numba_kernels
from hooktrace.recorder.stats.histogram_bits import (
    BFLOAT16,
    FLOAT16,
    FLOAT32,
    FLOAT64,
    counts,
    flushes_denormals,
)
from hooktrace.recorder.stats.host import as_numpy
from hooktrace.recorder.stats.torch_route import histogram_torch
from hooktrace.trace.histograms import WIDTH

_FORMATS = {torch.float32: FLOAT32, torch.float64: FLOAT64, torch.float16: FLOAT16}


def histogram(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """``WIDTH`` int64 counts: a numpy array for a CPU tensor, a tensor on the tensor's
    device elsewhere (queued there, not waited for: the writer copies it to the host with
    the statistics)."""
    if tensor.is_cpu:
        return histogram_many([tensor])[0]
    if device_kernels.usable(tensor, histogram=True):
        counts = device_kernels.histogram(tensor)  # one launch
        if counts is not None:
            return counts
    return histogram_torch(tensor)


def histogram_many(tensors: list[torch.Tensor]) -> np.ndarray:
    """The histograms of CPU tensors, one row of ``WIDTH`` int64 counts each: once numba is
    loaded, in one compiled call that reads contiguous (or transposed, or permuted) float32,
    float64, float16 and bfloat16 tensors where they lie, and copies the others first
    (integers and bool as float64, slices and broadcasts contiguous); before, with numpy,
    tensor by tensor."""
    for t in tensors:
        if not t.is_cpu:
            raise ValueError(f"histogram_many takes CPU tensors, not {t.device}: use histogram()")
    kernels = numba_kernels.histograms()
    if kernels is None:
        rows = np.zeros((len(tensors), WIDTH), dtype=np.int64)
        flush = flushes_denormals()
        for i, t in enumerate(tensors):
            rows[i] = _histogram_bits(t, flush)
        return rows
    return kernels.histogram_tensors(tensors)


def histogram_staged(values: np.ndarray, bounds: np.ndarray, positions: list[int]) -> np.ndarray:
    """The histograms of staged tensors, one row of ``WIDTH`` each: tensor ``p`` of
    ``positions`` is ``values[bounds[p]:bounds[p + 1]]`` (float64 copies, exact; ``bounds``
    as :meth:`hooktrace.recorder.records.staging.Staging.bounds` gives them)."""
    kernels = numba_kernels.histograms()
    if kernels is not None:
        return kernels.histogram_segments(values, bounds, positions)
    rows = np.zeros((len(positions), WIDTH), dtype=np.int64)
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    flush = flushes_denormals()
    for i, p in enumerate(positions):
        rows[i] = counts(bits[bounds[p] : bounds[p + 1]], FLOAT64, flush)
    return rows


def _histogram_bits(tensor: torch.Tensor, flush: bool) -> np.ndarray:
    """A CPU tensor's histogram, from its values' bits, with numpy."""
    x = tensor.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    if x.is_neg():
        x = x.resolve_neg()
    if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
        form, x = BFLOAT16, x.view(torch.int16)
    else:
        form = _FORMATS.get(x.dtype, FLOAT64)
        if x.dtype not in _FORMATS:
            x = x.double()
    # in memory order: a view of a transposed or permuted tensor, a copy of a sliced one
    bits = as_numpy(x).view(form.bits).ravel(order="K")
    return counts(bits, form, flush)
