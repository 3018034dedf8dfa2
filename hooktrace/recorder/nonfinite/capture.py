"""Catch the first NaN or Inf in the act: capture the call that made it, in full, and name
the operation and the line.

The recorder asks :class:`Captures` after each recorded call whose output came out
non-finite, and after each gradient that did; on steps where everything is finite it asks
nothing (the statistics it queued already say so on the CPU: see ``nonfinite``).

- **Forward origin**: a module's output holds a NaN while none of its inputs does, or an Inf
  while all its inputs are finite, and the parameters of the model are finite (else the
  forward only shows what an earlier backward or optimizer step did).
- **Backward origin**: a gradient came out non-finite in a backward (one at a recorded
  module's output, or a parameter's that was finite after the backward before). The step's
  forward and backward then run once more on a copy of the model
  (:meth:`hooktrace.recorder.nonfinite.rerun.RootCall.rerun`), and the origin is the innermost recorded
  call there whose inputs, outputs and output gradients are finite while a gradient at one
  of its inputs, or of one of its parameters, is not: its backward made it.

A capture holds the call's inputs (with the call spec replay needs), its outputs, for a
backward origin the gradients at its outputs (both as the copy made them again: the recorder
holds no activation through a step), and the parameters and buffers of the module and every
module inside it (of a model compiled whole, ``torch.compile(model)``, the model's own: its
class, its state named as the model names it, never the wrapper's, so that replay takes the
model or the wrapper). Right after saving it, the call is run again on a copy of the
module, under a dispatch mode that names the first aten operation to make a non-finite value
(:mod:`hooktrace.recorder.nonfinite.first_nonfinite`), with the RNG forked and the process-wide module
hooks set aside, so the user's run goes on exactly as it would have. The answer is stored in
the capture (:mod:`hooktrace.trace.captures`), where the analyzer reads it without torch.
Turning a capture's tensors into arrays, up to the size limit, and writing it, is
:mod:`hooktrace.recorder.nonfinite.capture_store`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from hooktrace.recorder.nonfinite.capture_store import save, state
from hooktrace.recorder.nonfinite.finite import (
    any_nonfinite,
    autocast_now,
    backward_trigger,
    flags,
    forward_trigger,
)
from hooktrace.recorder.nonfinite.first_nonfinite import (
    Finding,
    for_replay,
    run_backward,
    run_forward,
)
from hooktrace.recorder.nonfinite.rerun import (
    Call,
    RootCall,
    no_module_hooks,
    replica,
    users_module,
)
from hooktrace.recorder.records.flatten import flatten_call
from hooktrace.trace import schema
from hooktrace.trace.captures import CAPTURES_DIR

DEFAULT_LIMIT = 3
"""Captures a run keeps at most, by default: the first origin, and a couple more (a mixed
precision run may overflow now and then, each time somewhere else)."""
DEFAULT_MAX_MB = 256.0
"""The tensors of one capture, at most: past it, the rest are left out (named, with their
shapes, in the capture); the operation is still named, from the live tensors."""

_EXAMINED = 32  # non-finite outputs looked into per forward pass, at most


class Captures:
    """The captures of one recording: when to take one, what it holds, and its re-run."""

    def __init__(
        self,
        out: Path,
        rank: int,
        *,
        enabled: bool,
        limit: int,
        max_mb: float,
        call_spec: Callable[[nn.Module, tuple[Any, ...], Mapping[str, Any]], str],
        parameters: Callable[[], list[torch.Tensor]],
        locate: Callable[[str], tuple[nn.Module, str] | None],
        warn: Callable[[str], None],
    ) -> None:
        self.directory = out / schema.rank_dir(CAPTURES_DIR, rank)
        self.rank = rank
        self.enabled = enabled and limit > 0
        self.limit = limit
        self.max_bytes = int(max_mb * (1 << 20))
        self.taken = 0
        self.failed = 0
        self._call_spec = call_spec
        self._parameters = parameters
        self._locate = locate
        self._warn = warn
        self._roots: list[RootCall] = []  # this backward's training forwards, by root call
        self._position: dict[tuple[str, int], tuple[int, int]] = {}  # call -> (root call, nth)
        self._nth: dict[str, int] = {}  # calls of each module in the current root call
        self._root_keys: dict[tuple[str, int], int] = {}  # a root's own call -> root call
        self._root_grads: dict[int, dict[str, torch.Tensor]] = {}  # at each root call's output
        self._rerun_done = False  # this backward pass ran the step again already
        self._rerun_step = False  # and this step
        self._captured_step = False  # a capture was made in this step
        self._stale = False  # a backward ended since the last training forward began
        self._gone = False  # the parameters were found non-finite
        self._named_buffers: dict[int, list[tuple[str, torch.Tensor]]] = {}  # by root id
        self._examined = 0
        self.device_checks = False
        self._params_finite: bool | None = None  # this step's, once asked
        self._captured_pass = False

    @property
    def armed(self) -> bool:
        return self.enabled and self.taken + self.failed < self.limit

    def status(self) -> dict[str, int]:
        return {"nonfinite_captures": self.taken, "nonfinite_captures_failed": self.failed}

    # -- pass and step boundaries ----------------------------------------------------------

    def new_pass(self) -> None:
        """A root's forward begins: at most one capture, and ``_EXAMINED`` looks, a pass."""
        self._examined = 0
        self._captured_pass = False

    def backward_done(self) -> None:
        """What the step's forward was is kept until the optimizer's step (a parameter's
        gradient is looked at there), or until the next training forward."""
        self._stale = True
        self._rerun_done = False
        self._examined = 0
        self._captured_pass = False

    def _forget_forwards(self) -> None:
        self._roots.clear()
        self._position.clear()
        self._nth.clear()
        self._root_keys.clear()
        self._root_grads.clear()
        self._stale = False

    def new_step(self, *, device_checks: bool = False) -> None:
        """``device_checks``: the run has shown a NaN or Inf already (the writer saw one),
        so from now on a GPU's statistics are read at once, waiting for the device, until
        the captures are used up (see ``nonfinite``)."""
        self.backward_done()
        self._forget_forwards()
        self._rerun_step = self._captured_step = False
        # a step that began with non-finite parameters: the run has gone NaN for good, and
        # checks that wait for a GPU would buy nothing from now on
        self._gone = self._gone or self._params_finite is False
        self._params_finite = None
        self.device_checks = device_checks and not self._gone

    # -- the forward -----------------------------------------------------------------------

    def _buffers(self, module: nn.Module) -> list[tuple[str, torch.Tensor]]:
        """A root's buffers, named once (a buffer registered after its first training
        forward is not watched for ``buffers_changed``)."""
        named = self._named_buffers.get(id(module))
        if named is None:
            named = self._named_buffers[id(module)] = list(module.named_buffers())
        return named

    def enter_root(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """A training forward of a root begins: keep what runs it again (its inputs, by
        reference, and the RNG, grad and autocast state), for a backward capture to recompute
        a module's inputs from. Only the model's inputs are held, never its activations."""
        if self._stale:  # the last micro-step's forward: its backward is over
            self._forget_forwards()
        buffers = self._buffers(users_module(module))  # named as the model names them
        self._roots.append(RootCall.now(module, args, kwargs, buffers))
        self._nth = {}

    def note_call(self, key: tuple[str, int], module: nn.Module) -> None:
        """A recorded training call: which root call it ran in, and which of its calls there."""
        if self._roots:
            nth = self._nth.get(key[0], 0)
            self._nth[key[0]] = nth + 1
            self._position[key] = (len(self._roots) - 1, nth)
            if module is self._roots[-1].module:
                self._root_keys[key] = len(self._roots) - 1

    def after_forward(
        self,
        name: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        outputs: list[tuple[str, torch.Tensor]],
        where: dict[str, Any],
        known: Callable[[torch.Tensor], bool | None],
    ) -> None:
        """A recorded call whose output is non-finite: capture it if it is where the NaN or
        Inf began. ``known`` tells a tensor's non-finiteness from statistics already queued
        (None: not known), so that a run gone NaN costs few extra passes."""
        if self._captured_pass or self._examined >= _EXAMINED or self._params_finite is False:
            return  # (a step whose parameters are non-finite only carries them on)
        self._examined += 1
        out_nan, out_inf = flags(t for _, t in outputs)
        inputs = list(flatten_call(args, kwargs))
        in_nan, in_inf = flags((t for _, t in inputs), known)
        if not ((out_nan and not in_nan) or (out_inf and not (in_nan or in_inf))):
            return
        if not self._model_finite():
            return
        self._captured_pass = True
        trigger = forward_trigger(outputs, "output", in_nan or in_inf)
        model = users_module(module)  # a model compiled whole: the model, not the wrapper
        tensors = {
            "inputs": inputs,
            "outputs": outputs,
            "state": state(model),
        }
        spec = self._call_spec(model, args, kwargs)
        finding = _on_replica(model, args, kwargs, grad=False, run=run_forward)
        where = {**where, "autocast": autocast_now()}
        self._capture("forward", name, model, where, trigger, spec, tensors, finding)

    # -- the backward ----------------------------------------------------------------------

    def after_gradient(
        self,
        targets: list[tuple[str, int, str, str]],
        grad: torch.Tensor,
        bad: bool,
        where: dict[str, Any],
    ) -> None:
        """A gradient arrived at the output of each module call of ``targets``. The ones at
        a root's own output are held: a re-run's backward starts from them."""
        if not bad:
            for name, call, kind, slot in targets:
                root = self._root_keys.get((name, call)) if kind == "grad_output" else None
                if root is not None:
                    self._root_grads.setdefault(root, {})[slot] = grad
            return
        if self._captured_pass or self._rerun_done:
            return
        if any((name, call) in self._root_keys for name, call, _, _ in targets):
            return  # non-finite where the model's output meets the loss: made outside it
        position = self._position.get((targets[0][0], targets[0][1]))
        roots = [position[0]] if position is not None else self._latest_roots()
        self._backward_origin(roots, where)

    def after_gradients(self, where: dict[str, Any]) -> None:
        """At the optimizer's step, before its update: a parameter's gradient is non-finite.
        Unless this step was captured or run again already (a gradient at a module's output
        was non-finite too, and led there), its last forward and backward run again."""
        if not (self._captured_step or self._rerun_step):
            self._backward_origin(self._latest_roots(), where)

    def _latest_roots(self) -> list[int]:
        return list(reversed(range(len(self._roots))))

    def _backward_origin(self, roots: list[int], where: dict[str, Any]) -> None:
        """Run the step's forward and backward again (once a backward pass) and capture the
        origin the re-run shows, if any."""
        self._rerun_done = self._rerun_step = True
        if not self._model_finite():
            return  # a step that began with non-finite parameters carries them on
        for root in roots:
            root_call = self._roots[root]
            model, calls = root_call.rerun(self._root_grads.get(root, {}))
            if self._capture_origin(root, root_call, model, calls, where):
                return

    def _capture_origin(
        self,
        root: int,
        root_call: RootCall,
        model: nn.Module,
        calls: dict[str, list[Call]],
        where: dict[str, Any],
    ) -> bool:
        """Capture the innermost recorded call of the re-run whose inputs, outputs and
        output gradients are finite while a gradient at an input or of a parameter is not.
        Where several calls of that depth qualify (one module called twice, its parameters'
        gradients summed over both), the first whose own backward reproduces it."""
        recorded = {}
        for key, (r, n) in self._position.items():
            located = self._locate(key[0])
            if r == root and located is not None:
                recorded[(located[1], n)] = key
        modules = dict(model.named_modules())
        found: list[tuple[int, tuple[str, int], Call, str]] = []
        for qualname, made in calls.items():
            for n, call in enumerate(made):
                if (qualname, n) not in recorded or not call.grad_outputs:
                    continue
                key = recorded[(qualname, n)]
                if any_nonfinite(call.grad_outputs.values()) or any_nonfinite(
                    t for _, t in (*call.inputs(), *call.outputs())
                ):
                    continue
                trigger = backward_trigger(call, modules[qualname])
                if trigger:
                    depth = qualname.count(".") + 1 if qualname else 0  # the root's is ""
                    found.append((depth, key, call, trigger))
        if not found:
            return False
        depth = max(d for d, *_ in found)
        innermost = [item for item in found if item[0] == depth]
        findings = []
        for _, key, call, trigger in innermost:
            # a model compiled whole: the model, not the wrapper (the replica of the call
            # runs eagerly, the state and class saved are the model's)
            module = users_module(self._locate(key[0])[0])  # type: ignore[index]
            finding = self._rerun_backward(root_call, module, call)
            findings.append((key, module, call, trigger, finding))
            if finding.reproduces:
                break
        key, module, call, trigger, finding = next(
            (f for f in findings if f[4].reproduces), findings[0]
        )
        changed = root_call.buffers_changed()
        meta = {**where, "call": key[1], "recomputed": True, "buffers_changed": changed,
                "autocast": [[d, str(t)[6:]] for d, t in root_call.autocast]}  # fmt: skip
        tensors = {
            "inputs": call.inputs(),
            "grad_outputs": list(call.grad_outputs.items()),
            "state": state(module),
        }
        spec = self._call_spec(module, call.args, call.kwargs)
        self._captured_pass = True
        self._capture("backward", key[0], module, meta, trigger, spec, tensors, finding)
        return True

    def _rerun_backward(self, root_call: RootCall, module: nn.Module, call: Call) -> Finding:
        """One call's backward, on a replica of the module, from the re-run's tensors, under
        the forward's grad mode and autocast."""

        def run(model: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Finding:
            return run_backward(model, args, kwargs, call.grad_outputs)

        with root_call.modes():
            return _on_replica(module, call.args, call.kwargs, grad=True, run=run)

    # -- saving ----------------------------------------------------------------------------

    def _model_finite(self) -> bool:
        """Whether the recorded models' parameters are all finite (asked once a step)."""
        if self._params_finite is None:
            nan, inf = flags(self._parameters())
            self._params_finite = not (nan or inf)
        return self._params_finite

    def _capture(
        self,
        pass_: str,
        name: str,
        module: nn.Module,
        where: dict[str, Any],
        trigger: str,
        spec: str,
        tensors: dict[str, list[tuple[str, torch.Tensor]]],
        finding: Finding,
    ) -> None:
        index = self.taken  # a failed capture writes no file
        self._captured_step = True
        head = {
            "rank": self.rank,
            "capture": index,
            **where,
            "pass": pass_,
            "module": name,
            "module_type": f"{type(module).__module__}.{type(module).__qualname__}",
            "trigger": trigger,
            "call_spec": spec,
        }
        save(self.directory, index, head, tensors, finding, max_bytes=self.max_bytes)
        self.taken += 1

    def failure(self, exc: BaseException, where: str, at: Mapping[str, Any]) -> None:
        """A capture that failed: a warning and a count in the trace's status; the recording
        and the training go on."""
        self.failed += 1
        self._captured_pass = True
        self._warn(
            f"hooktrace: could not capture the non-finite value in {where} at step "
            f"{at.get('step')}: {type(exc).__name__}: {exc}; the recording goes on"
        )


def _on_replica(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    *,
    grad: bool,
    run: Callable[[nn.Module, tuple[Any, ...], Mapping[str, Any]], Finding],
) -> Finding:
    """``run`` on a replica of ``module`` and copies of the call's tensors, the process-wide
    module hooks set aside. The re-run is hooktrace's: its failure is the capture's note."""
    try:
        run_args, run_kwargs = tree_map_only(
            torch.Tensor, lambda t: for_replay(t, grad=grad), (tuple(args), dict(kwargs))
        )
        with no_module_hooks():
            return run(replica(module), run_args, run_kwargs)
    except Exception as exc:
        return Finding("failed", message=f"{type(exc).__name__}: {exc}")
