"""Which summarised values a joint graph makes again in the backward (graphs/masks.py)."""

from __future__ import annotations

import torch
from torch import fx
from torch.utils.checkpoint import CheckpointPolicy

import hooktrace.recorder.graphs.ops  # noqa: F401 (registers hooktrace::summarize)
from hooktrace.recorder.graphs.masks import tag_masks

aten = torch.ops.aten


def _call(graph: fx.Graph, target: object, *args: object) -> fx.Node:
    node = graph.call_function(target, args)  # type: ignore[arg-type]
    node.meta["val"] = torch.empty(2)  # a float32 value on the CPU
    return node


def test_values_made_from_an_input_changed_in_place_are_kept_and_the_others_made_again() -> None:
    graph = fx.Graph()
    x, counter = graph.placeholder("x"), graph.placeholder("counter")
    counted = _call(graph, aten.add.Tensor, counter, 1)
    _call(graph, aten.copy_.default, counter, counted)  # the buffer, updated in the forward
    scaled = _call(graph, aten.div.Tensor, x, counted)  # made from it, two steps on
    relu = _call(graph, aten.relu.default, x)
    mask = _call(graph, aten.le.Scalar, relu, 0)
    for value in (scaled, relu):
        _call(graph, torch.ops.hooktrace.summarize.default, value, 1)
    assert tag_masks(graph) == 2
    assert relu.meta["recompute"] == mask.meta["recompute"] == CheckpointPolicy.MUST_RECOMPUTE
    assert "recompute" not in scaled.meta
