"""A tensor's histogram over the fixed exponent bins of :mod:`hooktrace.trace.histograms`.

Computed where the tensor's statistics are, by the same rule: on the tensor's own device,
queued without a host synchronisation (no ``.item()``, no ``bincount``, whose output size
depends on a value); on the CPU, as a numpy array. Small CPU tensors staged for the writer
are histogrammed there, from their float64 copies (:func:`histogram_staged`).

Every float dtype converts to float32 or float64 exactly, and an exponent does not change
in an exact conversion: float16 and bfloat16 are binned as float32, integers as float64.
"""

from __future__ import annotations

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
    device elsewhere (copied to the host by the writer, with the statistics)."""
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


def histogram_many(tensors: list[torch.Tensor]) -> np.ndarray:
    """The histograms of CPU tensors, one row of ``WIDTH`` each."""
    rows = np.zeros((len(tensors), WIDTH), dtype=np.int64)
    for i, tensor in enumerate(tensors):
        rows[i] = histogram(tensor)
    return rows


def _bins(x: torch.Tensor) -> torch.Tensor:
    """Each value's bin in the flat histogram vector (int64)."""
    _, e = torch.frexp(x)  # |x| = m * 2^e, 0.5 <= m < 1: floor(log2|x|) = e - 1
    magnitude = (e.to(torch.int64) - EXPONENT_MIN).clamp_(0, MAGNITUDE_BINS - 1)
    bins = torch.where(x > 0, magnitude + POS, magnitude + NEG)
    bins = torch.where(x == 0, ZERO, bins)
    bins = torch.where(torch.isnan(x), NAN, bins)
    bins = torch.where(x == float("inf"), POS_INF, bins)
    return torch.where(x == float("-inf"), NEG_INF, bins)


def histogram_staged(values: np.ndarray, bounds: np.ndarray, positions: list[int]) -> np.ndarray:
    """The histograms of staged tensors, one row of ``WIDTH`` each: tensor ``p`` of
    ``positions`` is ``values[bounds[p]:bounds[p + 1]]`` (float64 copies, exact)."""
    rows = np.zeros((len(positions), WIDTH), dtype=np.int64)
    for i, p in enumerate(positions):
        rows[i] = _staged_one(values[bounds[p] : bounds[p + 1]])
    return rows


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
