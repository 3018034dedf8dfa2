"""Which operators of a joint graph draw from a generator (graphs/draws.py)."""

from __future__ import annotations

import torch
import torch._inductor.inductor_prims  # registers inductor's seeds (prims.inductor_seeds)
from torch import fx

from hooktrace.recorder.graphs.draws import count_draws

aten = torch.ops.aten


def _graph(*calls: tuple[object, tuple[object, ...], dict[str, object]]) -> fx.Graph:
    graph = fx.Graph()
    q = graph.placeholder("q")
    for target, args, kwargs in calls:
        graph.call_function(target, (q, *args), kwargs)  # type: ignore[arg-type]
    return graph


def test_each_seeded_operator_is_a_draw_and_an_attention_without_dropout_is_none() -> None:
    attention = aten._scaled_dot_product_flash_attention_for_cpu.default
    assert count_draws(_graph((attention, (torch.ones(1), torch.ones(1)), {}))) == 0  # dropout_p 0
    assert count_draws(_graph((attention, (torch.ones(1), torch.ones(1), 0.0), {}))) == 0
    assert count_draws(_graph((attention, (torch.ones(1), torch.ones(1), 0.1), {}))) == 1
    assert count_draws(_graph((attention, (torch.ones(1), torch.ones(1)), {"dropout_p": 0.1}))) == 1
    assert (
        count_draws(_graph((aten.multinomial.default, (1,), {}), (aten.add.Tensor, (1,), {}))) == 1
    )
    seeds = torch.ops.prims.inductor_seeds.default
    both = _graph((seeds, (), {}), (aten.bernoulli.default, (), {}))
    assert count_draws(both) == 2


def test_what_the_backward_of_a_joint_graph_computes_is_no_draw() -> None:
    graph = fx.Graph()
    q, grad = graph.placeholder("q"), graph.placeholder("tangents_1")
    backward = aten._scaled_dot_product_efficient_attention_backward.default  # tagged
    graph.call_function(aten.multinomial.default, (q, 1))
    graph.call_function(backward, (grad, q, q, q, None, q, q, q, q, 0.1, [True, True, True, False]))
    assert count_draws(graph) == 1
