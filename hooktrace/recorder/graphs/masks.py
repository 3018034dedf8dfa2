"""What a compiled forward keeps for its backward, where its values are summarised.

A value the recorder summarises in a graph is made real (the operator reads it from memory),
where plain inductor may fuse it away: a BatchNorm's output into the ReLU after it.
AOTAutograd's partitioner then finds those values made and keeps for the backward the
cheapest thing derived from them: the ReLU's bool mask (``relu <= 0``), and the ReLU's output
copied into the eager layout, where the graph unrecorded recomputes both in the backward
from what it keeps anyway. On the CPU, inductor's forward kernel stores that mask slowly
(``VecMask<float,1>::store(bool*)``): the recorded SmallCNN's first BatchNorm kernel took
12.9 ms a step against 1.4 (docs/PERFORMANCE.md).

:func:`tag_masks` tags, in the joint graph, each summarised value made by a pointwise
operator, and each comparison of a summarised value, to be recomputed in the backward
(``MUST_RECOMPUTE``, the tag selective activation checkpointing sets), as the partitioner
chooses for a BatchNorm and ReLU unrecorded (its docstring says which it leaves: the
script's own tags, values not float32 or float64 on the CPU, values made from an input the
graph changes in place). Only what the forward keeps for the backward changes. It runs in
the recorder's joint graph pass (:mod:`hooktrace.recorder.graphs.joint`).
"""

from __future__ import annotations

import torch
from torch import fx

_COMPARISONS = tuple(
    getattr(getattr(torch.ops.aten, name), overload)
    for name in ("le", "lt", "ge", "gt", "eq", "ne")
    for overload in ("Scalar", "Tensor")
)
"""The masks a backward may keep of a value: ReLU's is ``le(x, 0)``, hardtanh's ``le`` and
``ge``, a threshold's ``le``."""

_ALIASES = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


def tag_masks(graph: fx.Graph) -> int:
    """Tag each value that ``hooktrace::summarize`` reads and a pointwise operator made, and
    each comparison of such a value, to be recomputed in the backward; returns how many
    nodes were tagged. Left as they are: a node the script tagged itself (selective
    activation checkpointing), a value that is not float32 or float64 on the CPU (in a lower
    precision, or on a GPU's fused kernels, a value made again need not be the same bits as
    the one kept), and a value made from an input the graph changes in place (a buffer
    updated in the forward: made again in the backward, it would read the new contents)."""
    from torch.utils.checkpoint import CheckpointPolicy

    summarize = torch.ops.hooktrace.summarize.default
    values: list[fx.Node] = []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is summarize:
            value = node.args[0]
            while isinstance(value, fx.Node) and value.target in _ALIASES:
                value = value.args[0]
            if isinstance(value, fx.Node) and _exact_here(value):
                values.append(value)
    changed = made_from(graph, _changed_inputs(graph))
    tagged = 0
    for value in values:
        if value in changed:
            continue
        recompute = [user for user in value.users if user.target in _COMPARISONS]
        if _pointwise(value):  # made again as the graph unrecorded makes it, not kept
            recompute.append(value)
        for node in recompute:
            if node.meta.get("recompute") is None:
                node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                tagged += 1
    return tagged


def _exact_here(node: fx.Node) -> bool:
    """A float32 or float64 value on the CPU, whose kernels make it again the same bits
    (inductor's CPU code contracts no multiply-add)."""
    value = node.meta.get("val")
    return (
        isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and value.dtype in (torch.float32, torch.float64)
    )


def _changed_inputs(graph: fx.Graph) -> set[fx.Node]:
    """The graph's inputs it changes in place (copied into at the forward's end)."""
    return {
        node.args[0]
        for node in graph.nodes
        if node.op == "call_function"
        and node.target is torch.ops.aten.copy_.default
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "placeholder"
    }


def made_from(graph: fx.Graph, inputs: set[fx.Node]) -> set[fx.Node]:
    """The nodes made, however far back, from one of ``inputs`` (and those): one pass in the
    graph's order, where each node comes after what it reads."""
    made = set(inputs)
    if made:
        for node in graph.nodes:
            if any(source in made for source in node.all_input_nodes):
                made.add(node)
    return made


def _pointwise(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and torch.Tag.pointwise in getattr(target, "tags", ())
