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
draws in another order; so it does where another reordering moves them (the CUDA graphs'
partitions under ``mode="reduce-overhead"``) or where the script's own ``options`` set
``reorder_for_peak_memory``, which inductor applies over this.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.operator_schemas import normalize_function

from hooktrace.recorder.graphs.masks import made_from


def count_draws(graph: fx.Graph) -> int:
    """How many times the forward of a joint graph draws from a generator: each operator
    tagged ``nondeterministic_seeded`` (inductor's seeds for all its own random operators are
    one). Not counted: an attention whose dropout is 0, and what the backward computes (made
    from the gradients coming in, the ``tangents``: an attention's backward is tagged, and
    draws nothing)."""
    tangents = {
        node for node in graph.nodes if node.op == "placeholder" and "tangents" in node.name
    }
    backward = made_from(graph, tangents)
    return sum(
        1
        for node in graph.nodes
        if node.op == "call_function"
        and node not in backward
        and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
        and _dropout(node) != 0
    )


def keep_draw_order(graph: fx.Graph) -> bool:
    """Where the forward of ``graph`` (a joint graph inductor is compiling) draws twice or
    more, have the scheduler keep the graph's order: ``reorder_for_peak_memory`` off for the
    rest of this compile (the forward's, and a backward compiled with it rather than at its
    first call), which the caller's ``config.patch`` puts back after; returns whether it
    did."""
    from torch._inductor import config

    if count_draws(graph) < 2 or not getattr(config, "reorder_for_peak_memory", False):
        return False
    config.reorder_for_peak_memory = False
    return True


def _dropout(node: fx.Node) -> Any:
    """The ``dropout_p`` the call passes, its operator's default where it passes none; 1 for
    an operator without one, or a call torch cannot match to its schema."""
    target = node.target
    if not callable(target):
        return 1.0
    call = normalize_function(target, node.args, node.kwargs, normalize_to_only_use_kwargs=True)
    return 1.0 if call is None else call.kwargs.get("dropout_p", 1.0)
