"""Run one recorded module call again, in isolation: :func:`replay_module`. Imports torch.

A call can be replayed when its step saved, in full, the call's inputs (with the call spec on
its first input row: the structure of args and kwargs, the module's train/eval mode, whether
grad was enabled and the CPU RNG state), its output, and the parameters and buffers of the
module and of every module inside it. Replay then

- deep-copies the module given (the caller's module is never changed) and loads the
  recorded parameters and buffers into the copy, dtype and bits as recorded;
- sets each module of the copy to the train/eval mode it was recorded in;
- hangs a no-op forward hook on each module of the copy that the recording hooked, so that
  code which branches on hooks being present (``nn.TransformerEncoderLayer``'s fused eval
  path) takes the branch it took while recording;
- rebuilds the args and kwargs as the call spec describes them: one tensor object where the
  call passed one tensor twice (self-attention gets ``query is key is value`` back, which
  selects ``nn.MultiheadAttention``'s packed projection and fast path), and each input's
  recorded strides (dropout draws its mask in memory order);
- runs the copy with the recorded grad mode and CPU RNG state (inside ``fork_rng``: the
  caller's RNG is left as it was), and compares each output slot with the recording.

On CPU, with the same torch build, a deterministic module reproduces its output bit for bit,
dropout included. What replay cannot restore, because the trace does not hold it:

- the CUDA RNG (dropout on a GPU), autocast, a module's Python state other than parameters
  and buffers, buffers a module changes between two calls of one step (parameters and
  buffers are recorded once, at the step's first forward), and parameters tied to a module
  outside the replayed one (they are recorded under the first module that owns them).
"""

from __future__ import annotations

import base64
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch
from torch import nn

from hooktrace.errors import ConfigError, RecordingError, TensorNotRecorded
from hooktrace.recorder.recording.recorder import active_recorder
from hooktrace.recorder.records.flatten import rebuild_call
from hooktrace.recorder.replay.capture import CaptureReplay, replay_capture
from hooktrace.recorder.replay.compare import compare, device_of, to_torch, working_copy
from hooktrace.trace.reader import Trace, load

_READ = ["micro_step", "phase", "seq", "module", "call", "kind", "slot", "dtype", "shape"]
_READ += ["tensor_key", "call_spec"]


@dataclass(repr=False)
class Replay:
    """A replayed call: what it returned and how that compares with the recording.

    ``comparison`` has one row per output slot: ``exact`` (same dtype, shape and bits),
    ``max_abs_error`` (over elements finite on both sides), ``nan_equal`` (NaN in the same
    places) and the NaN counts of both sides. ``exact`` is True when every slot is exact.
    ``module`` is the copy that ran, with the recorded parameters loaded.
    """

    module_name: str
    step: int
    call: int
    micro_step: int
    phase: str
    rank: int
    output: Any
    recorded: dict[str, torch.Tensor]
    comparison: pd.DataFrame
    exact: bool
    args: list[Any]
    kwargs: dict[str, Any]
    module: nn.Module

    def __repr__(self) -> str:
        where = (
            f"step {self.step}, call {self.call}, micro-step {self.micro_step}, {self.phase}, "
            f"rank {self.rank}"
        )
        if self.exact:
            verdict = "EXACT: every output slot is bit-identical to the recording"
        else:
            verdict = "DIFFERS from the recording"
        table = self.comparison.to_string(index=False) if len(self.comparison) else "(no output)"
        lines = [f"Replay of {self.module_name!r} ({where}): {verdict}"]
        return "\n".join(lines + ["  " + line for line in table.splitlines()])


