"""Which modules a compiled graph's call ran, and which call of them each tapped gradient is.

A graph instrumented while compiling (:mod:`hooktrace.recorder.graphs`) names its module calls
by their path from a frame's module. When it runs, the frame's module is found from a
parameter the graph took (its anchor): one graph serves every block of a ``ModuleList``
compiled block by block, each block with its own parameters. A frame with no parameter is
found in the locals of the Python frame running the graph (a parameterless block compiled
on its own: its ``self``), or else named by the ids the graph was traced with. Both are
remembered per graph and the modules found.

Gradients come back through the graph's taps in the backward, each tap once per call of the
graph that reached it: a tap's calls are answered last first, as the backward runs them.

A module whose hooks run outside the graph (a compiled root: dynamo runs its hooks, then
compiles its forward; a block compiled on its own) records the gradient of what it returns
from the tap the tensor left the graph through, where it did: the graph's own uses of the
value (``return logits, F.cross_entropy(logits, y)``) add to its gradient there, never in a
hook on the tensor the graph returns.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hooktrace.recorder.graphs.backend import read_source
from hooktrace.recorder.graphs.plan import Plan
from hooktrace.recorder.hooks.attach import Attached, ModuleTable
from hooktrace.recorder.hooks.calls import Target
from hooktrace.recorder.hooks.names import Names, unwrap

Expected = tuple[list[Target], torch.dtype, tuple[int, ...]]
"""Where a tap's gradient is recorded, and the dtype and shape of the value it reached."""

_KEEP = 4096
"""Module lists remembered, by graph and anchors, at most (forgotten all at once)."""


