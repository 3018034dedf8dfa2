"""Run a non-finite capture again by hand: ``replay_module(RUN, NAME, module=M, capture=K)``.

The recorder ran the captured call once already, right after saving it, and stored what it
found; this runs it again, in the caller's process, on a copy of the module the caller gives
(the same class as recorded), with the captured parameters and buffers loaded and the
captured inputs, under the same watch (:mod:`hooktrace.recorder.nonfinite.first_nonfinite`). A forward
capture re-runs the forward; a backward capture re-runs the forward with grad on, then the
backward from the captured output gradients.

The module given may be the model or its torch.compile wrapper: the copy is of the model,
and runs eagerly. A capture of a model compiled whole holds the model (its class, its state
named as the model names it); one an earlier hooktrace wrote (format 1.4 all the same)
holds torch.compile's wrapper instead, and is read as the model's (:func:`_of_the_model`).
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from hooktrace.errors import ConfigError, TensorNotRecorded
from hooktrace.recorder.nonfinite.first_nonfinite import (
    Finding,
    for_replay,
    run_backward,
    run_forward,
)
from hooktrace.recorder.records.flatten import rebuild_call
from hooktrace.recorder.replay.compare import device_of, to_torch, working_copy
from hooktrace.trace.reader import Trace, load


@dataclass(repr=False)
class CaptureReplay:
    """A capture run again: what the watch found now (``finding``) and what the recorder
    found when it ran the call in the recording (``recorded``, the capture's own analysis).
    ``same`` is True when both name the same operation and line."""

    module_name: str
    capture: int
    rank: int
    pass_: str
    finding: Finding
    recorded: dict[str, Any]
    same: bool
    module: nn.Module
    args: list[Any]
    kwargs: dict[str, Any]

    def __repr__(self) -> str:
        f = self.finding
        if f.status == "found":
            line = f" at {f.file}:{f.line} ({f.code})" if f.file else ""
            node = f" in {f.node}" if f.node else ""
            what = f"{f.op}{node}{line}"
            standalone = "reproduces" if f.reproduces else "does not reproduce"
            verdict = f"{what}; {standalone} standalone"
        else:
            verdict = f"{f.status}: {f.message}"
        agree = "as in the recording" if self.same else "NOT as in the recording"
        return (
            f"Replay of non-finite capture {self.capture} ({self.pass_} of "
            f"{self.module_name!r}, rank {self.rank}): {verdict} ({agree})"
        )


def replay_capture(
    trace: Trace | str | os.PathLike[str],
    module_name: str,
    *,
    module: nn.Module,
    capture: int,
    rank: int = 0,
) -> CaptureReplay:
    """See :func:`hooktrace.replay_module` with ``capture=``."""
    trace = trace if isinstance(trace, Trace) else load(trace)
    info = trace.capture_info(int(capture), rank=int(rank))
    if info.get("module") != module_name:
        raise ConfigError(
            f"non-finite capture {capture} is of {info.get('module')!r}, not {module_name!r}: "
            "`hooktrace replay RUN --nonfinite` lists the captures and their modules"
        )
    missing = [f"{e['group']} {e['name']}" for e in info.get("left_out") or []]
    if any(not m.startswith("outputs ") for m in missing):
        raise TensorNotRecorded(
            f"non-finite capture {capture} left out {', '.join(missing)} (over its size limit "
            f"of {info.get('max_mb')} MB): record with a larger --capture-max-mb to replay it"
        )
    target = working_copy(module)
    _check_type(target, info)
    device = device_of(target)
    tensors = trace.capture_tensors(int(capture), rank=int(rank))
    _load_state(target, _of_the_model(info, tensors["state"]), module_name)
    spec = json.loads(info["call_spec"])
    backward = info.get("pass") == "backward"
    inputs = {
        slot: for_replay(_torch(array).to(device), grad=backward)
        for slot, array in tensors["inputs"].items()
    }
    try:
        args, kwargs = rebuild_call(spec, inputs)
    except (KeyError, ValueError) as exc:
        raise TensorNotRecorded(f"cannot rebuild the call of capture {capture}: {exc}") from exc
    target.train(bool(spec.get("training", True)))
    with torch.set_grad_enabled(bool(spec.get("grad_enabled", True))), _autocast(info):
        if backward:
            grads = {slot: _torch(a).to(device) for slot, a in tensors["grad_outputs"].items()}
            finding = run_backward(target, tuple(args), kwargs, grads)
        else:
            finding = run_forward(target, tuple(args), kwargs)
    recorded = info.get("analysis") or {}
    same = finding.status == recorded.get("status") and all(
        getattr(finding, key) == recorded.get(key) for key in ("op", "node", "line")
    )
    return CaptureReplay(
        module_name=module_name,
        capture=int(capture),
        rank=int(rank),
        pass_=str(info.get("pass")),
        finding=finding,
        recorded=recorded,
        same=same,
        module=target,
        args=args,
        kwargs=kwargs,
    )


_WRAPPER = "torch._dynamo.eval_frame.OptimizedModule"
_WRAPPED = "_orig_mod."


def _of_the_model(info: dict[str, Any], state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A capture's state named as the model names it. An older capture of a model compiled
    whole (written before the recorder looked through torch.compile's wrapper) named it
    inside the wrapper, each name ``_orig_mod.`` first."""
    if info.get("module_type") != _WRAPPER:
        return state
    return {name.removeprefix(_WRAPPED): tensor for name, tensor in state.items()}


def _autocast(info: dict[str, Any]) -> ExitStack:
    """The autocast the call ran under (a capture says: [device, dtype] pairs)."""
    stack = ExitStack()
    for device, dtype in info.get("autocast") or []:
        stack.enter_context(torch.autocast(str(device), dtype=getattr(torch, str(dtype))))
    return stack


def _torch(array: np.ndarray) -> torch.Tensor:
    return to_torch(array, array.dtype.name)


def _check_type(target: nn.Module, info: dict[str, Any]) -> None:
    recorded = str(info.get("module_type", ""))
    if recorded == _WRAPPER:
        return  # an older capture of a compiled model, which does not say which model
    mine = f"{type(target).__module__}.{type(target).__qualname__}"
    if recorded.rpartition(".")[2] != mine.rpartition(".")[2]:
        raise ConfigError(
            f"the capture was made by a {recorded}, and the module given is a {mine}: give "
            "the module the recording ran"
        )


def _load_state(target: nn.Module, state: dict[str, np.ndarray], module_name: str) -> None:
    """The captured parameters and buffers into ``target``, bits and dtypes as captured."""
    named = {**dict(target.named_parameters()), **dict(target.named_buffers())}
    missing = sorted(set(named) - set(state))
    extra = sorted(set(state) - set(named))
    if missing or extra:
        raise ConfigError(
            f"the module given does not match the capture of {module_name!r} ("
            + "; ".join(
                part
                for part in (
                    f"not captured: {', '.join(missing)}" if missing else "",
                    f"captured but not in it: {', '.join(extra)}" if extra else "",
                )
                if part
            )
            + "): give the module the recording ran"
        )
    with torch.no_grad():
        for name, tensor in named.items():
            value = _torch(state[name]).to(tensor.device)
            if value.shape != tensor.shape:
                raise ConfigError(
                    f"{name} is {tuple(tensor.shape)} in the module given, captured as "
                    f"{tuple(value.shape)}: give the module the recording ran"
                )
            tensor.data = value
