"""Comparing a replayed call with its recording, recorded tensors as torch tensors, and the
copy of the user's module that a replay runs.

Part of :mod:`hooktrace.recorder.replay.replay`; imports torch.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import nn

from hooktrace.errors import ConfigError, TensorNotRecorded
from hooktrace.recorder.hooks.names import unwrap
from hooktrace.recorder.records.flatten import flatten


def compare(output: Any, recorded: dict[str, torch.Tensor]) -> pd.DataFrame:
    """Slot by slot, a call's output against the recorded output tensors."""
    replayed = {slot: t.detach().cpu() for slot, t in flatten(output)}
    rows = []
    for slot in dict.fromkeys([*recorded, *replayed]):
        got, want = replayed.get(slot), recorded.get(slot)
        row: dict[str, Any] = {
            "slot": slot,
            "shape": _shape(got),
            "dtype": _dtype(got),
            "exact": False,
            "max_abs_error": float("nan"),
            "nan_equal": False,
            "nan": _nans(got),
            "recorded_nan": _nans(want),
        }
        if got is not None and want is not None and got.shape == want.shape:
            row["nan_equal"] = bool(torch.equal(_isnan(got), _isnan(want)))
            row["max_abs_error"] = _max_abs_error(got, want)
            row["exact"] = got.dtype == want.dtype and torch.equal(bits(got), bits(want))
        if want is None:
            row["dtype"] += " (not recorded)"
        elif got is None:
            row["shape"], row["dtype"] = "-", "(not returned)"
        elif got.dtype != want.dtype:
            row["dtype"] += f" (recorded {_dtype(want)})"
        rows.append(row)
    columns = ["slot", "shape", "dtype", "exact", "max_abs_error", "nan_equal", "nan"]
    return pd.DataFrame(rows, columns=[*columns, "recorded_nan"])


def to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A numpy array from ``Trace.tensor`` as a torch tensor of the torch dtype named
    ``dtype``, bit for bit (bfloat16 and float8 travel as raw bits of the same width)."""
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype):
        raise TensorNotRecorded(f"this torch has no dtype {dtype!r} to replay a tensor in")
    array = array.copy(order="C")
    try:
        tensor = torch.from_numpy(array)
    except TypeError:  # ml_dtypes.bfloat16 and other dtypes torch does not take from numpy
        tensor = None
    if tensor is not None and tensor.dtype == target:
        return tensor
    raw = torch.from_numpy(array.view(f"i{array.dtype.itemsize}"))
    return raw.view(target)


# -- helpers ----------------------------------------------------------------------------


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _isnan(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() or tensor.is_complex():
        return torch.isnan(tensor)
    return torch.zeros(tensor.shape, dtype=torch.bool)


def _nans(tensor: torch.Tensor | None) -> int:
    return int(_isnan(tensor).sum()) if tensor is not None else 0


def _max_abs_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    if got.is_complex() or want.is_complex():
        a, b = got.to(torch.complex128), want.to(torch.complex128)
    else:
        a, b = got.to(torch.float64), want.to(torch.float64)
    both = torch.isfinite(a) & torch.isfinite(b)
    if not both.any():
        return float("nan")
    return float((a - b).abs()[both].max())


def _shape(tensor: torch.Tensor | None) -> str:
    return ",".join(map(str, tensor.shape)) if tensor is not None else "-"


def _dtype(tensor: torch.Tensor | None) -> str:
    return str(tensor.dtype).removeprefix("torch.") if tensor is not None else "-"


def working_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` (wrappers looked through) for a replay to run: the caller's
    module is never touched."""
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module must be an nn.Module, not {type(module).__name__}")
    inner, _ = unwrap(module)
    try:
        return copy.deepcopy(inner)
    except Exception as exc:
        raise ConfigError(
            f"cannot copy the module to replay it ({type(exc).__name__}: {exc}); replay works "
            "on a copy so that your module is left as it is"
        ) from exc


def device_of(module: nn.Module) -> torch.device:
    """Where ``module``'s parameters and buffers are (the CPU for a module with none)."""
    for tensor in (*module.parameters(), *module.buffers()):
        return tensor.device
    return torch.device("cpu")
