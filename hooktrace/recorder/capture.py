"""Catch the first NaN or Inf in the act: capture the call that made it, in full, and name
the operation and the line.

The recorder asks :class:`Captures` after each recorded call whose output came out
non-finite, and after each gradient that did; on steps where everything is finite it asks
nothing (the statistics it queued already say so on the CPU: see ``nonfinite``).

- **Forward origin**: a module's output holds a NaN while none of its inputs does, or an Inf
  while all its inputs are finite, and the parameters of the model are finite (else the
  forward only shows what an earlier backward or optimizer step did).
- **Backward origin**: the gradient reaching a tensor is non-finite, and a recorded module
  that took that tensor as input had a finite gradient at its output: that module's backward
  made it.

A capture holds the call's inputs (with the call spec replay needs), its outputs, for a
backward origin the gradients at its outputs, and the parameters and buffers of the module
and every module inside it. Right after saving it, the call is run again on a copy of the
module, under a dispatch mode that names the first aten operation to make a non-finite value
(:mod:`hooktrace.recorder.first_nonfinite`), with the RNG forked and the process-wide module
hooks set aside, so the user's run goes on exactly as it would have. The answer is stored in
the capture (:mod:`hooktrace.trace.captures`), where the analyzer reads it without torch.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.modules.module as module_hooks
from torch import nn
from torch.utils._pytree import tree_map_only

from hooktrace.recorder.first_nonfinite import (
    Finding,
    for_replay,
    own_saved_tensors,
    run_backward,
    run_forward,
)
from hooktrace.recorder.flatten import flatten, flatten_call
from hooktrace.recorder.pending import Staged, to_numpy
from hooktrace.recorder.stats import usual
from hooktrace.trace import schema
from hooktrace.trace.captures import CAPTURES_DIR, write_capture

DEFAULT_LIMIT = 3
"""Captures a run keeps at most, by default: the first origin, and a couple more (a mixed
precision run may overflow now and then, each time somewhere else)."""
DEFAULT_MAX_MB = 256.0
"""The tensors of one capture, at most: past it, the rest are left out (named, with their
shapes, in the capture); the operation is still named, from the live tensors."""

_EXAMINED = 32  # non-finite outputs or gradients looked into per pass, at most
_NAN, _INF = 6, 7  # columns of a statistics row


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
        self._roots: list[_RootCall] = []  # this backward's training forwards, by root call
        self._position: dict[tuple[str, int], tuple[int, int]] = {}  # call -> (root call, nth)
        self._nth: dict[str, int] = {}  # calls of each module in the current root call
        self._root_keys: dict[tuple[str, int], int] = {}  # a root's own call -> root call
        self._root_grads: dict[int, dict[str, torch.Tensor]] = {}  # at each root call's output
        self._finite_grads: set[tuple[str, int]] = set()  # calls whose output gradients came
        self._bad_grads: set[tuple[str, int]] = set()  # finite; and non-finite
        self._bad_outputs: set[tuple[str, int]] = set()  # calls whose forward was non-finite
        self._grad_outputs: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # recomputed
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
        self._roots.clear()
        self._position.clear()
        self._nth.clear()
        self._root_keys.clear()
        self._root_grads.clear()
        self._finite_grads.clear()
        self._bad_grads.clear()
        self._bad_outputs.clear()
        self._grad_outputs = {}
        self._examined = 0
        self._captured_pass = False

    def new_step(self, *, device_checks: bool = False) -> None:
        """``device_checks``: the run has shown a NaN or Inf already (the writer saw one),
        so from now on a GPU's statistics are read at once, waiting for the device, until
        the captures are used up (see ``nonfinite``)."""
        self.backward_done()
        self._params_finite = None
        self.device_checks = device_checks

    # -- the forward -----------------------------------------------------------------------

    def enter_root(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        """A training forward of a root begins: keep what runs it again (its inputs, by
        reference, and the RNG, grad and autocast state), for a backward capture to recompute
        a module's inputs from. Only the model's inputs are held, never its activations."""
        self._roots.append(_RootCall.now(module, args, kwargs))
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
        self._bad_outputs.add((name, where["call"]))  # its backward only carries it on
        if self._captured_pass or self._examined >= _EXAMINED:
            return
        self._examined += 1
        out_nan, out_inf = _flags(t for _, t in outputs)
        inputs = list(flatten_call(args, kwargs))
        in_nan, in_inf = _flags((t for _, t in inputs), known)
        if not ((out_nan and not in_nan) or (out_inf and not (in_nan or in_inf))):
            return
        if not self._model_finite():
            return
        self._captured_pass = True
        trigger = _trigger(outputs, "output", in_nan or in_inf)
        tensors = {
            "inputs": inputs,
            "outputs": outputs,
            "state": _state(module),
        }
        spec = self._call_spec(module, args, kwargs)

        def analyse() -> Finding:
            replica = _replica(module)
            run_args, run_kwargs = tree_map_only(
                torch.Tensor, lambda t: for_replay(t, grad=False), (args, dict(kwargs))
            )
            with _no_module_hooks():
                return run_forward(replica, run_args, run_kwargs)

        self._capture("forward", name, module, where, trigger, spec, tensors, analyse)

    # -- the backward ----------------------------------------------------------------------

    def after_gradient(
        self,
        targets: list[tuple[str, int, str, str]],
        grad: torch.Tensor,
        bad: bool,
        where: dict[str, Any],
    ) -> None:
        """A gradient arrived at the output of each module call of ``targets``."""
        if not bad:
            for name, call, kind, slot in targets:
                if kind == "grad_output":
                    key = (name, call)
                    self._finite_grads.add(key)
                    root = self._root_keys.get(key)
                    if root is not None:  # held: what a re-run's backward starts from
                        self._root_grads.setdefault(root, {})[slot] = grad
            return
        for name, call, kind, _ in targets:
            if kind == "grad_output":
                self._bad_grads.add((name, call))
        producer = next(((m, c, s) for m, c, k, s in targets if k == "grad_output"), None)
        if producer is None or self._captured_pass or self._examined >= _EXAMINED:
            return
        self._examined += 1
        found = self._consumer(producer)
        if found is None:
            return
        key, module, args, kwargs = found
        what = ", ".join(f"{m} {kind} {slot}" for m, _, kind, slot in targets)
        nan, inf = int(torch.isnan(grad).sum()), int(torch.isinf(grad).sum())
        trigger = (
            f"the gradient reaching its input (the {what}) holds {nan} NaN and {inf} Inf "
            f"of {grad.numel()}, while every gradient at its output was finite"
        )
        self._backward_capture(key, module, args, kwargs, trigger, where)

    def after_backward(
        self, owners: list[str], grads: list[torch.Tensor | None], where: dict[str, Any]
    ) -> None:
        """A backward pass is over: a parameter's gradient that came out non-finite while
        every gradient at its module's output was finite began in that module's backward.
        ``owners[i]`` is the module of the parameter whose gradient is ``grads[i]``.

        One fused norm a backward finds whether any gradient is non-finite (on the CPU only:
        on a GPU it would wait for the device, see docs/PERFORMANCE.md)."""
        if self._captured_pass:
            return
        present = [
            (owner, g)
            for owner, g in zip(owners, grads, strict=True)
            if g is not None
            and usual(g)
            and g.is_floating_point()
            and (g.is_cpu or self.device_checks)
        ]
        if not present:
            return
        norms = torch._foreach_norm([g for _, g in present])
        if bool(torch.stack([n.float() for n in norms]).isfinite().all()):
            return
        for (owner, g), norm in zip(present, norms, strict=True):
            if bool(norm.isfinite()) or not check(g):  # a finite gradient whose norm overflows
                continue
            key = next((k for k in self._position if k[0] == owner and self._clean(k)), None)
            located = self._locate(owner) if key is not None else None
            if key is None or located is None:
                continue
            root, qualname = self._position[key][0], located[1]
            seen = self._recompute(root)
            nth = self._position[key][1]
            calls = seen.get(qualname, [])
            if nth >= len(calls):
                continue
            args, kwargs, _, _ = calls[nth]
            nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
            trigger = (
                f"the gradient of one of its parameters holds {nan} NaN and {inf} Inf of "
                f"{g.numel()}, while every gradient at its output was finite"
            )
            self._backward_capture(key, located[0], args, kwargs, trigger, where)
            return

    def _backward_capture(
        self,
        key: tuple[str, int],
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        trigger: str,
        where: dict[str, Any],
    ) -> None:
        inputs = list(flatten_call(args, kwargs))
        if any(_flags(t for _, t in inputs)) or not self._model_finite():
            return  # its forward took a NaN or Inf in: the backward only carries it on
        grad_outputs = self._grad_outputs.get(key)
        if not grad_outputs:
            return  # the re-run's backward did not reach it
        self._captured_pass = True
        tensors = {
            "inputs": inputs,
            "grad_outputs": list(grad_outputs.items()),
            "state": _state(module),
        }
        spec = self._call_spec(module, args, kwargs)

        def analyse() -> Finding:
            replica = _replica(module)
            run_args, run_kwargs = tree_map_only(
                torch.Tensor, lambda t: for_replay(t, grad=True), (args, dict(kwargs))
            )
            with _no_module_hooks():
                return run_backward(replica, run_args, run_kwargs, grad_outputs)

        where = {**where, "call": key[1], "recomputed": True}
        self._capture("backward", key[0], module, where, trigger, spec, tensors, analyse)

    def _consumer(
        self, producer: tuple[str, int, str]
    ) -> tuple[tuple[str, int], nn.Module, tuple[Any, ...], dict[str, Any]] | None:
        """The innermost recorded call that took the producer's output as input and whose
        output gradients all came finite, with its inputs: the producer's root call is run
        again (:meth:`_recompute`), and the tensor it returns is followed by identity."""
        name, call, slot = producer
        position = self._position.get((name, call))
        located = self._locate(name)
        if position is None or located is None:
            return None
        root, nth = position
        seen = self._recompute(root)
        made = seen.get(located[1], [])
        if nth >= len(made):
            return None
        output = made[nth][2]
        tensor = output if isinstance(output, torch.Tensor) else dict(flatten(output)).get(slot)
        if tensor is None:
            return None
        by_qualname = {}
        for key, (r, n) in self._position.items():
            where = self._locate(key[0])
            if r == root and where is not None:
                by_qualname[(where[1], n)] = (key, where[0])
        found = None
        for qualname, calls in seen.items():
            for n, (args, kwargs, _, _) in enumerate(calls):
                known = by_qualname.get((qualname, n))
                if known is None or not self._clean(known[0]):
                    continue
                deeper = found is None or known[0][0].count(".") > found[0][0].count(".")
                if deeper and any(t is tensor for _, t in flatten_call(args, kwargs)):
                    found = (known[0], known[1], args, kwargs)
        return found

    def _recompute(self, root: int) -> dict[str, list[list[Any]]]:
        """Run root call ``root`` again on a copy of its model, as it ran (its inputs, RNG,
        grad mode and autocast; the parameters are unchanged until the optimizer steps), then
        its backward from the gradients its outputs received, and return what each module of
        the copy was called with, returned and received as output gradients (by slot), by
        qualified name, call after call. What a backward capture needs is made again here,
        rather than held through every step: only the model's inputs and the gradients at
        its outputs are held. The gradients at a module's output are also kept, by trace
        name and call, in ``_grad_outputs``."""
        call = self._roots[root]
        replica = _replica(call.module)
        seen: dict[str, list[list[Any]]] = {}

        def pre(qualname: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
                seen.setdefault(qualname, []).append([args, kwargs, None, {}])

            return hook

        def grad_of(grads: dict[str, torch.Tensor], slot: str) -> Callable[..., None]:
            def hook(grad: torch.Tensor) -> None:
                grads[slot] = grad

            return hook

        def post(qualname: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
                entry = seen[qualname][-1]
                entry[2] = output
                for slot, tensor in flatten(output):
                    if tensor.requires_grad:
                        tensor.register_hook(grad_of(entry[3], slot))

            return hook

        for qualname, sub in replica.named_modules():
            sub.register_forward_pre_hook(pre(qualname), with_kwargs=True)
            sub.register_forward_hook(post(qualname), with_kwargs=True)
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t.detach().clone(), (call.args, dict(call.kwargs))
        )
        grads = self._root_grads.get(root, {})
        with _no_module_hooks(), call.restored():
            output = replica(*args, **kwargs)
            pairs = [(t, grads[slot]) for slot, t in flatten(output) if slot in grads]
            pairs = [(t, g) for t, g in pairs if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        self._grad_outputs = {}
        for key, (r, n) in self._position.items():
            located = self._locate(key[0])
            if r == root and located is not None and n < len(seen.get(located[1], [])):
                self._grad_outputs[key] = seen[located[1]][n][3]
        return seen

    def _clean(self, key: tuple[str, int]) -> bool:
        """Whether a held call's forward output and every gradient at it were finite."""
        return (
            key in self._finite_grads
            and key not in self._bad_grads
            and key not in self._bad_outputs
        )

    # -- saving ----------------------------------------------------------------------------

    def _model_finite(self) -> bool:
        """Whether the recorded models' parameters are all finite (asked once a step)."""
        if self._params_finite is None:
            nan, inf = _flags(self._parameters())
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
        analyse: Callable[[], Finding],
    ) -> None:
        index = self.taken  # a failed capture writes no file
        stored, left_out = self._arrays(tensors)
        try:
            finding = analyse()
        except Exception as exc:  # the re-run is ours: its failure is the capture's note
            finding = Finding("failed", message=f"{type(exc).__name__}: {exc}")
        meta = {
            "rank": self.rank,
            "capture": index,
            **where,
            "pass": pass_,
            "module": name,
            "module_type": f"{type(module).__module__}.{type(module).__qualname__}",
            "trigger": trigger,
            "call_spec": spec,
            "left_out": left_out,
            "max_mb": self.max_bytes / (1 << 20),
            "time": time.time(),
            "analysis": finding.as_dict(),
        }
        write_capture(self.directory, index, meta, stored)
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

    def _arrays(
        self, tensors: dict[str, list[tuple[str, torch.Tensor]]]
    ) -> tuple[dict[str, list[tuple[str, np.ndarray, str]]], list[dict[str, Any]]]:
        """The tensors as numpy, in group order, until the size limit: the rest are named in
        ``left_out`` with their shapes and dtypes."""
        stored: dict[str, list[tuple[str, np.ndarray, str]]] = {}
        left_out: list[dict[str, Any]] = []
        budget = self.max_bytes
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


