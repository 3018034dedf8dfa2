"""Graphs compiled while recording are compiled with their statistics in them.

Dynamo hands every graph it captures to the script's backend (inductor, aot_eager, eager, or
the script's own) in ``OutputGraph.call_user_compiler``. While a recording is on, that method
is wrapped (:func:`wrap_call_user_compiler`): the graph gets its module calls' statistics
(:func:`hooktrace.recorder.graphs.plan.instrument`), the script's backend compiles it, and the
callable dynamo runs is wrapped in one that hands the extra outputs to the recorder and
returns the graph's own. The backend, its mode and options, the graph count and the guards
stay the script's: nothing recompiles, nothing breaks the graph. Where the backend is
inductor, its joint graph goes through the recorder's pass
(:mod:`hooktrace.recorder.graphs.joint`): the forward keeps for the backward what it keeps
unrecorded, and draws its random numbers in the same order (where that compile fails, the
graph is compiled without it).

Where some steps go unrecorded, the graph is compiled twice, with and without its
statistics, and each step runs the one it needs (no recompile per step). Where some steps
save tensors whole (``full_every``, ``full_steps``) or histogram the kinds a graph records
(``histograms=("output", ...)``), once more, returning the values it summarises and
handing on their gradients: those steps run that one.

Where the instrumented graph cannot be compiled, the graph is put back as it was and
compiled as the script asked (the recorder says so once): the script's compile never fails
because of hooktrace.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import fx

from hooktrace.recorder.graphs import ops
from hooktrace.recorder.graphs.joint import joint_pass, joint_pass_available
from hooktrace.recorder.graphs.plan import Plan, copy_graph, instrument, strip_marks


class Receiver(Protocol):
    """The recorder, as the graphs see it."""

    max_units: int
    finds_models: bool  # the models a compiled function calls are found as it compiles

    @property
    def skips_steps(self) -> bool:
        """Some steps go unrecorded: graphs are compiled without statistics too."""

    @property
    def recording_graphs(self) -> bool:
        """The step running is recorded."""

    @property
    def saves_full(self) -> bool:
        """Some steps need the values inside graphs (tensors saved whole, histograms of
        outputs): graphs are compiled to return them too."""

    @property
    def full_graphs(self) -> bool:
        """The step running needs the values inside graphs."""

    def graph_ran(
        self,
        plan: Plan,
        args: tuple[Any, ...],
        extras: Sequence[torch.Tensor],
        returned: Sequence[Any] = (),
    ) -> None:
        """An instrumented graph ran: ``extras`` are its statistics and counts, ``returned``
        its own outputs."""

    def graph_begins(self, plan: Plan, args: tuple[Any, ...]) -> None:
        """An instrumented graph is about to run."""

    def graph_ran_unrecorded(self, plan: Plan, args: tuple[Any, ...]) -> None:
        """An instrumented graph ran without its statistics (a step not recorded)."""

    def graph_gradient(self, site: int, row: torch.Tensor) -> None:
        """A tap's gradient summary arrived (in the backward)."""

    def records_module(self, module_id: int) -> bool:
        """Whether the module with this id is recorded."""

    def graph_calls(self, modules: Sequence[Any]) -> None:
        """A graph being compiled calls ``modules`` outside any module of its own (the models
        a compiled function calls), where ``finds_models``: those it has not met are taken
        as models before their graph is instrumented."""

    def graph_regions_unopened(self, paths: list[str]) -> None:
        """The modules at ``paths`` run inside a region of a graph that is not opened
        (``torch.cond``'s branches): not recorded there."""

    def records_alike(self, module: Any) -> bool:
        """Whether ``module`` is not recorded but a module of its type is."""

    def runs_recorded(self, plan: Plan, args: tuple[Any, ...]) -> bool:
        """Whether this run of a graph is a recorded module's."""

    def graph_failed(self, exc: BaseException, what: str) -> None:
        """Instrumenting a graph failed: it is compiled as it was."""

    def graph_values_failed(self, exc: BaseException) -> None:
        """Compiling a graph that returns its values failed: its full steps record the
        statistics of the modules inside, not their tensors."""

    def graph_kept(self, site: int, value: torch.Tensor) -> None:
        """A tap handed on its gradient in full (before its row, ``graph_gradient``)."""

    def graph_left_out(self, path: str) -> None:
        """A module's output inside a graph is not recorded, nor its gradient (a DTensor of
        a dynamic shape: ``plan.instrument``)."""