def replay_module(
    trace: Trace | str | os.PathLike[str],
    module_name: str,
    *,
    module: nn.Module,
    step: int | None = None,
    call: int = 0,
    micro_step: int = 0,
    rank: int = 0,
    phase: str | None = None,
    capture: int | None = None,
) -> Replay | CaptureReplay:
    """Run ``module`` (the one recorded as ``module_name``) on its recorded inputs of ``step``.

    ``call`` is the n-th call of the module in ``micro_step`` and ``phase`` (default: train
    when the step has a train call, else eval). The module given is deep-copied, never
    changed. Raises :class:`TensorNotRecorded` saying which recording options would have
    saved what is missing, and :class:`ConfigError` when ``module`` does not match the
    recording (another architecture).

    With ``capture=K`` instead of ``step``, runs non-finite capture K of ``rank`` again (the
    call where a NaN or Inf began, saved whole however the run was recorded) and names the
    first aten operation that made a non-finite value: a
    :class:`~hooktrace.recorder.replay.capture.CaptureReplay`.
    """
    if active_recorder() is not None:
        raise RecordingError(
            "replay_module() inside an active recording would record the replay: call it "
            "after the recording has closed"
        )
    if capture is not None:
        if step is not None:
            raise ConfigError("give step= (a recorded step) or capture= (a capture), not both")
        return replay_capture(trace, module_name, module=module, capture=capture, rank=rank)
    if step is None:
        raise ConfigError(
            "give step= (the step whose saved call to run again) or capture= (a non-finite "
            "capture: `hooktrace replay RUN --nonfinite` lists them)"
        )
    trace = trace if isinstance(trace, Trace) else load(trace)
    found = _Call(trace, module_name, step=int(step), rank=int(rank))
    inputs, outputs, spec, phase = found.find(call=call, micro_step=micro_step, phase=phase)
    target = working_copy(module)
    found.check_type(target)
    tensors = found.inputs(inputs, device_of(target))
    try:
        args, kwargs = rebuild_call(spec, tensors)
    except (KeyError, ValueError) as exc:
        raise TensorNotRecorded(f"cannot replay {module_name!r} at step {step}: {exc}") from exc
    found.load_state(target)
    found.set_modes(target, spec, pd.concat([inputs, outputs]))
    found.hook_like_the_recording(target)
    recorded = {str(row.slot): found.read(row) for row in outputs.itertuples(index=False)}

    state = base64.b64decode(spec["cpu_rng_state"])
    with torch.random.fork_rng(devices=[]), torch.set_grad_enabled(bool(spec["grad_enabled"])):
        torch.set_rng_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        output = target(*args, **kwargs)
    comparison = compare(output, recorded)
    return Replay(
        module_name=module_name,
        step=int(step),
        call=int(call),
        micro_step=int(micro_step),
        phase=phase,
        rank=int(rank),
        output=output,
        recorded=recorded,
        comparison=comparison,
        exact=bool(comparison["exact"].all()),
        args=args,
        kwargs=kwargs,
        module=target,
    )


