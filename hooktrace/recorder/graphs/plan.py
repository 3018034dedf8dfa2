"""Where the module calls of a graph that dynamo captured return, and what is added to it.

Dynamo tags each node of the graph it captures with ``nn_module_stack``: the module calls the
node ran inside, outermost first, each keyed by the module's id (``"140…"``, ``"140…@1"`` for
its second call in the graph) with its path from the compiled frame (``"L['self'].blocks.0.fc"``).
A module call's outputs are its nodes that a node outside the call uses, or that the graph
returns. Each such node is summarised in the graph (:mod:`hooktrace.recorder.graphs.ops`):
its statistics become one row of an extra output of the graph, its per-unit activity a span
of a second one, and its gradient is caught by a tap whose backward summarises it.

Which module ran is settled when the graph runs, not here: one graph serves every block of a
``ModuleList`` compiled block by block. Each frame's modules are found at run time from a
parameter the graph takes (its *anchor*): the parameter's name in the recorded model, less
its path from the frame, is the frame's module. A frame with no parameter falls back on the
ids the graph was traced with.

What a graph cannot say is left out, and the plan says why (:attr:`Plan.notes`): a module
that returns its input unchanged has no node; a tuple's outputs are numbered in the order
their nodes were made, which may differ from the tuple's order.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from hooktrace.recorder.graphs import ops

_CHANNELS_FIRST = (
    torch.nn.modules.conv._ConvNd,
    torch.nn.modules.batchnorm._BatchNorm,
    torch.nn.modules.instancenorm._InstanceNorm,
    torch.nn.modules.pooling._MaxPoolNd,
    torch.nn.modules.pooling._AvgPoolNd,
)
"""Modules whose 3-D outputs are (N, C, L): their units are channels (``stats.unit_dim``)."""

_SEGMENT = re.compile(r"\._modules\['([^']*)'\]|\._parameters\['([^']*)'\]|\.(\w+)|\[(\d+)\]")
"""One step of a dynamo source's name: a submodule, a parameter, an attribute, an index."""

_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv}


@dataclass(frozen=True)
class Output:
    """One output of a module call: its slot, its row of the statistics, its span of the
    counts (None: no units counted), its tap (None: its gradient is not caught)."""

    slot: str
    row: int
    counts: tuple[int, int] | None
    tap: int | None
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Call:
    """One module call in the graph: the frame it ran under, its path from that frame's
    module, the id of the module traced, and its outputs."""

    frame: str
    path: str
    traced_id: int
    outputs: tuple[Output, ...]


@dataclass
class Plan:
    """What was added to one graph: the graph's own outputs come first (``returns`` of
    them), then the statistics (one row per output summarised) and, where any units are
    counted, the counts."""

    returns: int
    calls: list[Call]
    anchors: dict[str, tuple[int, str]]  # frame -> (placeholder index, parameter path)
    taps: int
    has_counts: bool
    notes: list[str] = field(default_factory=list)