@dataclass
class _RootCall:
    """A root's training forward, as much of it as runs it again: its inputs (references to
    the caller's tensors), the RNG of the CPU and of each GPU, grad mode and autocast."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]
    grad_enabled: bool
    autocast: list[tuple[str, torch.dtype]]

    @classmethod
    def now(cls, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> _RootCall:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return cls(
            module=module,
            args=args,
            kwargs=kwargs,
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if cuda else [],
            grad_enabled=torch.is_grad_enabled(),
            autocast=[
                (device, torch.get_autocast_dtype(device))
                for device in ("cpu", "cuda")
                if torch.is_autocast_enabled(device)
            ],
        )

    @contextmanager
    def restored(self) -> Iterator[None]:
        """The state the call ran in, for the length of a re-run; the caller's is left as it
        was (the RNG is forked)."""
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=range(len(self.cuda_rng))))
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng:
                torch.cuda.set_rng_state_all(self.cuda_rng)
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            stack.enter_context(own_saved_tensors())
            yield


def nonfinite(stats: Any, tensor: torch.Tensor, *, on_device: bool = False) -> bool | None:
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
    return None if tensor.is_floating_point() else False


def check(tensor: torch.Tensor) -> bool:
    """A look of its own: whether a plain tensor holds a NaN or Inf."""
    if not usual(tensor) or not tensor.is_floating_point():
        return False
    # detached: isfinite is abs() underneath, which would save the tensor for a backward (a
    # checkpoint's saved-tensor hooks would count it)
    return not bool(torch.isfinite(tensor.detach()).all())


def _flags(
    tensors: Any, known: Callable[[torch.Tensor], bool | None] | None = None
) -> tuple[bool, bool]:
    """(holds a NaN, holds an Inf) over ``tensors``; where ``known`` says a tensor is finite,
    it is not looked at."""
    nan = inf = False
    for t in tensors:
        if not usual(t) or not t.is_floating_point():  # a subclass would see the look
            continue
        if known is not None and known(t) is False:
            continue
        t = t.detach()  # see check()
        nan = nan or bool(torch.isnan(t).any())
        inf = inf or bool(torch.isinf(t).any())
    return nan, inf


def _trigger(outputs: list[tuple[str, torch.Tensor]], what: str, inputs_infinite: bool) -> str:
    parts = []
    for slot, t in outputs:
        t = t.detach()
        if t.is_floating_point() or t.is_complex():
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            if nan or inf:
                parts.append(f"{what} {slot} holds {nan} NaN and {inf} Inf of {t.numel()}")
    inputs = "its inputs hold Inf but no NaN" if inputs_infinite else "every input was finite"
    return f"{'; '.join(parts)}, while {inputs}"


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    state: list[tuple[str, torch.Tensor]] = list(module.named_parameters())
    state += [(name, b) for name, b in module.named_buffers() if b is not None]
    return [(name, t.detach()) for name, t in state]


def _dense_on_host(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return t.cpu()


def _replica(module: nn.Module) -> nn.Module:
    """A deep copy to run again: the user's module is never called twice. Hooks a user hung
    on the copied modules are dropped (they would see a call the script never made), all but
    torch's own (weight_norm's computes the weight)."""
    replica = copy.deepcopy(module)
    for sub in replica.modules():
        for hooks in (sub._forward_pre_hooks, sub._forward_hooks, sub._backward_hooks,
                      sub._backward_pre_hooks):  # fmt: skip
            for key in [k for k, hook in hooks.items() if not _torch_own(hook)]:
                del hooks[key]
    return replica


def _torch_own(hook: Any) -> bool:
    owner = getattr(hook, "__module__", None) or type(hook).__module__
    return owner.startswith("torch.")


_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks",
)  # fmt: skip


@contextmanager
def _no_module_hooks() -> Iterator[None]:
    """The process-wide module hooks set aside while the copy runs: the user's would see a
    call the script never made (hooktrace's own ignore the copy anyway)."""
    saved = [(name, dict(getattr(module_hooks, name))) for name in _GLOBAL_HOOKS]
    for name, _ in saved:
        getattr(module_hooks, name).clear()
    try:
        yield
    finally:
        for name, hooks in saved:
            table = getattr(module_hooks, name)
            added = dict(table)  # registered meanwhile (by another thread): kept, after
            table.clear()
            table.update(hooks)
            table.update(added)