_receiver: list[Receiver | None] = [None]
_taps = [0]


def receive(receiver: Receiver | None) -> None:
    """Send what instrumented graphs produce to ``receiver`` (None: to nobody)."""
    _receiver[0] = receiver
    if receiver is None:
        ops.set_sink(None)
    else:
        ops.set_sink(receiver.graph_gradient, receiver.graph_kept)


def _new_tap() -> int:
    _taps[0] += 1
    return _taps[0]


def wrap_call_user_compiler(original: Callable[..., Any]) -> Callable[..., Any]:
    """The wrap of ``OutputGraph.call_user_compiler``: while a receiver is set, the graph is
    instrumented before the script's backend compiles it."""

    def call_user_compiler(self: Any, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        receiver = _receiver[0]
        if receiver is None:
            return original(self, gm, example_inputs)
        backend = self.compiler_fn
        if receiver.finds_models:
            try:
                called = _outermost_modules(self, gm)
            except Exception:  # (dynamo's own attributes, changed): found by their calls alone
                called = []
            if called:
                receiver.graph_calls(called)
        self.compiler_fn = _Instrumenting(
            backend, receiver, alike=_alike(self, receiver), code=_frame_code(self)
        )
        try:
            return original(self, gm, example_inputs)
        finally:
            self.compiler_fn = backend

    return call_user_compiler


def _alike(output_graph: Any, receiver: Receiver) -> bool:
    """Whether the frame dynamo compiles holds a module that is not recorded but of a type
    a recorded module is (a second model of the same class, an EMA copy): dynamo checks a
    module's type, not which one it is, and may run the graph compiled for that one for a
    recorded one (:class:`_Instrumenting`)."""
    try:
        frame = output_graph.root_tx.f_locals  # (dynamo's own: where it lacks them, no)
        return any(receiver.records_alike(value) for value in list(frame.values()))
    except Exception:
        return False


def _outermost_modules(output_graph: Any, gm: fx.GraphModule) -> list[Any]:
    """The modules the graph calls outside any other of its modules, in the order it calls
    them: each found from its ``nn_module_stack`` path (``G['model']``, ``L['self'].model``)
    in the globals and locals of the frame dynamo compiles, and kept where it is the very
    module dynamo traced (its id). Where the frame is a module's own call (its forward
    compiled on its own, ``torch.compile(model.forward)``: the stack leaves it out, its
    paths name its children), that module. None where dynamo's own attributes are missing
    or a path does not read so."""
    root_tx = getattr(output_graph, "root_tx", None)
    names = {
        "L": getattr(root_tx, "f_locals", None),
        "G": getattr(root_tx, "f_globals", None),
    }
    if names["L"] is None or names["G"] is None:
        return []
    if _a_modules_call(root_tx):
        return [names["L"]["self"]]
    found: dict[int, Any] = {}
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        key, (path, _) = next(iter(stack.items()))
        try:  # an id, but for a module dynamo keeps as it is (its name: not found so)
            module_id = int(str(key).split("@")[0])
        except ValueError:
            continue
        if module_id in found or not isinstance(path, str):
            continue
        found[module_id] = None
        with contextlib.suppress(Exception):  # (a path that does not read so: not found)
            module = read_source(path, names)
            if id(module) == module_id and isinstance(module, torch.nn.Module):
                found[module_id] = module
    return [module for module in found.values() if module is not None]


def _a_modules_call(root_tx: Any) -> bool:
    """Whether the frame dynamo compiles is a module's own call: its ``forward``, or
    torch's call of it (``model.compile()`` compiles ``_call_impl``)."""
    owner = root_tx.f_locals.get("self")
    if not isinstance(owner, torch.nn.Module):
        return False
    code = root_tx.f_code
    forward = getattr(type(owner).forward, "__code__", None)
    return code is forward or code.co_name in ("_call_impl", "_wrapped_call_impl", "forward")


_PATH_BASE = re.compile(r"([LG])\['([^']*)'\]")
_PATH_PART = re.compile(r"\.(\w+)|\[(\d+)\]|\['([^']*)'\]")


def read_source(path: str, names: dict[str, Any]) -> Any:
    """The object at a path dynamo wrote for a module (``L['self'].model``,
    ``G['models']['enc']``, ``G['blocks'][0].fc``): a local or a global, then attributes,
    indices and keys, read as dynamo read them. LookupError for any other path."""
    base = _PATH_BASE.match(path)
    if base is None:
        raise LookupError(path)
    value = names[base.group(1)][base.group(2)]
    position = base.end()
    while position < len(path):
        part = _PATH_PART.match(path, position)
        if part is None:
            raise LookupError(path)
        attribute, index, key = part.groups()
        if attribute is not None:
            value = getattr(value, attribute)
        else:
            value = value[int(index) if index is not None else key]
        position = part.end()
    return value


def _frame_code(output_graph: Any) -> Any:
    """The code of the Python frame dynamo compiles (dynamo's own: where it lacks it, None):
    the frame runs the graph, and its locals hold the modules of a frame that takes no
    parameter (:class:`~hooktrace.recorder.hooks.compiled.CompiledCalls`)."""
    return getattr(getattr(output_graph, "root_tx", None), "f_code", None)


class _Instrumenting:
    """The script's backend, given the instrumented graph. A graph of a frame that holds a
    module ``alike`` a recorded one, and none recorded, is instrumented for every module
    call in it and compiled without statistics too: each run takes the variant its module
    needs (:meth:`Receiver.runs_recorded`), so a model that is not recorded still pays
    nothing, and a recorded one that dynamo gives its graph is recorded all the same."""

    def __init__(
        self, backend: Callable[..., Any], receiver: Receiver, *, alike: bool, code: Any = None
    ) -> None:
        self.backend = backend
        self.receiver = receiver
        self.alike = alike
        self.code = code
        self.every_call = False  # instrumented for every module call: a module alike
        self.__name__ = getattr(backend, "__name__", type(backend).__name__)

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        try:
            trial, plan = self._instrumented(gm, full=False)
            modules = plan is not None and not all(call.watched for call in plan.calls)
            if self.alike and not modules:  # every module call, for the recorded model
                self.every_call = True
                trial, plan = self._instrumented(gm, full=False)
        except Exception as exc:
            self.receiver.graph_failed(exc, "reading a compiled graph")
            return self._as_it_was(gm, example_inputs)
        if plan is None:  # no module recorded: the graph without its marks
            return self.backend(trial, example_inputs)
        try:
            compiled, plan = self._compiled(gm, trial, plan, example_inputs, full=False)
        except Exception as exc:
            if _dynamo_control(exc):  # dynamo's own signal: analyse again, skip the frame
                raise
            self.receiver.graph_failed(exc, "compiling a graph with its statistics")
            return self._as_it_was(gm, example_inputs)
        full = self._full(gm, example_inputs) if self.receiver.saves_full else None
        needs_plain = self.receiver.skips_steps or self.every_call
        plain = self._as_it_was(gm, example_inputs) if needs_plain else None
        return _Run(compiled, plan, plain, full, alike=self.every_call)

    def _compiled(
        self,
        gm: fx.GraphModule,
        trial: fx.GraphModule,
        plan: Plan,
        example_inputs: list[Any],
        *,
        full: bool,
    ) -> tuple[Any, Plan]:
        """``trial`` (``gm`` instrumented, by ``plan``) compiled by the script's backend,
        through the recorder's joint pass (:mod:`.joint`); where that fails, ``gm``
        instrumented again and compiled as the backend alone would (its random numbers may
        then be drawn in another order). Returns the compiled graph and its plan."""
        try:
            with joint_pass():
                return self.backend(trial, example_inputs), plan
        except Exception as exc:
            if _dynamo_control(exc) or not joint_pass_available():
                raise
        trial, again = self._instrumented(gm, full=full)
        return self.backend(trial, example_inputs), again

    def _instrumented(self, gm: fx.GraphModule, *, full: bool) -> tuple[fx.GraphModule, Any]:
        """A copy of ``gm``, instrumented, and its plan (None: nothing recorded in it)."""
        trial = fx.GraphModule(gm, copy_graph(gm.graph))
        for attribute in ("_param_name_to_source", "_source_to_user_stacks"):
            if hasattr(gm, attribute):
                setattr(trial, attribute, getattr(gm, attribute))
        plan = instrument(
            trial,
            max_units=self.receiver.max_units,
            new_tap=_new_tap,
            recorded=_every_module if self.every_call else self.receiver.records_module,
            left_out=self.receiver.graph_left_out,
            unopened=self.receiver.graph_regions_unopened,
            full=full,
        )
        if plan is not None:
            plan.code = self.code
        return trial, plan

    def _full(self, gm: fx.GraphModule, example_inputs: list[Any]) -> tuple[Any, Plan] | None:
        """The graph compiled for the steps that save tensors whole, and its plan; None
        where that fails (those steps then run the graph with statistics only)."""
        try:
            trial, plan = self._instrumented(gm, full=True)
            if plan is None:
                return None
            return self._compiled(gm, trial, plan, example_inputs, full=True)
        except Exception as exc:
            if _dynamo_control(exc):
                raise
            self.receiver.graph_values_failed(exc)
            return None

    def _as_it_was(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        """The graph compiled as the script's backend would have it: without the marks."""
        with contextlib.suppress(Exception):  # left in, they do nothing when they run
            strip_marks(gm)
        return self.backend(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:  # what dynamo asks of the backend
        return getattr(self.backend, name)


def _every_module(module_id: int) -> bool:
    return True


def _dynamo_control(exc: BaseException) -> bool:
    """Whether ``exc`` is how dynamo steers its own compile (a restart of the analysis, a
    frame to skip), which the backend's caller handles: not a failure."""
    from torch._dynamo import exc as dynamo_exc

    kinds = tuple(
        getattr(dynamo_exc, name)
        for name in ("RestartAnalysis", "SkipFrame", "ShortenTraceback")
        if isinstance(getattr(dynamo_exc, name, None), type)
    )
    return isinstance(exc, kinds)


class _Run:
    """What dynamo calls for an instrumented graph: the compiled graph, its extra outputs
    handed to the recorder. Where steps go unrecorded (``every``, ``steps``), the graph
    compiled without statistics (``plain``) runs in them: they do not pay for statistics;
    where steps save tensors whole, the graph compiled to return its values (``full``: it
    and its plan) runs in those. A graph compiled for a module ``alike`` a recorded one runs
    ``plain`` but for a recorded module."""

    __slots__ = ("alike", "compiled", "full", "plain", "plan", "returns")

    def __init__(
        self,
        compiled: Callable[..., Any],
        plan: Plan,
        plain: Callable[..., Any] | None,
        full: tuple[Callable[..., Any], Plan] | None = None,
        *,
        alike: bool = False,
    ) -> None:
        self.compiled = compiled
        self.plain = plain
        self.plan = plan
        self.full = full
        self.returns = plan.returns
        self.alike = alike

    def __call__(self, *args: Any) -> Any:
        receiver = _receiver[0]
        if receiver is not None:
            receiver.graph_begins(self.plan, args)
        if self.plain is not None and (
            receiver is None
            or not receiver.recording_graphs
            or (self.alike and not receiver.runs_recorded(self.plan, args))
        ):
            if receiver is not None and not receiver.recording_graphs:
                receiver.graph_ran_unrecorded(self.plan, args)
            return self.plain(*args)
        compiled, plan = self.compiled, self.plan
        if self.full is not None and receiver is not None and receiver.full_graphs:
            compiled, plan = self.full
        outputs = compiled(*args)
        receiver = _receiver[0]
        if receiver is not None:
            receiver.graph_ran(plan, args, outputs[self.returns :], outputs[: self.returns])
        return outputs[: self.returns]
