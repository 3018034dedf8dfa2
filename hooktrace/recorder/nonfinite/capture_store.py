"""What a capture holds, and how it is written: the call's tensors as numpy, up to a size
limit, with the meta that says where and why (:mod:`hooktrace.trace.captures` writes them).

Apart from :mod:`hooktrace.recorder.nonfinite.capture`, which decides when a call is an origin and
runs it again: this is the file, the same for a forward and a backward origin, and the only
part that turns tensors into host arrays.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from hooktrace.recorder.nonfinite.first_nonfinite import Finding
from hooktrace.recorder.records.pending import to_numpy
from hooktrace.trace.captures import write_capture


def save(
    directory: Path,
    index: int,
    head: dict[str, Any],
    tensors: dict[str, list[tuple[str, torch.Tensor]]],
    finding: Finding,
    *,
    max_bytes: int,
) -> None:
    """Write capture ``index``: its ``tensors`` by group, until ``max_bytes``; ``head``, the
    meta that says which call and why, is followed by what was left out and the analysis."""
    stored, left_out = _arrays(tensors, max_bytes)
    meta = {
        **head,
        "left_out": left_out,
        "max_mb": max_bytes / (1 << 20),
        "time": time.time(),
        "analysis": finding.as_dict(),
    }
    write_capture(directory, index, meta, stored)


def state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers of ``module`` and every module inside it."""
    found: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    found += [(name, b) for name, b in module.named_buffers() if b is not None]
    return [(name, t.detach()) for name, t in found]


def _arrays(
    tensors: dict[str, list[tuple[str, torch.Tensor]]], max_bytes: int
) -> tuple[dict[str, list[tuple[str, np.ndarray, str]]], list[dict[str, Any]]]:
    """The tensors as numpy, in group order, until the size limit: the rest are named in
    ``left_out`` with their shapes and dtypes."""
    stored: dict[str, list[tuple[str, np.ndarray, str]]] = {}
    left_out: list[dict[str, Any]] = []
    budget = max_bytes
    for group, items in tensors.items():
        kept = stored.setdefault(group, [])
        for name, tensor in items:
            nbytes = tensor.numel() * tensor.element_size()
            entry = {"group": group, "name": name, "shape": list(tensor.shape),
                     "dtype": str(tensor.dtype)[6:], "bytes": nbytes}  # fmt: skip
            if nbytes > budget:
                left_out.append({**entry, "why": "over the capture's size limit"})
                continue
            try:
                array, dtype = to_numpy(_dense_on_host(tensor))
            except Exception as exc:
                left_out.append({**entry, "why": f"not saved ({type(exc).__name__}: {exc})"})
                continue
            budget -= nbytes
            kept.append((name, array, dtype))
    return stored, left_out


def _dense_on_host(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.cpu()
