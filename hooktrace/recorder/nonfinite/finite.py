"""Whether recorded tensors are finite, and how a capture says why a call is an origin.

The recorder's look on the hot path is :func:`nonfinite`: the NaN and Inf counts of the
statistics row it queued anyway, where that row is on the host. Everything else here runs
once a value is known to be non-finite.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from hooktrace.recorder.nonfinite.first_nonfinite import nonfinite_flags
from hooktrace.recorder.nonfinite.rerun import Call
from hooktrace.recorder.records.staging import Staged
from hooktrace.recorder.stats.stats import usual

_NAN, _INF = 6, 7  # columns of a statistics row


def nonfinite(
    stats: Any, tensor: torch.Tensor | None = None, *, on_device: bool = False
) -> bool | None:
    """Whether ``tensor`` holds a NaN or Inf, from its queued statistics where they are on the
    host already (the CPU's: free), or on a device where ``on_device`` allows waiting for it;
    None where that would take a look of its own (a tensor staged for the writer), or a wait
    for the device that is not allowed (its statistics are known when the writer copies
    them, a step or more later: ``TraceWriter.nonfinite_seen``)."""
    if isinstance(stats, np.ndarray):
        return bool(stats[_NAN] or stats[_INF])
    if isinstance(stats, torch.Tensor) and (stats.is_cpu or on_device):
        return bool(stats[_NAN] or stats[_INF])
    if isinstance(stats, Staged):
        return None
    return None if tensor is None or tensor.is_floating_point() else False


def check(tensor: torch.Tensor) -> bool:
    """A look of its own: whether a plain tensor holds a NaN or Inf."""
    if not usual(tensor) or not tensor.is_floating_point():
        return False
    # detached: isfinite is abs() underneath, which would save the tensor for a backward (a
    # checkpoint's saved-tensor hooks would count it)
    return not bool(torch.isfinite(tensor.detach()).all())


def flags(
    tensors: Iterable[torch.Tensor], known: Callable[[torch.Tensor], bool | None] | None = None
) -> tuple[bool, bool]:
    """:func:`nonfinite_flags` of the plain tensors among ``tensors`` (a subclass would see
    the look) that ``known`` does not say are finite already."""
    looked = (t for t in tensors if usual(t) and (known is None or known(t) is not False))
    return nonfinite_flags(looked)


def any_nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    nan, inf = flags(tensors)
    return nan or inf


def counts(tensor: torch.Tensor) -> str:
    t = tensor.detach()
    return f"{int(torch.isnan(t).sum())} NaN and {int(torch.isinf(t).sum())} Inf of {t.numel()}"


def backward_trigger(call: Call, module: nn.Module) -> str:
    """Why a re-run call is a backward origin, or "" if it is none."""
    finite = "while its inputs, outputs and the gradients at its outputs were finite"
    for slot, grad in call.grad_inputs.items():
        if any_nonfinite([grad]):
            return f"the gradient at its input {slot} holds {counts(grad)}, {finite}"
    for name, parameter in module.named_parameters():
        if parameter.grad is not None and any_nonfinite([parameter.grad]):
            return f"the gradient of its parameter {name} holds {counts(parameter.grad)}, {finite}"
    return ""


def autocast_now() -> list[list[str]]:
    """The autocast in force, as a capture stores it: [device, dtype] pairs."""
    return [
        [device, str(torch.get_autocast_dtype(device))[6:]]
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    ]


def forward_trigger(
    outputs: list[tuple[str, torch.Tensor]], what: str, inputs_infinite: bool
) -> str:
    parts = []
    for slot, t in outputs:
        t = t.detach()
        if t.is_floating_point() or t.is_complex():
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:
                parts.append(f"{what} {slot} holds {nan} NaN and {inf} Inf of {t.numel()}")
    inputs = "its inputs hold Inf but no NaN" if inputs_infinite else "every input was finite"
    return f"{'; '.join(parts)}, while {inputs}"
