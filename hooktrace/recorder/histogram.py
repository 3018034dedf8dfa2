"""A tensor's histogram over the fixed exponent bins of :mod:`hooktrace.trace.histograms`.

Computed where the tensor's statistics are, by the same rule: on the tensor's own device,
queued without a host synchronisation (no ``.item()``, no ``bincount``, whose output size
depends on a value); on the CPU, as a numpy array. Small CPU tensors staged for the writer
are histogrammed there, from their float64 copies (:func:`histogram_staged`).

On the CPU, once the recorder has loaded numba for its statistics
(:func:`hooktrace.recorder.pending.compiled_kernels`), a compiled kernel reads each value's
bits once (:mod:`hooktrace.recorder.histogram_kernel`): float32, float64, float16 and
bfloat16 tensors where they lie, a list of them in one call. Before that, or without numba,
torch (and numpy, for staged values) compute the same counts in about eight passes.

Every float dtype converts to float32 or float64 exactly, and an exponent does not change
in an exact conversion: float16 and bfloat16 are binned as float32, integers as float64.
"""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from hooktrace.trace.histograms import (
    EXPONENT_MIN,
    MAGNITUDE_BINS,
    NAN,
    NEG,
    NEG_INF,
    POS,
    POS_INF,
    WIDTH,
    ZERO,
)

_EXACT_IN_FLOAT32 = (torch.float32, torch.float16, torch.bfloat16)


def histogram(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """``WIDTH`` int64 counts: a numpy array for a CPU tensor, a tensor on the tensor's
    device elsewhere (queued there, not waited for: the writer copies it to the host with
    the statistics)."""
    if tensor.is_cpu:
        return histogram_many([tensor])[0]
    return _histogram_torch(tensor)


def histogram_many(tensors: list[torch.Tensor]) -> np.ndarray:
    """The histograms of CPU tensors, one row of ``WIDTH`` int64 counts each: once numba is
    loaded, in one compiled call that reads contiguous (or transposed, or permuted) float32,
    float64, float16 and bfloat16 tensors where they lie, and copies the others first
    (integers and bool as float64, slices and broadcasts contiguous)."""
    for t in tensors:
        if not t.is_cpu:
            raise ValueError(f"histogram_many takes CPU tensors, not {t.device}: use histogram()")
    kernels = _kernels()
    if kernels is None:
        rows = np.zeros((len(tensors), WIDTH), dtype=np.int64)
        for i, t in enumerate(tensors):
            rows[i] = _histogram_torch(t)
        return rows
    return kernels.histogram_tensors(tensors)


def histogram_staged(values: np.ndarray, bounds: np.ndarray, positions: list[int]) -> np.ndarray:
    """The histograms of staged tensors, one row of ``WIDTH`` each: tensor ``p`` of
    ``positions`` is ``values[bounds[p]:bounds[p + 1]]`` (float64 copies, exact; ``bounds``
    as :meth:`hooktrace.recorder.pending.Staging.bounds` gives them)."""
    kernels = _kernels()
    if kernels is not None:
        return kernels.histogram_segments(values, bounds, positions)
    rows = np.zeros((len(positions), WIDTH), dtype=np.int64)
    for i, p in enumerate(positions):
        rows[i] = _staged_one(values[bounds[p] : bounds[p + 1]])
    return rows


def warm_up() -> None:
    """Compile the histogram kernels now (or load them from numba's cache), if numba is
    loaded, rather than in the step that first asks for a histogram."""
    kernels = _kernels()
    if kernels is not None:
        kernels.warm_up()


def _kernels() -> ModuleType | None:
    """The compiled kernels' module, once the recorder loaded numba; else None."""
    from hooktrace.recorder.pending import compiled_kernels  # pending may import this module

    if compiled_kernels() is None:
        return None
    from hooktrace.recorder import histogram_kernel

    return histogram_kernel


def _histogram_torch(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """The torch route: on any device, numpy counts for a CPU tensor."""
    x = tensor.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    x = x.reshape(-1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float() if x.dtype in _EXACT_IN_FLOAT32 else x.double()
    bins = _bins(x)
    if x.is_cpu:
        return np.bincount(bins.numpy(), minlength=WIDTH)
    counts = torch.zeros(WIDTH, dtype=torch.int64, device=x.device)
    return counts.index_add_(0, bins, torch.ones_like(bins))


def _bins(x: torch.Tensor) -> torch.Tensor:
    """Each value's bin in the flat histogram vector (int64)."""
    _, e = torch.frexp(x)  # |x| = m * 2^e, 0.5 <= m < 1: floor(log2|x|) = e - 1
    magnitude = (e.to(torch.int64) - EXPONENT_MIN).clamp_(0, MAGNITUDE_BINS - 1)
    bins = torch.where(x > 0, magnitude + POS, magnitude + NEG)
    bins = torch.where(x == 0, ZERO, bins)
    bins = torch.where(torch.isnan(x), NAN, bins)
    bins = torch.where(x == float("inf"), POS_INF, bins)
    return torch.where(x == float("-inf"), NEG_INF, bins)


def _staged_one(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        _, e = np.frexp(x)
    magnitude = np.clip(e.astype(np.int64) - EXPONENT_MIN, 0, MAGNITUDE_BINS - 1)
    bins = np.where(x > 0, magnitude + POS, magnitude + NEG)
    bins[x == 0] = ZERO
    bins[np.isnan(x)] = NAN
    bins[x == np.inf] = POS_INF
    bins[x == -np.inf] = NEG_INF
    return np.bincount(bins, minlength=WIDTH)
