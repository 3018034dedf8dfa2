"""Statistics of one tensor, computed on its own device with no synchronisation.

Each function only queues tensor operations: nothing here calls ``.item()``, ``.cpu()`` or
branches on a tensor's value, so on a GPU the hooks never wait for the device. The results
are gathered and copied to the host once per step, in the background writer.
"""

from __future__ import annotations

import torch

STATS_WIDTH = 8
"""mean, std, min, max, norm, zero count, NaN count, Inf count (float64)."""


def summarize(tensor: torch.Tensor) -> torch.Tensor | None:
    """The statistics vector of ``tensor`` as float64 of length ``STATS_WIDTH``.

    Computed in float32 (float64 inputs are rounded to float32 first); ``std`` is the
    population standard deviation (numpy's default, ddof=0). Returns None for tensors that
    hold no values to summarise (empty, complex, quantized, meta).
    """
    x = _values(tensor)
    if x is None:
        return None
    var, mean = torch.var_mean(x, correction=0)
    lo, hi = torch.aminmax(x)
    norm = torch.linalg.vector_norm(x)
    zeros = (x == 0).sum(dtype=torch.float64)
    nans = torch.isnan(x).sum(dtype=torch.float64)
    infs = torch.isinf(x).sum(dtype=torch.float64)
    # stack promotes the float32 statistics to float64 exactly; counts stay exact to 2**53
    return torch.stack([mean, var.sqrt(), lo, hi, norm, zeros, nans, infs])


def unit_dim(tensor: torch.Tensor, *, channels_first: bool) -> int | None:
    """The dimension whose entries are units (channels or neurons), or None for scalars.

    (N, C, ...) conv-shaped activations count per channel (dim 1); everything else per entry
    of the last dimension. ``channels_first`` decides for 3-D tensors, which are (N, C, L)
    after a Conv1d but (batch, time, features) in a sequence model.
    """
    if tensor.dim() == 0:
        return None
    if tensor.dim() >= 4 or (tensor.dim() == 3 and channels_first):
        return 1
    return tensor.dim() - 1


def activity(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """How many values of each unit along ``dim`` were positive (int64, one per unit)."""
    positive = tensor.detach() > 0
    others = [d for d in range(tensor.dim()) if d != dim]
    if not others:
        return positive.to(torch.int64)
    return positive.sum(dim=others, dtype=torch.int64)


def _values(tensor: torch.Tensor) -> torch.Tensor | None:
    if tensor.device.type == "meta" or tensor.is_quantized or tensor.is_complex():
        return None
    if tensor.layout != torch.strided:
        tensor = tensor.to_dense()
    if tensor.numel() == 0:
        return None
    x = tensor.detach()
    return x if x.dtype == torch.float32 else x.float()
