"""torch's route on a device: a tensor's statistics and histogram as torch's own operations,
queued (no ``.item()``, no ``bincount``, whose output size depends on a value). The route of
a device without the Triton kernels (:mod:`hooktrace.recorder.stats.device_kernels`), and
what those kernels are checked against at their first call."""

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


def summarize_on_device(x: torch.Tensor) -> torch.Tensor:
    var, mean = torch.var_mean(x, correction=0)
    lo, hi = torch.aminmax(x)
    norm = torch.linalg.vector_norm(x)
    zeros = x.numel() - torch.count_nonzero(x).double()
    nans = torch.count_nonzero(torch.isnan(x)).double()
    infs = torch.count_nonzero(torch.isinf(x)).double()
    # stack promotes the float32 statistics to float64 exactly; counts stay exact to 2**53
    return torch.stack([mean, var.sqrt(), lo, hi, norm, zeros, nans, infs])


def histogram_torch(tensor: torch.Tensor) -> np.ndarray | torch.Tensor:
    """The torch route, for tensors on other devices (it runs on any: numpy counts for a CPU
    tensor). Binning takes several int64 tensors the size of its input: a large tensor is
    binned ``TORCH_CHUNK`` values at a time, so that the scratch stays some 80 MB whatever
    its size (a 1 GB embedding's gradient would otherwise take 10 GB)."""
    x = tensor.detach()
    if x.layout != torch.strided:
        x = x.to_dense()
    x = x.reshape(-1)
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float() if x.dtype in _EXACT_IN_FLOAT32 else x.double()
    counts = torch.zeros(WIDTH, dtype=torch.int64, device=x.device)
    for chunk in x.split(TORCH_CHUNK):
        bins = _bins(chunk)
        counts.index_add_(0, bins, torch.ones_like(bins))
    return counts.numpy() if x.is_cpu else counts


TORCH_CHUNK = 1 << 20
"""Values binned at once on the torch route."""


def _bins(x: torch.Tensor) -> torch.Tensor:
    """Each value's bin in the flat histogram vector (int64)."""
    _, e = torch.frexp(x)  # |x| = m * 2^e, 0.5 <= m < 1: floor(log2|x|) = e - 1
    magnitude = (e.to(torch.int64) - EXPONENT_MIN).clamp_(0, MAGNITUDE_BINS - 1)
    bins = torch.where(x > 0, magnitude + POS, magnitude + NEG)
    bins = torch.where(x == 0, ZERO, bins)
    bins = torch.where(torch.isnan(x), NAN, bins)
    bins = torch.where(x == float("inf"), POS_INF, bins)
    return torch.where(x == float("-inf"), NEG_INF, bins)