def instrument(gm: fx.GraphModule, *, max_units: int, new_tap: Callable[[], int]) -> Plan | None:
    """Add the statistics of every module call's outputs to ``gm`` (in place), and taps on
    their gradients where the graph trains. None where the graph holds no module call."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    calls = _module_calls(graph)
    if not calls:
        return None
    output_node = next(n for n in graph.nodes if n.op == "output")
    returns = output_node.args[0]
    training = torch.is_grad_enabled() and any(
        isinstance(v := p.meta.get("example_value"), torch.Tensor) and v.requires_grad
        for p in placeholders
    )
    rows: list[fx.Node] = []
    count_nodes: list[fx.Node] = []
    counted = 0
    made: dict[fx.Node, tuple[int, tuple[int, int] | None, int | None]] = {}
    channel_shapes: set[tuple[int, ...]] = set()
    planned: list[Call] = []
    notes: list[str] = []
    positions = {node: i for i, node in enumerate(graph.nodes)}
    order: list[tuple[int, int]] = []  # calls as eager records them: inner ones return first
    for key, (path, module_type, depth, nodes) in calls.items():
        outputs = []
        escaping = _escaping(nodes, key, output_node)
        for slot, node in escaping:
            value: torch.Tensor = node.meta["example_value"]  # a tensor (_escaping)
            shape = tuple(value.shape)
            if not all(isinstance(d, int) for d in shape):
                notes.append(f"{path}: dynamic shape, not summarised in the graph")
                continue
            if issubclass(module_type, _CHANNELS_FIRST) and len(shape) == 3:
                channel_shapes.add(shape)
            if node not in made:
                with graph.inserting_after(node):
                    summary = graph.call_function(ops.summary, (node,))
                rows.append(summary)
                span = None
                dim = ops.unit_dim(shape, channels_first=shape in channel_shapes)
                if value.is_floating_point() and dim is not None and 0 < shape[dim] <= max_units:
                    with graph.inserting_after(summary):
                        counts = graph.call_function(ops.activity, (node, dim))
                    count_nodes.append(counts)
                    span = (counted, counted + shape[dim])
                    counted += shape[dim]
                tap = None
                if training and value.requires_grad and not _mutated(node):
                    tap = new_tap()
                    anchor = summary if span is None else count_nodes[-1]
                    returned = output_node in node.users
                    with graph.inserting_after(anchor):
                        tapped = graph.call_function(ops.tap, (node, tap, returned))
                    for user in list(node.users):
                        if user not in (summary, tapped) and user.target is not ops.activity:
                            user.replace_input_with(node, tapped)
                made[node] = (len(rows) - 1, span, tap)
            row, span, tap = made[node]
            outputs.append(Output(slot, row, span, tap, value.dtype, shape))
        if outputs:
            traced_id = int(key.split("@")[0])
            frame, relative = _split_path(path)
            planned.append(Call(frame, relative, traced_id, tuple(outputs)))
            last = max(positions[node] for _, node in escaping)
            order.append((last, -depth))
    if not rows:
        return None
    with graph.inserting_before(output_node):
        extra = [graph.call_function(torch.stack, (rows,))]
        if count_nodes:
            extra.append(graph.call_function(torch.cat, (count_nodes,)))
    output_node.args = (tuple(output_node.args[0]) + tuple(extra),)  # taps' in place now
    graph.lint()
    gm.recompile()
    taps = sum(1 for c in planned for o in c.outputs if o.tap is not None)
    ranked = sorted(range(len(planned)), key=order.__getitem__)
    return Plan(
        returns=len(returns),
        calls=[planned[i] for i in ranked],
        anchors=_anchors(placeholders, {c.frame for c in planned}),
        taps=taps,
        has_counts=bool(count_nodes),
        notes=notes,
    )


def _module_calls(graph: fx.Graph) -> dict[str, tuple[str, type, int, list[fx.Node]]]:
    """Each module call in the graph (by its ``nn_module_stack`` key, in the order of its
    first node): its path, its module's type, its depth, and its nodes, nested calls'
    included."""
    calls: dict[str, tuple[str, type, int, list[fx.Node]]] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        stack = node.meta.get("nn_module_stack") or {}
        for depth, (key, (path, module_type)) in enumerate(stack.items()):
            if key not in calls:
                calls[key] = (path, module_type, depth, [])
            calls[key][3].append(node)
    return calls


def _escaping(nodes: list[fx.Node], key: str, output_node: fx.Node) -> list[tuple[str, fx.Node]]:
    """The call's tensor nodes used outside it, slotted ``0``, ``1``, ... in the order made."""
    escaping = []
    for node in nodes:
        if not isinstance(node.meta.get("example_value"), torch.Tensor):
            continue
        for user in node.users:
            if user is output_node or key not in (user.meta.get("nn_module_stack") or {}):
                escaping.append(node)
                break
    return [(str(i), node) for i, node in enumerate(escaping)]


def _mutated(node: fx.Node) -> bool:
    """Whether a later node changes ``node`` in place: a tap's output may not be."""
    for user in node.users:
        target: Any = user.target
        if target in _IN_PLACE:
            return True
        name = target if isinstance(target, str) else getattr(target, "__name__", "")
        if name.endswith("_") and not name.endswith("__"):
            return True
    return False


def _split_path(path: str) -> tuple[str, str]:
    """``"L['self'].blocks.0.fc"`` -> ``("L['self']", "blocks.0.fc")``."""
    end = path.find("]")
    if end < 0:
        return path, ""
    return path[: end + 1], path[end + 2 :]


def _anchors(placeholders: list[fx.Node], frames: set[str]) -> dict[str, tuple[int, str]]:
    """For each frame, a placeholder that takes one of its module's parameters, and that
    parameter's path from the module (``"blocks.0.fc.weight"``)."""
    anchors: dict[str, tuple[int, str]] = {}
    for index, node in enumerate(placeholders):
        name = getattr(getattr(node, "_dynamo_source", None), "name", None)
        if callable(name):  # a method in older torch, a property in newer
            name = name()
        if not isinstance(name, str):
            continue
        frame, rest = _split_source(name)
        if frame not in frames or frame in anchors or rest is None:
            continue
        anchors[frame] = (index, rest)
    return anchors


def _split_source(name: str) -> tuple[str, str | None]:
    """A parameter's source name as (frame, dotted path from the frame's module); None for
    a source that is no parameter reached through modules."""
    end = name.find("]")
    if end < 0:
        return name, None
    frame, rest = name[: end + 1], name[end + 1 :]
    parts: list[str] = []
    position = 0
    is_parameter = False
    for match in _SEGMENT.finditer(rest):
        if match.start() != position:
            return frame, None
        position = match.end()
        module, parameter, attribute, index = match.groups()
        is_parameter = parameter is not None
        parts.append(next(p for p in (module, parameter, attribute, index) if p is not None))
    if position != len(rest) or not is_parameter:
        return frame, None
    return frame, ".".join(parts)