class CompiledCalls:
    """The recorder's view of instrumented graphs: their module names, their taps."""

    def __init__(self, names: Names, table: ModuleTable) -> None:
        self._names = names
        self._table = table
        self._modules: dict[tuple[int, tuple[int, ...]], list[Attached | None]] = {}
        # by parameter id: the recorded models holding it, and its path in each
        self._owners: dict[int, list[tuple[torch.nn.Module, str]]] = {}
        self._taps: dict[int, list[Expected]] = {}
        self.kept: dict[int, torch.Tensor] = {}  # gradients handed on in full, by tap
        self.delivered = 0  # graph runs recorded
        self._delivered_before = 0  # ... when the current root call began
        self.inside_eagerly = False  # a module inside the root's call recorded by its hooks
        # in a root's call, by id: a tensor a graph returned through a tap, as it was
        # returned (its version), and where the tap's gradient is recorded
        self.tapped: dict[int, tuple[weakref.ref[torch.Tensor], int, list[Target]]] = {}
        # a recording that finds its models (hooktrace record's): takes a module met in a
        # graph's frame as a model, where it has not met it; whether it did
        self.finder: Callable[[torch.nn.Module], bool] | None = None
        self._warned = False

    def entering(self) -> None:
        """A root's call begins."""
        self._delivered_before = self.delivered
        self.inside_eagerly = False
        self.tapped.clear()

    def left(self) -> None:
        """A root's call ended: what its graphs returned is no longer returned by a module
        inside it."""
        self.tapped.clear()

    def returned(
        self,
        sites: Sequence[tuple[int, int]],
        outputs: Sequence[Any],
        taps: dict[int, Expected],
    ) -> None:
        """A graph run in a root's call returned ``outputs``, those at ``sites`` through a
        tap: where the hooks of a module that returns one of them record its gradient
        (:meth:`through_tap`). ``taps``: the run's taps expected so far, by site; a tap no
        module inside it recorded is expected here, with no target yet."""
        for index, tap in sites:
            tensor = outputs[index] if index < len(outputs) else None
            if not isinstance(tensor, torch.Tensor):
                continue
            expected = taps.get(tap)
            if expected is None:
                expected = taps[tap] = ([], tensor.dtype, tuple(tensor.shape))
                self.expect(tap, expected)
            self.tapped[id(tensor)] = (weakref.ref(tensor), tensor._version, expected[0])

    def through_tap(self, tensor: torch.Tensor, target: Target) -> bool:
        """Whether ``tensor`` left a graph of this root's call through a tap, unchanged since:
        its gradient is then recorded as ``target`` too, from the tap."""
        found = self.tapped.get(id(tensor))
        if found is None or found[0]() is not tensor or found[1] != tensor._version:
            return False
        found[2].append(target)
        return True

    def unseen(self, root: torch.nn.Module) -> bool:
        """Whether the root's call that ends now ran compiled graphs that were compiled
        before the recording began (dynamo keeps them, without statistics): it ran compiled,
        it has modules inside, and neither a graph of its call handed in records nor a
        module inside was recorded by its hooks (as where dynamo breaks the graph at each
        module, at FSDP2's hooks, and the modules' own forwards are compiled). Once a run."""
        if self._warned or self.delivered != self._delivered_before or self.inside_eagerly:
            return False
        compiled = type(root).__name__ == "OptimizedModule" or (
            root.__dict__.get("_compiled_call_impl") is not None
        )
        inner, _ = unwrap(root)
        if not compiled or next(iter(inner.children()), None) is None:
            return False
        self._warned = True
        return True

    def modules(self, plan: Plan, args: tuple[Any, ...]) -> list[Attached | None]:
        """The table's entry of each module call of ``plan`` in this run (None: a module
        not recorded)."""
        held = _held(plan) if plan.unanchored else ()
        anchors = tuple(id(args[index]) for index, _ in plan.anchors.values())
        key = (id(plan), anchors + tuple(id(module) for module in held))
        found = self._modules.get(key)
        if found is None:
            if len(self._modules) >= _KEEP:
                self._modules.clear()
            found = self._modules[key] = self._resolve(plan, args, held)
        return found

    def renamed(self) -> None:
        """Modules were named again (a model restructured): names found are stale."""
        self._modules.clear()
        self._owners.clear()

    def _resolve(
        self, plan: Plan, args: tuple[Any, ...], held: tuple[Any, ...]
    ) -> list[Attached | None]:
        frames: dict[str, tuple[torch.nn.Module | None, str | None]] = {}
        for frame, (index, parameter) in plan.anchors.items():
            found = self._frame_module(args[index], parameter)
            if found == (None, "") and self.finder is not None and self._found(plan, frame):
                found = self._frame_module(args[index], parameter)
            frames[frame] = found
        for frame, module in zip(plan.unanchored, held, strict=True):
            if isinstance(module, torch.nn.Module):
                frames[frame] = (unwrap(module)[0], "")
        entries: list[Attached | None] = []
        for call in plan.calls:
            if call.watched:  # hooktrace.watch's name, whoever runs the graph
                entries.append(Attached(None, call.watched, channels_first=False, root=False))
                continue
            frame_module, above = frames.get(call.frame, (None, None))
            path = _below(call.path, above) if above else call.path
            if above is None or path is None:  # a frame not found running, or a call beside
                entries.append(self._table.by_id(call.traced_id))  # the model: as traced
                continue
            module = None
            if frame_module is not None:  # (None: a model not recorded runs this graph)
                try:
                    module = frame_module.get_submodule(path) if path else frame_module
                except AttributeError:
                    module = None
            entries.append(self._table.get(module) if module is not None else None)
        return entries

    def _found(self, plan: Plan, frame: str) -> bool:
        """Whether the module at ``frame`` (``L['model']``), read in the Python frame running
        the graph, is one the ``finder`` took as a model now: a second model of the first
        one's class, running the graph compiled for it (two models passed in turn to one
        compiled function), met nowhere else."""
        running = _running(plan.code)
        if running is None or self.finder is None:
            return False
        try:
            module = read_source(frame, {"L": running.f_locals, "G": running.f_globals})
        except Exception:  # (a frame that does not read so: not found)
            return False
        if not isinstance(module, torch.nn.Module) or not self.finder(module):
            return False
        self._owners.clear()  # the new model's parameters are owned now
        return True

    def _frame_module(self, parameter: Any, path: str) -> tuple[torch.nn.Module | None, str | None]:
        """The module whose parameter ``parameter`` is at ``path`` from the frame, and ""; or
        where the frame is above the model that holds it (a method of a trainer that holds
        ``self.model``: the path ``model.fc.weight``), the model and its path from the
        frame (``model``). (None, ""): no recorded model holds it (a model not recorded
        runs the graph); (None, None): recorded models hold it in more than one place that
        fits the path (a module two models share): the frame's calls are taken as traced."""
        owners = self._owners.get(id(parameter))
        if owners is None:
            for root in self._names.roots.values():
                inner, _ = unwrap(root)
                for qualname, param in inner.named_parameters(remove_duplicate=False):
                    self._owners.setdefault(id(param), []).append((inner, qualname))
            owners = self._owners.get(id(parameter))
        if owners is None:
            return None, ""
        found: dict[tuple[int, str], torch.nn.Module] = {}  # several: tied, or shared
        for inner, qualname in owners:
            if qualname == path or qualname.endswith("." + path):
                prefix = qualname[: len(qualname) - len(path)].rstrip(".")
                with contextlib.suppress(AttributeError):
                    module = inner.get_submodule(prefix) if prefix else inner
                    found[(id(module), "")] = module
        if not found:
            for inner, qualname in owners:
                if path.endswith("." + qualname):
                    found[(id(inner), path[: len(path) - len(qualname) - 1])] = inner
        if len(found) > 1:
            return None, None
        return next(((module, above) for (_, above), module in found.items()), (None, ""))

    def expect(self, tap: int, expected: Expected) -> None:
        """A call of a graph reached ``tap``: its gradient is recorded as ``expected`` says."""
        self._taps.setdefault(tap, []).append(expected)

    def arrived(self, tap: int) -> Expected | None:
        """Where the gradient that reached ``tap`` now is recorded (None: nowhere)."""
        waiting = self._taps.get(tap)
        return waiting.pop() if waiting else None

    def backward_done(self) -> None:
        self._taps.clear()
        self.kept.clear()


