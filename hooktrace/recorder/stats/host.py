"""numpy's view of a CPU tensor's memory that leaves the tensor as it was.

``Tensor.numpy()`` (and ``np.asarray(tensor)``) marks the tensor's storage as never to be
resized again, for the storage's life, since the numpy array may outlive the call. A script
that later resizes a storage hooktrace had looked at then fails, and could tell it was
recorded: FSDP2 frees each all-gathered parameter after a block's forward with
``storage.resize_(0)``, and a non-finite capture that had saved those parameters made it
raise "Trying to resize storage that is not resizable". The views here share the memory,
as ``numpy()`` does, keep the tensor alive as long as they are, and mark nothing.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

_NUMPY: dict[torch.dtype, np.dtype[Any]] = {
    torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16), torch.int64: np.dtype(np.int64),
    torch.int32: np.dtype(np.int32), torch.int16: np.dtype(np.int16),
    torch.int8: np.dtype(np.int8), torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
}  # fmt: skip
"""The dtypes a contiguous tensor is read as by address: the common ones, the fast way."""


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor.detach().numpy()``, the same shape, strides and memory, without marking the
    tensor's storage (module docstring). ``tensor`` is on the CPU, with no conjugate or
    negative bit set; a dtype numpy lacks (bfloat16) raises, as ``numpy()`` does."""
    dtype = _NUMPY.get(tensor.dtype)
    if dtype is None or not tensor.is_contiguous() or tensor.numel() == 0:
        return np.from_dlpack(tensor.detach())  # any strides and dtype; a few microseconds more
    memory = (ctypes.c_char * (tensor.numel() * dtype.itemsize)).from_address(tensor.data_ptr())
    memory.tensor = tensor  # type: ignore[attr-defined]  # the array keeps the owner, as numpy()
    flat = np.frombuffer(memoryview(memory), dtype=dtype)
    return flat if tensor.dim() == 1 else flat.reshape(tensor.shape)
