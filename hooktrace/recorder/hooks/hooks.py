"""What the recorder does when torch calls it: a root's forward begins, a module returns, a
gradient arrives, a backward pass ends, a watched tensor is seen.

torch calls the process-wide hooks (:mod:`hooktrace.recorder.hooks.attach`) for every module call
in the process. Each returns at once unless the module is in the table; ``is_compiling()``
comes first, as dynamo cannot trace the look-up. A recorded call counts itself
(:mod:`~hooktrace.recorder.hooks.calls`), hands each tensor to the hot path
(:mod:`~hooktrace.recorder.records.observe`), hooks the gradients of its outputs, and tells the
captures (:mod:`~hooktrace.recorder.nonfinite.capture`) where a NaN or Inf came out.

These handlers are the base class of :class:`~hooktrace.recorder.recording.recorder.Recorder` rather
than a collaborator of it: each reads and writes the recorder's per-step state (declared
below, set by the recorder), ``hooktrace record``'s ScriptRecorder extends them by
overriding (:mod:`~hooktrace.recorder.recording.discover`), and on the way to the hot path they must
cost no more than a method call.
"""

from __future__ import annotations

import base64
import contextlib
import json
import sys
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hooktrace.recorder.graphs import ops
from hooktrace.recorder.graphs.ops import mark_inputs, mark_outputs, mark_watched
from hooktrace.recorder.graphs.plan import Plan
from hooktrace.recorder.hooks import attach
from hooktrace.recorder.hooks.attach import Attached, ModuleTable, is_compiling
from hooktrace.recorder.hooks.attach import in_backward as _in_backward
from hooktrace.recorder.hooks.attach import in_transform as _in_transform
from hooktrace.recorder.hooks.calls import Calls, Target
from hooktrace.recorder.hooks.compiled import CompiledCalls, Expected
from hooktrace.recorder.hooks.names import Names
from hooktrace.recorder.nonfinite import finite
from hooktrace.recorder.nonfinite.capture import Captures
from hooktrace.recorder.records.flatten import describe_call, flatten, flatten_call
from hooktrace.recorder.records.observe import Observer
from hooktrace.recorder.records.params import Entry, RecordsCache, queue_records, trainable
from hooktrace.recorder.records.pending import PendingStep
from hooktrace.recorder.records.staging import Staged

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class Hooks:
    """The recorder's hook handlers."""

    # the recorder's state that the handlers read and write
    inputs: bool
    params: bool
    current_step: int
    micro_step: int
    _active: bool  # hooks act (not closed, no fault)
    _recording: bool
    _full_step: bool
    _pending: PendingStep
    _params_phase: str | None  # the phase whose forward recorded the step's parameters
    _root_depth: int  # > 0 inside a root's forward
    _began: Plan | None  # a compiled function's graph about to run, its first forward entered
    _root_thread: int  # the thread that entered it (threading.get_ident)
    _phase: str  # the phase of the root's forward running, or of the last one
    _backward_active: bool
    _paused: int  # > 0 while torch.jit.trace re-runs the model to check its graph
    _lock: threading.RLock
    _table: ModuleTable
    _names: Names
    _calls: Calls
    _compiled: CompiledCalls
    _observer: Observer
    _captures: Captures
    # what the recorder does for them
    _fault: Callable[[BaseException, str], None]
    _restructure: Callable[[nn.Module], None]
    _compiled_before: Callable[[Any], None]  # a compiled root ran graphs not instrumented

    # -- the process-wide hooks ------------------------------------------------------------

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if is_compiling():  # dynamo traces this: the positional arguments are marked in its
            # graph as the call gets them, before the module's own pre-hooks (tensor
            # parallelism's make them DTensors), as an eager run records them
            wrapper = type(module).__name__ == "OptimizedModule"
            if self.inputs and args and not wrapper and not attach.exporting():
                mark_inputs(args, {})
            return
        entry = self._table.get(module)
        if entry is None or not (entry.root or self.inputs) or self._paused or attach.traced():
            return
        if _in_backward() or _in_transform():
            return
        with self._lock:
            if entry.root:
                self._enter_root(module, args)
            if entry.name is not None and self.inputs and self._recording:
                try:
                    if kwargs is None:
                        kwargs = attach.call_kwargs()
                    with _unseen():
                        self._on_inputs(entry.name, module, args, kwargs)
                except Exception as exc:
                    self._fault(exc, f"the inputs of {entry.name!r}")

    def _post(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any = attach.RAISED,
    ) -> None:
        """A module returned (its outputs recorded, then :meth:`_exit`), or its forward
        raised (torch then calls this as ``(module, args, None)``: :meth:`_exit` only)."""
        if is_compiling():  # dynamo traces this: the outputs are marked in its graph (a
            # compiled call never gets here raising: torch runs no hook then)
            if not attach.exporting() and type(module).__name__ != "OptimizedModule":
                if self.inputs and kwargs:  # (here, not in _pre: dynamo traces no frame
                    mark_inputs((), kwargs)  # inspection, which finds them there)
                mark_outputs(output)
            return
        entry = self._table.get(module)
        if output is attach.RAISED:
            self._exit(entry, module, args, None)
        elif entry is None or entry.name is None:  # not recorded, or a root only
            self._exit(entry, module, args, output)
        else:
            try:
                self._returned(entry, module, args, kwargs, output)
            finally:
                self._exit(entry, module, args, output)

    def _returned(
        self,
        entry: Attached,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> None:
        """A recorded module (``entry`` names it) returned ``output``."""
        if not self._recording or self._paused or attach.elsewhere():
            return
        name = entry.name
        assert name is not None  # (_post's check)
        with self._lock:
            if not entry.root:
                self._compiled.inside_eagerly = True
            try:
                if type(output) is torch.Tensor:
                    self._on_forward(name, module, args, kwargs, output, entry.channels_first)
                else:  # a container, or a tensor subclass: see _unseen()
                    with _unseen():
                        self._on_forward(name, module, args, kwargs, output, entry.channels_first)
            except Exception as exc:
                self._fault(exc, f"the forward of {name!r}")

    def _exit(
        self, entry: Attached | None, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        """Runs last in ``_post`` for every module (``entry``: its entry in the table, if
        any), also when the forward raised: the root's records carry the root's phase, and
        an exception leaves no depth behind."""
        if entry is None or not entry.root or self._paused or attach.traced():
            return
        if not _in_backward() and not _in_transform():
            with self._lock:
                self._root_depth = max(0, self._root_depth - 1)
                if self._root_depth == 0:
                    self._compiled.left()
                if self._root_depth == 0 and self._recording and self._compiled.unseen(module):
                    self._compiled_before(entry)

    def _grad_hook(self, targets: list[Target]) -> Callable[[torch.Tensor], None]:
        """A tensor's gradient hook: records the gradient as each (module, call, kind, slot)
        of ``targets`` (a tensor several modules returned is each one's output)."""

        def hook(grad: torch.Tensor | None) -> None:
            # None: an output of a compiled graph that nothing outside it used (its loss was
            # computed inside: its gradient then taken inside the graph, Plan.returned_taps)
            if grad is not None and self._recording and not _in_transform():
                with self._lock:
                    module = targets[0][0]
                    try:
                        if not self._backward_active:
                            self._backward_active = True
                            _queue_callback(self._backward_done)
                        stats = None
                        for module, call, kind, slot in targets:
                            full = self._full_step and self._names.wants_full(module)
                            stats = self._observer.observe(self._pending, self.micro_step, module,
                                                           call, kind, slot, grad, phase="train",
                                                           full=full, units=False)  # fmt: skip
                        if self._captures.armed:
                            self._after_gradient(targets, grad, stats)
                    except Exception as exc:
                        self._fault(exc, f"the backward of {module!r}")

        return hook

    def _capture_hook(self, targets: list[Target]) -> Callable[[torch.Tensor], None]:
        """The gradient hook of an output whose gradient is recorded from a compiled graph's
        tap (``CompiledCalls.through_tap``): the gradient reaching the tensor from outside
        the graph, for the non-finite capture alone. It is what a re-run of the call takes at
        its outputs, the graph's own uses of the value being run again with it."""

        def hook(grad: torch.Tensor | None) -> None:
            if grad is None or not self._recording or _in_transform() or not self._captures.armed:
                return
            with self._lock:
                if not self._backward_active:
                    self._backward_active = True
                    _queue_callback(self._backward_done)
                self._after_gradient(targets, grad, None, looked=True)

        return hook

    # -- compiled graphs (hooktrace.recorder.graphs.backend.Receiver) ------------------------

    def graph_ran(
        self,
        plan: Plan,
        args: tuple[Any, ...],
        extras: Sequence[torch.Tensor],
        returned: Sequence[Any] = (),
    ) -> None:
        """An instrumented graph ran: its module calls' outputs are recorded from the
        statistics it computed (``extras``: a row each, and their per-unit counts);
        ``returned``: its own outputs."""
        if not self._recording or self._paused or _in_transform():
            return
        with self._lock:
            try:
                self._on_graph(plan, args, extras, returned)
            except Exception as exc:
                self._fault(exc, "the statistics of a compiled graph")

    def _on_graph(
        self,
        plan: Plan,
        args: tuple[Any, ...],
        extras: Sequence[torch.Tensor],
        returned: Sequence[Any] = (),
    ) -> None:
        compiled = self._compiled
        entries = compiled.modules(plan, args)
        compiled.delivered += 1
        stats, counts, sizes, values = plan.split(extras)
        stats = stats.detach().clone()  # a graph may hand out the same buffers again
        counts = counts.detach().clone() if counts is not None else None
        outside = self._root_depth > 0  # inside a root's call, whose hooks record the root
        forwards = None if outside else self._root_forwards(plan, entries)
        self._graph_records(plan, entries, stats, counts, sizes, values, forwards=forwards,
                            returned=returned)  # fmt: skip

    def graph_begins(self, plan: Plan, args: tuple[Any, ...]) -> None:
        """An instrumented graph is about to run: where it is a compiled function's (no
        root's call around it), the first root forward in it is entered now, as an eager
        call's pre-hook runs before its forward: a step found by forwards ends before the
        graph's variant for the step is chosen (recorded or not)."""
        self._began = None
        if self._active and not self._root_depth and self._enter_forwards(plan, args, first=True):
            self._began = plan

    def graph_ran_unrecorded(self, plan: Plan, args: tuple[Any, ...]) -> None:
        """An instrumented graph ran without its statistics (a step not recorded): the root
        forwards in it after the first (:meth:`graph_begins`) are entered all the same, as
        their eager calls would be."""
        if not self._root_depth:
            self._enter_forwards(plan, args, first=False)

    def _enter_forwards(self, plan: Plan, args: tuple[Any, ...], *, first: bool) -> bool:
        """Enter the root forwards of a compiled function's graph (:meth:`_root_forwards`;
        ``first``: the first alone). Whether one was entered."""
        if self._paused or _in_transform():
            return False
        entered = False
        with self._lock:
            try:
                forwards = self._root_forwards(plan, self._compiled.modules(plan, args))
                for (root, opens), module_call in zip(forwards, plan.calls, strict=True):
                    if opens and root is not None:
                        self._enter_root_of_graph(root, module_call.grad)
                        entered = True
                        if first:
                            break
            except Exception as exc:
                self._fault(exc, "the models of a compiled graph")
        return entered

    def _root_forwards(
        self, plan: Plan, entries: list[Attached | None]
    ) -> list[tuple[nn.Module | None, bool]]:
        """For a compiled function's graph (no root's call around it), each call's root (the
        root its module was named under; a watched tensor's, the next call's root's) and
        whether a forward of that root begins there: at its first call, and after each call
        of the root itself (a model called three times, a teacher then a student: a forward
        each, as an eager run's calls are)."""
        roots: list[nn.Module | None] = [
            self._names.root_of(e.module) if e is not None and e.module is not None else None
            for e in entries
        ]
        after: nn.Module | None = None
        for i in reversed(range(len(roots))):  # a watched tensor: in the forward around it
            after = roots[i] = roots[i] if roots[i] is not None else after
        before: nn.Module | None = None
        for i, root in enumerate(roots):
            before = roots[i] = root if root is not None else before
        forwards: list[tuple[nn.Module | None, bool]] = []
        current: nn.Module | None = None
        began = self._began is plan  # its first forward entered before it ran
        self._began = None
        for root, entry, module_call in zip(roots, entries, plan.calls, strict=True):
            opens = root is not None and root is not current
            forwards.append((root, opens and not began))
            began = began and not opens
            current = root
            if entry is not None and entry.root and module_call.outputs[0].kind != "input":
                current = None  # the root returned: its next call is another forward
        return forwards

    def _enter_root_of_graph(self, root: nn.Module, grad: bool | None) -> None:
        """A forward of ``root`` begins inside a compiled function's graph: entered as its
        call would be, under the grad mode the graph set there (``torch.no_grad()`` around
        a teacher), and left at once (its calls are the graph's)."""
        with contextlib.nullcontext() if grad is None else torch.set_grad_enabled(grad):
            self._enter_root(root, ())
        self._root_depth = max(0, self._root_depth - 1)

    def _graph_records(
        self,
        plan: Plan,
        entries: list[Attached | None],
        stats: torch.Tensor,
        counts: torch.Tensor | None,
        sizes: Sequence[Any],
        values: Sequence[torch.Tensor],
        *,
        forwards: list[tuple[nn.Module | None, bool]] | None,
        returned: Sequence[Any] = (),
    ) -> None:
        """Queue the records of a graph's module calls. ``forwards``: where no root's call
        runs around the graph (a compiled function's), each call's root and whether a
        forward of it begins there (:meth:`_root_forwards`): entered there, before its calls
        are queued (a step found by forwards may end there), each call in its forward's
        phase, the roots' own calls recorded too; None: inside a root's call, whose phase
        the calls take and whose hooks record the root. ``values``: where the step needs
        them (tensors saved whole, histograms of outputs), the values summarised, by row;
        ``returned``: the graph's own outputs, those that left it through a tap
        (``plan.returned_taps``) handed to the hooks that run outside it to record their
        gradients from it."""
        roots = forwards is not None
        outside_phase = phase = (
            self._phase if self._root_depth else ("train" if torch.is_grad_enabled() else "eval")
        )
        observer, calls = self._observer, self._calls
        taps: dict[int, Expected] = {}
        for i, (module_call, entry) in enumerate(zip(plan.calls, entries, strict=True)):
            if forwards is not None:
                root, opens = forwards[i]
                if opens and root is not None:
                    self._enter_root_of_graph(root, module_call.grad)
                phase = self._phase if root is not None else outside_phase
            if entry is None or entry.name is None or (entry.root and not roots):
                continue
            training = phase == "train"
            name = entry.name
            # an entry of a call's arguments comes first: the call is counted by its outputs'
            call = calls.count(phase, name) if module_call.counts else calls.peek(phase, name)
            full = self._full_step and self._names.wants_full(name)  # (a watched tensor's too)
            pending = self._pending  # (a forward entered may have ended the step)
            for out in module_call.outputs:
                span, shape = out.counts, out.shape_of(sizes)
                units = (
                    counts[span[0] : span[1]] if span is not None and counts is not None else None
                )
                observer.summarised(pending, self.micro_step, name, call, out.kind, out.slot,
                                    stats[out.row], units, out.dtype, shape, phase=phase,
                                    shard=out.shard, value=values[out.row] if values else None,
                                    full=full)  # fmt: skip
                if training and out.tap is not None and out.kind != "input":
                    grad = "grad_tensor" if out.kind == "tensor" else "grad_output"
                    target = (name, call, grad, out.slot)
                    taps.setdefault(out.tap, ([], out.dtype, shape))[0].append(target)
        for tap, expected in taps.items():
            self._compiled.expect(tap, expected)
        if outside_phase == "train" and not roots and plan.returned_taps and returned:
            self._compiled.returned(plan.returned_taps, returned, taps)

    def graph_kept(self, site: int, value: torch.Tensor) -> None:
        """A compiled backward handed on the gradient at one of its taps in full (a step
        that needs the values): its record takes it when its row arrives."""
        if self._recording and not _in_transform():
            with self._lock:
                self._compiled.kept[site] = value

    def graph_gradient(self, site: int, row: torch.Tensor) -> None:
        """A compiled backward summarised the gradient at one of its taps (``row``)."""
        if not self._recording or _in_transform():
            return
        with self._lock:
            value = self._compiled.kept.pop(site, None) if self._compiled.kept else None
            expected = self._compiled.arrived(site)
            if expected is None or not expected[0]:  # (none: a value returned, unclaimed)
                return
            targets, dtype, shape = expected
            shard, place = None, ops.gradient_place(site)
            if place is not None:  # a DTensor's gradient: its local shard's statistics
                shard, shape = place
            try:
                if not self._backward_active:
                    self._backward_active = True
                    torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
                for module, call, kind, slot in targets:
                    full = self._full_step and self._names.wants_full(module)
                    self._observer.summarised(self._pending, self.micro_step, module, call, kind,
                                              slot, row, None, dtype, shape, phase="train",
                                              shard=shard, value=value, full=full)  # fmt: skip
            except Exception as exc:
                self._fault(exc, f"the backward of {targets[0][0]!r}")

    # -- what they do ----------------------------------------------------------------------

    def _enter_root(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._root_depth and self._ended_unseen(module):
            self._root_depth = 0
        if self._root_depth == 0:
            self._root_thread = threading.get_ident()
            if self._backward_active:  # the last backward raised before it finished
                self._backward_active = False
            training = torch.is_grad_enabled() and module.training
            self._phase = "train" if training else "eval"
            if self._recording and self._params_phase is None:  # the step's first forward
                try:
                    self._restructure(module)
                except Exception as exc:
                    self._fault(exc, f"naming the modules of {type(module).__name__}")
            # parameters as the step's first forward finds them, and again as its first
            # training forward does, where an evaluation came first (an EMA callback may
            # have swapped them in for it): each phase's records hold what it used
            wanted = self._params_phase is None or (self._params_phase == "eval" and training)
            if self._recording and self.params and wanted:
                self._params_phase = self._phase
                try:
                    self._record_params("param")
                    self._record_params("buffer")
                except Exception as exc:
                    self._fault(exc, "the parameters")
            self._captures.new_pass()
            if (
                self._captures.armed
                and self._recording
                and self._phase == "train"
                and not self._table.is_replica(module)  # held weakly: a re-run would keep it
            ):
                try:
                    self._captures.enter_root(module, args, attach.call_kwargs())
                except Exception as exc:  # a capture's failure is its own
                    where = self._where_now("train", 0)
                    self._captures.failure(exc, f"the forward of {type(module).__name__}", where)
        if self._root_depth == 0:
            self._compiled.entering()
        self._root_depth += 1

    def _ended_unseen(self, module: nn.Module) -> bool:
        """Whether the root's forward that the depth counts has ended without a hook: one a
        BaseException ended (a KeyboardInterrupt the script caught), where torch calls
        none. Asked where a root's forward (``module``'s) starts inside another's on the
        thread that entered it: that one runs still where a root's call is on this thread's
        stack, beyond ``module``'s own. Another thread's root (a replica's) is left as it
        is."""
        if threading.get_ident() != self._root_thread:
            return False
        call = nn.Module._call_impl.__code__
        own = True  # the innermost call of ``module``: the one starting now
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None:
            if frame.f_code is call:
                caller = frame.f_locals.get("self")
                if own and caller is module:
                    own = False
                elif isinstance(caller, nn.Module):
                    entry = self._table.get(caller)
                    if entry is not None and entry.root:
                        return False
            frame = frame.f_back
        return True

    def _phase_of(self, module: nn.Module) -> str:
        """Inside a root's forward, the root's phase; outside, the module's own."""
        if self._root_depth:
            return self._phase
        return "train" if torch.is_grad_enabled() and module.training else "eval"

    def _on_inputs(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        phase = self._phase_of(module)
        call = self._calls.peek(phase, name)  # the forward hook counts the call
        full = self._full_step and name in self._names.full_modules
        if full:  # what replay needs to call the module again
            spec = call_spec(module, args, kwargs)
            if any(True for _ in flatten_call(args, kwargs)):
                self._pending.specs[len(self._pending.meta)] = spec
            else:  # no tensor input: the spec goes on the call's first output
                self._calls.output_specs[(name, call)] = spec
        for slot, tensor in flatten_call(args, kwargs):
            self._observe(name, call, "input", slot, tensor, phase=phase, full=full, units=True)

    def _on_forward(
        self,
        name: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        channels_first: bool,
    ) -> None:
        calls = self._calls
        if _in_backward():
            calls.recomputed(name, output, self._grad_hook)
            return
        if self._root_depth:  # (_phase_of and calls.count, inline: every module call's)
            phase = self._phase
        else:
            phase = "train" if torch.is_grad_enabled() and module.training else "eval"
        counts, key = calls.counts, (phase, name)
        call = counts.get(key, 0)
        counts[key] = call + 1
        full = self._full_step and name in self._names.full_modules
        specs = calls.output_specs
        spec = specs.pop((name, call), None) if specs else None
        if spec is not None:
            self._pending.specs[len(self._pending.meta)] = spec
        outputs = (("0", output),) if isinstance(output, torch.Tensor) else flatten(output)
        captures, observer, pending = self._captures, self._observer, self._pending
        armed = captures.armed
        nonfinite = hooked = False
        for slot, tensor in outputs:
            if channels_first and tensor.dim() == 3:
                observer.channel_shapes.add(tensor.shape)
            stats = observer.observe(pending, self.micro_step, name, call, "output", slot, tensor,
                                     phase=phase, full=full, units=True)  # fmt: skip
            if armed and not nonfinite:
                nonfinite = self._nonfinite(stats, tensor)
            if phase == "train" and tensor.requires_grad:
                hooked = True
                calls.grad_hooked.add((name, call))
                target = (name, call, "grad_output", slot)
                # a compiled graph's output that left it through a tap: the tap sees what
                # the graph's own uses add to the gradient, a hook on the tensor does not
                if not (self._compiled.tapped and self._compiled.through_tap(tensor, target)):
                    calls.hook_grad(tensor, target, self._grad_hook)
                elif armed:  # recorded from the tap; a capture takes what reaches the tensor
                    calls.hook_grad(tensor, target, self._capture_hook)
        if not armed:
            return
        if hooked:
            captures.note_call((name, call), module)
        if nonfinite:
            where = self._where_now(phase, call)
            tensors = [("0", output)] if isinstance(output, torch.Tensor) else list(flatten(output))
            try:
                captures.after_forward(name, module, args, kwargs, tensors, where, self._queued)
            except Exception as exc:  # a capture's failure is its own: the recording goes on
                captures.failure(exc, f"the forward of {name!r}", where)

    def _backward_done(self) -> None:
        """Queued on the autograd engine: runs once when a backward pass completes."""
        with self._lock:
            self._backward_active = False
            self.micro_step += 1
            self._calls.backward_done()
            self._compiled.backward_done()
            self._captures.backward_done()

    def watch(self, tensor: torch.Tensor, name: str) -> None:
        if is_compiling():  # dynamo traces this: the tensor is marked in its graph
            mark_watched(tensor, name)
            return
        if not self._recording or _in_backward() or _in_transform():
            return
        with self._lock:
            try:
                phase = (
                    self._phase
                    if self._root_depth
                    else ("train" if torch.is_grad_enabled() else "eval")
                )
                call = self._calls.count(phase, name)
                full = self._full_step and self._names.wants_full(name)
                with _unseen():  # a script's tensor subclass sees none of it
                    self._observe(name, call, "tensor", "0", tensor, phase=phase, full=full,
                                  units=True)  # fmt: skip
                    if phase == "train" and tensor.requires_grad:
                        target = (name, call, "grad_tensor", "0")
                        self._calls.hook_grad(tensor, target, self._grad_hook)
            except Exception as exc:
                self._fault(exc, f"the watched tensor {name!r}")

    def _observe(
        self,
        module: str,
        call: int,
        kind: str,
        slot: str,
        tensor: torch.Tensor,
        *,
        phase: str,
        full: bool,
        units: bool,
        note: str = "",
        histogram: bool = True,
    ) -> Any:
        """The hot path (:meth:`~hooktrace.recorder.records.observe.Observer.observe`): queue this
        tensor's record in the step. Returns its statistics (None: not summarised)."""
        return self._observer.observe(self._pending, self.micro_step, module, call, kind, slot,
                                      tensor, phase=phase, full=full, units=units, note=note,
                                      histogram=histogram)  # fmt: skip

    def _record_params(
        self, kind: str, only: list[Entry] | None = None, phase: str | None = None
    ) -> None:
        """Parameters and buffers as the step's first forward finds them; gradients as
        accumulated at the step's end (labelled with the step's last micro-step), of the
        parameters that require one (a frozen backbone's, an EMA copy's have none to miss).
        ``only``: these entries alone, in ``phase`` (a root found after the step's first
        forward), their records built for this once."""
        full_step = self._full_step
        saved_micro_step = self.micro_step
        if kind == "grad_param":
            self.micro_step = max(self.micro_step - 1, 0)
        try:
            names, observer = self._names, self._observer
            entries = names.buffer_entries if kind == "buffer" else names.param_entries
            if only is not None:
                entries = only
            queue_records(
                kind,
                trainable(entries) if kind == "grad_param" else entries,
                names.param_records if only is None else RecordsCache(),
                self._pending,
                phase="train" if kind == "grad_param" else (phase or self._phase),
                micro_step=self.micro_step,
                saved_whole=names.full_modules if full_step else (),
                histograms=observer.histograms if kind in observer.histogram_now else None,
                observe=self._observe,
            )
        finally:
            self.micro_step = saved_micro_step

    # -- what the captures are told --------------------------------------------------------

    def _nonfinite(self, stats: Any, tensor: torch.Tensor) -> bool:
        """Whether a recorded tensor holds a NaN or Inf, from its statistics where they are at
        hand (a CPU tensor's), else by a look of its own where that costs no host sync."""
        known = finite.nonfinite(stats, tensor, on_device=self._captures.device_checks)
        if known is not None:
            return known
        return isinstance(stats, Staged) and finite.check(tensor)

    def _queued(self, tensor: torch.Tensor) -> bool | None:
        """A tensor's non-finiteness from statistics already queued for it, if any."""
        cached = self._observer.lookup(tensor)
        return finite.nonfinite(cached[0], tensor) if cached is not None else None

    def _where_now(self, phase: str, call: int) -> dict[str, Any]:
        return {"step": self.current_step, "micro_step": self.micro_step, "phase": phase,
                "call": call}  # fmt: skip

    def _after_gradient(
        self, targets: list[Target], grad: torch.Tensor, stats: Any, *, looked: bool = False
    ) -> None:
        """Hand a gradient to the non-finite capture: from its queued ``stats``, or where none
        were made (``looked``: a gradient recorded from a compiled graph's tap) by a look of
        its own where that costs no wait for a device."""
        try:
            if looked:
                bad = (grad.is_cpu or self._captures.device_checks) and finite.check(grad)
            else:
                bad = self._nonfinite(stats, grad)
            where = self._where_now("train", targets[0][1]) if bad else {}
            self._captures.after_gradient(targets, grad, bad, where)
        except Exception as exc:  # a capture's failure is its own: the recording goes on
            where = self._where_now("train", targets[0][1])
            self._captures.failure(exc, f"the backward of {targets[0][0]!r}", where)


def call_spec(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
    """What replay needs to call ``module`` again as it was called (docs/FORMAT.md)."""
    spec = describe_call(args, kwargs)
    spec["training"] = module.training
    spec["grad_enabled"] = torch.is_grad_enabled()
    # dropout inside the module draws from here: replay restores it
    spec["cpu_rng_state"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
    return json.dumps(spec, separators=(",", ":"))


def _unseen() -> Any:
    """A tensor subclass's ``__torch_function__`` sees every attribute read and every
    operation on its tensors: within this, the recorder's do not reach it, so a script's
    subclass cannot tell it is recorded."""
    return torch._C.DisableTorchFunctionSubclass()