def _below(path: str, above: str) -> str | None:
    """``path`` from the model at ``above`` (``model.fc`` from ``model``: ``fc``; ``model``
    itself: ""), or None where it is not inside it."""
    if path == above:
        return ""
    return path[len(above) + 1 :] if path.startswith(above + ".") else None


_LOCAL = re.compile(r"L\['(\w+)'\]")
"""A frame's source name that is a local variable of the compiled Python frame."""

_MOST_FRAMES = 64
"""Python frames looked through, at most, from the recorder up to the one running a graph."""


@functools.lru_cache(maxsize=256)
def _local_name(source: str) -> str:
    """The local variable a frame's source name is (``L['self']``: ``self``); "" for any
    other source."""
    match = _LOCAL.fullmatch(source)
    return match.group(1) if match else ""


def _held(plan: Plan) -> tuple[Any, ...]:
    """What the frames of ``plan`` that take no parameter hold (``L['self']``: the module
    compiled on its own), read from the locals of the Python frame running the graph: the
    nearest caller running ``plan.code``. None for each where it is not found."""
    frame = _running(plan.code)
    if frame is None:
        return (None,) * len(plan.unanchored)
    local = frame.f_locals
    return tuple(local.get(_local_name(source)) for source in plan.unanchored)


def _running(code: types.CodeType | None) -> types.FrameType | None:
    """The nearest Python frame running ``code`` (the frame dynamo compiled, which runs its
    graph), within ``_MOST_FRAMES`` callers; None where there is none."""
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(_MOST_FRAMES):
        if frame is None or code is None:
            return None
        running = frame.f_code
        if running is code or (
            running.co_name == code.co_name
            and running.co_filename == code.co_filename
            and running.co_firstlineno == code.co_firstlineno
        ):
            return frame
        frame = frame.f_back
    return None