class _Call:
    """One module's records at one step of a trace, and what replay does with them."""

    def __init__(self, trace: Trace, module_name: str, *, step: int, rank: int) -> None:
        self.trace, self.module_name, self.step, self.rank = trace, module_name, step, rank
        rows = trace.query(columns=_READ, steps=[step], ranks=[rank])
        for column in ("phase", "module", "kind", "slot", "dtype"):
            rows[column] = rows[column].astype(str)
        self.rows = rows
        self.config = trace.manifest.get("config") or {}
        modules = trace.modules
        self.modules = modules[modules["rank"].astype(int) == rank]
        self.prefix = self._prefix()

    # -- finding the call -----------------------------------------------------------------

    def find(
        self, *, call: int, micro_step: int, phase: str | None
    ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, Any], str]:
        """The call's input rows, output rows, call spec and phase."""
        rows = self.rows
        mine = rows[
            (rows["module"] == self.module_name)
            & (rows["call"] == call)
            & (rows["micro_step"] == micro_step)
            & rows["kind"].isin(["input", "output"])
        ]
        phase = phase or ("train" if (mine["phase"] == "train").any() else "eval")
        mine = mine[mine["phase"] == phase]
        if mine.empty:
            raise TensorNotRecorded(self._no_call(call, micro_step, phase))
        inputs, outputs = mine[mine["kind"] == "input"], mine[mine["kind"] == "output"]
        specs = inputs[inputs["call_spec"] != ""]
        if inputs.empty:  # no tensor among its inputs: the spec sits on the call's next record
            specs = outputs[outputs["call_spec"] != ""]
            specs = specs[[not _tensor_slots(json.loads(s)) for s in specs["call_spec"]]]
        if specs.empty:
            if inputs.empty and self.config.get("inputs") and (outputs["tensor_key"] != "").all():
                raise TensorNotRecorded(
                    f"cannot replay {self.module_name!r} at step {self.step}: the call took no "
                    "tensor input and the trace holds no call spec for it (a call spec is kept "
                    "on a call's first input row; a call without one keeps it only when its "
                    "own output is the next record)"
                )
            if not inputs.empty and (inputs["tensor_key"] != "").all():
                raise TensorNotRecorded(
                    f"cannot replay {self.module_name!r} at step {self.step}: its inputs are "
                    "saved but not how the call was made (its call spec): it ran inside a "
                    "compiled graph, where the recorder sees the call's tensors only. Record "
                    "the steps to replay with TORCHDYNAMO_DISABLE=1"
                )
            what = "were not recorded" if inputs.empty else "were recorded as statistics only"
            raise TensorNotRecorded(self.missing(f"its inputs {what}"))
        if (outputs["tensor_key"] == "").any():
            raise TensorNotRecorded(self.missing("its output was not saved in full"))
        return inputs, outputs, json.loads(specs.iloc[0]["call_spec"]), phase

    def missing(self, what: str) -> str:
        """Says what is missing and which recording options would have saved it."""
        options, cli = [], []
        if not self.config.get("inputs"):
            options.append("inputs=True")
            cli.append("--inputs")
        options.append(f"full_steps=[{self.step}] (or full_every=1)")
        cli.append(f"--full-steps {self.step}")
        if not self.config.get("params", True):
            options.append("params=True")
            cli.append("--params")
        if self.prefix:
            pattern = self.module_name.replace(".", r"\.")  # also matches the modules inside
            options.append(f"full_modules matching '{pattern}'")
            cli.append(f"--full-modules '{pattern}'")
        else:
            options.append("no full_modules filter (the root needs every module's parameters)")
        return (
            f"cannot replay {self.module_name!r} at step {self.step}: {what}; record with "
            f"{' and '.join(options)} (CLI: {' '.join(cli)})"
        )

    def _no_call(self, call: int, micro_step: int, phase: str) -> str:
        rows, module, step = self.rows, self.module_name, self.step
        if rows.empty:
            return f"step {step} was not recorded at rank {self.rank}"
        own = rows[(rows["module"] == module) & rows["kind"].isin(["input", "output"])]
        if own.empty:
            names = sorted(rows["module"].unique())
            return (
                f"{module!r} did not run at step {step} (rank {self.rank}); modules recorded "
                f"there: {', '.join(names[:12])}{', ...' if len(names) > 12 else ''}"
            )
        calls = sorted(
            {(int(m), str(p), int(c)) for m, p, c in own[["micro_step", "phase", "call"]].values}
        )
        listed = ", ".join(f"call {c} of micro-step {m} ({p})" for m, p, c in calls[:12])
        return (
            f"{module!r} has no call {call} in micro-step {micro_step} ({phase}) at step "
            f"{step}: it has {listed}"
        )

    # -- tensors ----------------------------------------------------------------------------

    def read(self, row: Any) -> torch.Tensor:
        """One recorded full tensor as torch, bits and dtype exactly as recorded."""
        if not row.tensor_key:
            raise TensorNotRecorded(self.missing(f"the {row.kind} {row.slot} was not saved"))
        array = self.trace.tensor(
            str(row.module),
            str(row.kind),
            step=self.step,
            slot=str(row.slot),
            call=int(row.call),
            rank=self.rank,
            micro_step=int(row.micro_step) if row.kind in ("input", "output") else None,
            phase=str(row.phase),
        )
        return to_torch(array, str(row.dtype))

    def inputs(self, inputs: pd.DataFrame, device: torch.device) -> dict[str, torch.Tensor]:
        """Each input slot's tensor (the call spec says which slots were one tensor object)."""
        return {str(row.slot): self.read(row).to(device) for row in inputs.itertuples(index=False)}

    # -- the module -------------------------------------------------------------------------

    def _prefix(self) -> str:
        """How the names of the modules inside this one begin in the trace: ``name.``, or ""
        for the root of a lone model (named as its ``named_modules()`` name them)."""
        modules, name = self.modules, self.module_name
        row = modules[modules["module"].astype(str) == name]
        if row.empty or str(row.iloc[0]["parent"]) != "":
            return name + "."
        inside = modules[(modules["root"].astype(str) == name) & (modules["module"] != name)]
        return name + "." if inside["module"].astype(str).str.startswith(name + ".").all() else ""

    def trace_name(self, qualname: str) -> str:
        """The trace's name of the module at ``qualname`` inside this one."""
        return self.prefix + qualname if qualname else self.module_name

    def load_state(self, target: nn.Module) -> None:
        """Put the recorded parameters and buffers of the step into ``target``."""
        held = self.rows[self.rows["kind"].isin(["param", "buffer"])]
        index = {(str(r.module), str(r.kind), str(r.slot)): r for r in held.itertuples()}
        missing: list[str] = []
        loads: list[tuple[nn.Module, str, str, torch.Tensor, Any]] = []
        owners = dict(target.named_modules())
        for kind, named in (
            ("param", target.named_parameters()),
            ("buffer", target.named_buffers()),
        ):
            for qualname, tensor in named:
                owner, _, local = qualname.rpartition(".")
                row = index.get((self.trace_name(owner), kind, local))
                if row is None or not row.tensor_key:
                    missing.append(qualname)
                else:
                    loads.append((owners[owner], kind, local, tensor, row))
        if missing:
            shown = ", ".join(missing[:6]) + (", ..." if len(missing) > 6 else "")
            what = "parameters and buffers" if held.empty else f"{shown} ({len(missing)} in all)"
            raise TensorNotRecorded(self.missing(f"{what} were not saved in full at that step"))
        for owner_module, kind, local, tensor, row in loads:
            value = self.read(row).to(tensor.device)
            if value.shape != tensor.shape:
                raise ConfigError(
                    f"the module given does not match the recording of {self.module_name!r}: "
                    f"{row.module}.{local} has shape {tuple(tensor.shape)} here and "
                    f"{tuple(value.shape)} in the trace; pass the module that was recorded"
                )
            if kind == "param":
                tensor.data = value  # keeps the Parameter (and any tying), takes the dtype
            else:
                owner_module._buffers[local] = value

    def set_modes(self, target: nn.Module, spec: dict[str, Any], mine: pd.DataFrame) -> None:
        """train/eval as recorded: the call's own mode for every module, then each inner
        module called during this call with a call spec takes its own."""
        target.train(bool(spec["training"]))
        rows = self.rows
        first, last = int(mine["seq"].min()), int(mine["seq"].max())
        inside = rows[(rows["call_spec"] != "") & (rows["seq"] > first) & (rows["seq"] < last)]
        by_name = {self.trace_name(q): m for q, m in target.named_modules() if q}
        for name, group in inside.groupby("module", sort=False):
            sub = by_name.get(str(name))
            if sub is not None:
                sub.training = bool(json.loads(group.iloc[0]["call_spec"])["training"])

    def hook_like_the_recording(self, target: nn.Module) -> None:
        """A no-op forward hook wherever the recorder had hooks."""
        recorded = set(self.modules["module"].astype(str))
        for qualname, sub in target.named_modules():
            if self.trace_name(qualname) in recorded:
                sub.register_forward_hook(_no_op)

    def check_type(self, target: nn.Module) -> None:
        """Warn when the module given is not of the class that was recorded."""
        row = self.modules[self.modules["module"].astype(str) == self.module_name]
        recorded_type = str(row.iloc[0]["type"]).rpartition(".")[2] if not row.empty else None
        if recorded_type is not None and recorded_type != type(target).__name__:
            warnings.warn(
                f"hooktrace: {self.module_name!r} was recorded as a {recorded_type}; the module "
                f"given is a {type(target).__name__}",
                RuntimeWarning,
                stacklevel=3,
            )


def _tensor_slots(spec: Any) -> list[str]:
    """The input slots a call spec refers to."""
    if isinstance(spec, dict):
        if "tensor" in spec:
            return [str(spec["tensor"])]
        return [slot for value in spec.values() for slot in _tensor_slots(value)]
    if isinstance(spec, list):
        return [slot for value in spec for slot in _tensor_slots(value)]
    return []


def _no_op(module: nn.Module, args: Any, output: Any) -> None:
    return None
