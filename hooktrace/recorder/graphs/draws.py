"""The order a compiled forward draws its random numbers in, kept as the graph unrecorded
draws them.

Inductor seeds its own random operators (dropout's masks) from one draw of the generator
(``inductor_seeds``); an operator it leaves to torch draws at its own place in the program:
attention with dropout on a GPU, ``multinomial``, ``randperm``, any random operator under
``fallback_random``. Its scheduler, to lower peak memory (``reorder_for_peak_memory``), may
run a draw before another it does not depend on: it does not see that they share the
generator (pytorch/pytorch#192635). The recorder's statistics change what the graph holds in
memory, so the scheduler can choose another order for the recorded graph than for the same
graph unrecorded. Each draw then gets other numbers and the training other masks: on an H200,
TinyTransformer's loss at step 0 was 2.4128 recorded against 2.4193, the seeds drawn before
attention's dropout instead of after it (``benchmarks/gpu_check.py``).

:func:`keep_draw_order` switches that reordering off for a forward that draws twice or more:
its draws then run in the graph's order, which is the order of the graph unrecorded before its
scheduler. Where the scheduler moves the draws of the graph unrecorded, the recorded one still
draws in another order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx


def draws(graph: fx.Graph) -> int:
    """How many times the graph draws from a generator: each operator tagged
    ``nondeterministic_seeded`` (inductor's seeds for all its own random operators are one),
    but an attention whose dropout is 0."""
    return sum(
        1
        for node in graph.nodes
        if node.op == "call_function"
        and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        and _argument(node, "dropout_p", 1.0) != 0
    )


def keep_draw_order(graph: fx.Graph) -> bool:
    """Where ``graph`` (a joint graph inductor is compiling) draws twice or more, have its
    forward's scheduler keep the graph's order (``reorder_for_peak_memory`` off for the rest of
    this compile: the caller's ``config.patch`` restores it); returns whether it did."""
    if draws(graph) < 2:
        return False
    from torch._inductor import config

    config.reorder_for_peak_memory = False
    return True


def _argument(node: fx.Node, name: str, default: Any) -> Any:
    """The value ``node`` passes for its operator's argument ``name``, or ``default`` where the
    operator has none of that name or the call leaves it to its default."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for index, argument in enumerate(schema.arguments):
        if argument.name != name:
            continue
        if name in node.kwargs:
            return node.kwargs[name]
        if index < len(node.args) and not argument.kwarg_only:
            return node.args[index]
        return argument.default_value if argument.has_default_value() else default
    return default
