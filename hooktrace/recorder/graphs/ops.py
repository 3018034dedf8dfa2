"""What hooktrace adds to a compiled graph: statistics, per-unit counts and gradient taps.

A module's value is summarised by :func:`summarize`, an operator the graph calls, which takes
the hooks' own route (the one-pass kernel on the CPU, the Triton kernels on a GPU): one
float64 row of the statistics, and the per-unit counts. The compiler calls it; it does not
generate its code, so the model's own kernels stay those of the graph unrecorded. Compiled
into the graph instead (:data:`FUSED`, :func:`summary` and ``stats.activity``, tensor
operations inductor fuses with the model's kernels), the statistics' reductions changed
the model's: on a GPU, the recorded CNN trained differently in the last bits (its batch
norm's reduction fused with the per-channel counts, gpu_check 2026-11-29). Both read a
detached value, so the model's computation and its gradients do not change.

Where a module call's outputs are, dynamo learns from the recorder's own forward hook: while
dynamo traces a module's call it traces the process-wide hooks too, and the recorder's marks
each output (:func:`mark_outputs`, ``hooktrace::mark``, an operator with a side effect so that
dynamo keeps it). The marks name the output's slot, and the node's ``nn_module_stack`` names
the module; :mod:`hooktrace.recorder.graphs.plan` reads them and takes them out of the graph
before any backend sees it.

A gradient cannot leave a backward graph as an output. :func:`tap` is the identity in the
forward; its backward hands the gradient that reaches it to ``hooktrace::sink_summary``, an
operator with a side effect (so no compiler drops it), which summarises it by the hooks'
route and calls the recorder with the row (:func:`set_sink`): one operator a gradient,
half the time a small one took as a summarising operator and a sink
(``benchmarks/bench_stats_kernels.py --graph-ops``). In a graph compiled for the steps
that save tensors whole, each value summarised leaves the graph as a copy
(:func:`kept_copy`) and each tap hands on its gradient too. With :data:`FUSED`, the row is the graph's (``hooktrace::sink``,
``hooktrace::sink_kept``), copied there: a compiled backward reuses its buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch

from hooktrace.recorder.records import shards
from hooktrace.recorder.records.shards import Shard
from hooktrace.recorder.stats.stats import STATS_WIDTH, summarize_with_activity
from hooktrace.recorder.stats.torch_route import summarize_on_device

Sink = Callable[[int, torch.Tensor], None]
Keep = Callable[[int, torch.Tensor], None]

FUSED = False
"""Whether values are summarised by tensor operations compiled into the graph with the model
(:func:`summary`) rather than by the operator :func:`summarize`: not bit-identical on a GPU
(the module's docstring), and slower on a CPU (docs/PERFORMANCE.md); kept for the
measurements that say so."""

_sink: list[Sink | None] = [None]
"""Where tapped gradients go: the recording's receiver, or None (graphs compiled while
recording stay in dynamo's cache after it: their taps then do nothing)."""

_keep: list[Keep | None] = [None]
"""Where tapped gradients go in full, on the steps that save tensors whole."""


def set_sink(sink: Sink | None, keep: Keep | None = None) -> None:
    _sink[0] = sink
    _keep[0] = keep


def summary(x: torch.Tensor) -> torch.Tensor:
    """mean, std, min, max, norm, zeros, NaNs, Infs of ``x`` as float64 (``STATS_WIDTH``):
    the hooks' statistics on a device, of the detached value in float32."""
    return summarize_on_device(x.detach().float())


def kept_copy(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` as it is now, outside autograd: what a graph compiled for the steps
    that save tensors whole returns of each value it summarises. An operator of its own,
    which no compiler merges with a tap's copy of the same value (inductor did, and the
    model's output came out of the graph without its gradient)."""
    return torch.ops.hooktrace.copy(x.detach())


def summarize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`summary` and :func:`activity` (``dim`` >= 0; else no counts: an empty tensor)
    of a value, by the route the hooks take (the one-pass kernel on the CPU where it is
    loaded, the Triton kernels on a GPU where Triton is): an operator the compiler calls,
    not code it generates. Inductor's reductions on a CPU took 0.59 to 0.66 of torch's
    passes, the one-pass kernel 0.18 to 0.26."""
    return torch.ops.hooktrace.summarize(x.detach(), dim)


_LIBRARY = torch.library.Library("hooktrace", "DEF")
"""The operators a compiled graph calls at every step, defined on torch's dispatcher as
plainly as it allows: 3 us a call, against 22 for a ``torch.library.custom_op`` (whose
Python wrapper checks its arguments at each call)."""


def _tag(name: str) -> tuple[torch.Tag, ...]:
    """torch's tag ``name``, where this torch has it (none otherwise)."""
    tag = getattr(torch.Tag, name, None)
    return (tag,) if tag is not None else ()


_ANY_LAYOUT = _tag("flexible_layout")
"""Tags of an operator that reads its input in whatever strides the compiler chose: inductor
otherwise hands it the strides of an eager run, copying (a channels-last convolution's output
into its eager layout, and the model's fused kernels after it with it)."""

_NOT_IN_CUDA_GRAPHS = _tag("cudagraph_unsafe")
"""Tags of the operators that call the recorder or hand it tensors it keeps past the step:
a CUDA graph's replay runs kernels, not Python (a tap's gradient would never reach the
recorder), and overwrites its outputs at the next replay (rows the writer has not copied
yet). Inductor runs such operators between the CUDA graphs it makes of the rest
(``mode="reduce-overhead"``; without graph partitions, it makes none of that graph)."""

_register_fake = torch.library.register_fake

_LIBRARY.define(
    "summarize(Tensor x, int dim) -> (Tensor, Tensor)", tags=_ANY_LAYOUT + _NOT_IN_CUDA_GRAPHS
)


def _summarize_op(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    row, counts = _summarised(x, dim)
    if counts is None:
        units = max(x.shape[dim], 0) if dim >= 0 else 0
        return row, torch.zeros(units, dtype=torch.int64, device=x.device)
    return row, counts


def _summarised(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The statistics row of ``x`` (float64, on its device) and its counts along ``dim``
    (int64; None where ``dim`` < 0 or the route counted none)."""
    stats, counts = summarize_with_activity(x, dim if dim >= 0 else None)
    if stats is None:  # no values to summarise
        row = torch.full((STATS_WIDTH,), float("nan"), dtype=torch.float64, device=x.device)
        row[5:] = 0
    elif isinstance(stats, np.ndarray):
        row = torch.from_numpy(stats)
    else:
        row = stats.to(torch.float64)
    if counts is None:
        return row, None
    if isinstance(counts, np.ndarray):
        return row, torch.from_numpy(counts.astype(np.int64, copy=False))
    return row, counts.to(torch.int64)


def _summarize_fake(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    units = x.shape[dim] if dim >= 0 else 0
    return x.new_empty(STATS_WIDTH, dtype=torch.float64), x.new_empty(units, dtype=torch.int64)


_LIBRARY.impl("summarize", _summarize_op, "CompositeExplicitAutograd")
_register_fake("hooktrace::summarize", _summarize_fake, lib=_LIBRARY)


class _Tap(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, site: int, copy: bool, keep: bool) -> torch.Tensor:
        ctx.site = site
        ctx.keep = keep
        # a view of a value the graph returns is made again outside it, tap and all; and a
        # view may not be changed in place
        return x.clone() if copy else x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        value = grad
        if shards.dtensor(grad):  # its local shard, placed as traced (this runs when traced;
            # the AOTAutograd cache does not keep a graph that calls the taps, so every
            # compile traces it again and places each new site)
            local = cast(Any, grad)._local_tensor
            with _untraced():  # the mesh's coordinate is read, not traced into the graph
                shard = shards.described(cast(Any, grad)._spec)
            _GRADIENT_PLACES[ctx.site] = (shard, tuple(int(d) for d in local.shape))
            value = cast(Any, grad).to_local()
        if not FUSED:  # summarised and handed on by one operator: one call a gradient
            torch.ops.hooktrace.sink_summary(value.detach(), ctx.site, ctx.keep)
            return grad, None, None, None
        row = summary(value)
        if ctx.keep:  # one operator for both: a compiler may order two apart
            torch.ops.hooktrace.sink_kept(row, value, ctx.site)
        else:
            torch.ops.hooktrace.sink(row, ctx.site)
        return grad, None, None, None


@contextlib.contextmanager
def _untraced() -> Iterator[None]:
    """Real tensors, and nothing recorded into a graph being traced."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        yield


_GRADIENT_PLACES: dict[int, tuple[Shard, tuple[int, ...]]] = {}
"""A tap's gradient that is a DTensor: its shard columns and local shape, by site (known
when the backward is traced, before it runs)."""


def gradient_place(site: int) -> tuple[Shard, tuple[int, ...]] | None:
    """Where the gradient a tap summarises lies, where it is a DTensor's local shard."""
    return _GRADIENT_PLACES.get(site)


def tap(x: torch.Tensor, site: int, copy: bool = False, keep: bool = False) -> torch.Tensor:
    """``x``, whose gradient is summarised and handed to the sink under ``site``; a copy of
    it (``copy``) where the graph returns it or changes it in place; the gradient itself
    handed over too where ``keep`` (a graph compiled for the steps that save tensors whole)."""
    return _Tap.apply(x, site, copy, keep)


_MAX_DEPTH = 4
"""Nesting of a module's outputs marked, at most (tuples of tuples of tensors)."""


def mark_outputs(output: Any, slot: str = "", depth: int = 0) -> None:
    """Mark each tensor of a module's output with its slot (as ``records.flatten`` names
    them): runs while dynamo traces the module's call, so only what dynamo traces without a
    graph break is looked into (tensors, tuples, lists, dicts with string keys)."""
    _mark(output, slot, depth, inputs=False)


def mark_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Mark each tensor of a module call's arguments with its slot (as
    ``records.flatten.flatten_call`` names them), as :func:`mark_outputs` does."""
    for i, arg in enumerate(args):
        _mark(arg, str(i), 0, inputs=True)
    for key, arg in kwargs.items():
        _mark(arg, str(key), 0, inputs=True)


def _mark(value: Any, slot: str, depth: int, *, inputs: bool) -> None:
    if isinstance(value, torch.Tensor):
        if shards.dtensor(value):
            if not inputs:  # its local tensor (hooktrace::mark has no sharding rule: a graph
                # break), marked as a DTensor's for the plan to place it (LOCAL_MARKS)
                torch.ops.hooktrace.mark_local(cast(Any, value).to_local(), slot or "0")
        elif inputs:
            torch.ops.hooktrace.mark_input(value, slot or "0")
        else:
            torch.ops.hooktrace.mark(value, slot or "0")
    elif depth < _MAX_DEPTH and isinstance(value, (tuple, list)):
        fields = getattr(value, "_fields", None)  # a namedtuple's slots are its fields
        for i, item in enumerate(value):
            key = fields[i] if fields is not None else str(i)
            _mark(item, f"{slot}.{key}" if slot else key, depth + 1, inputs=inputs)
    elif depth < _MAX_DEPTH and type(value) is dict:
        for key, item in value.items():
            if isinstance(key, str):
                _mark(item, f"{slot}.{key}" if slot else key, depth + 1, inputs=inputs)


_PT2_COMPLIANT = _tag("pt2_compliant_tag")
"""The tag of an operator dynamo may trace with ``only_allow_pt2_compliant_ops`` set: the
marks are traced by dynamo itself, from the hooks (the other operators are added to graphs
after it)."""

_MARK_OPERATORS = {
    "mark": "slot",  # a module call's output
    "mark_input": "slot",  # a module call's argument
    "mark_local": "slot",  # a DTensor output's local tensor
    "mark_watched": "name",  # a tensor ``hooktrace.watch`` names
    "mark_watched_local": "name",  # a watched DTensor's local tensor
}
"""The marks, each ``(Tensor x, str slot_or_name) -> ()``, by the name of their string. They
never run where the recorder instruments the graph (the plan takes them out)."""


def _define_mark(name: str, argument: str) -> None:
    _LIBRARY.define(f"{name}(Tensor x, str {argument}) -> ()", tags=_PT2_COMPLIANT)
    _LIBRARY.impl(name, lambda x, text: None, "CompositeExplicitAutograd")
    _register_fake(f"hooktrace::{name}", lambda x, text: None, lib=_LIBRARY)
    torch.fx.node.has_side_effect(getattr(torch.ops.hooktrace, name).default)


for _mark_name, _argument in _MARK_OPERATORS.items():
    _define_mark(_mark_name, _argument)
del _mark_name, _argument


def mark_watched(tensor: torch.Tensor, name: str) -> None:
    """Mark a tensor that ``hooktrace.watch`` records under ``name``, while dynamo traces
    the call (a DTensor by its local tensor, as a module's DTensor output is)."""
    if not isinstance(tensor, torch.Tensor):
        return
    if shards.dtensor(tensor):
        torch.ops.hooktrace.mark_watched_local(cast(Any, tensor).to_local(), name)
    else:
        torch.ops.hooktrace.mark_watched(tensor, name)


_LIBRARY.define("sink(Tensor row, int site) -> ()", tags=_NOT_IN_CUDA_GRAPHS)


def _sink_op(row: torch.Tensor, site: int) -> None:
    sink = _sink[0]
    if sink is not None:
        sink(site, row.clone())


_LIBRARY.impl("sink", _sink_op, "CompositeExplicitAutograd")
_register_fake("hooktrace::sink", lambda row, site: None, lib=_LIBRARY)

_LIBRARY.define("copy(Tensor x) -> Tensor", tags=_ANY_LAYOUT + _NOT_IN_CUDA_GRAPHS)
_LIBRARY.impl("copy", lambda x: x.clone(), "CompositeExplicitAutograd")
_register_fake("hooktrace::copy", lambda x: torch.empty_like(x), lib=_LIBRARY)

_LIBRARY.define("sink_kept(Tensor row, Tensor value, int site) -> ()", tags=_NOT_IN_CUDA_GRAPHS)


def _sink_kept_op(row: torch.Tensor, value: torch.Tensor, site: int) -> None:
    """:func:`_sink_op` with the gradient itself, first: its record takes it."""
    keep = _keep[0]
    if keep is not None:
        keep(site, value.detach().clone())
    _sink_op(row, site)


_LIBRARY.impl("sink_kept", _sink_kept_op, "CompositeExplicitAutograd")
_register_fake("hooktrace::sink_kept", lambda row, value, site: None, lib=_LIBRARY)

_LIBRARY.define(
    "sink_summary(Tensor grad, int site, bool keep) -> ()", tags=_ANY_LAYOUT + _NOT_IN_CUDA_GRAPHS
)


def _sink_summary_op(grad: torch.Tensor, site: int, keep: bool) -> None:
    """A tap's gradient summarised by the hooks' route and handed to the sink (the gradient
    itself first, where ``keep``), in one operator: the row is made here, so nothing the
    compiled backward reuses is handed on, and a graph that outlives its recording
    summarises nothing."""
    sink = _sink[0]
    if sink is None:
        return
    if keep and _keep[0] is not None:
        _keep[0](site, grad.clone())
    sink(site, _summarised(grad, -1)[0])


_LIBRARY.impl("sink_summary", _sink_summary_op, "CompositeExplicitAutograd")
_register_fake("hooktrace::sink_summary", lambda grad, site, keep: None, lib=_LIBRARY)


torch.fx.node.has_side_effect(torch.ops.hooktrace.sink.default)
torch.fx.node.has_side_effect(torch.ops.hooktrace.sink_kept.default)
torch.fx.node.has_side_effect(torch.ops.hooktrace.sink_summary.default)
INPUT_MARKS = (torch.ops.hooktrace.mark_input, torch.ops.hooktrace.mark_input.default)
"""Marks of a module call's arguments (``inputs=True``)."""
LOCAL_MARKS = (
    torch.ops.hooktrace.mark_local,
    torch.ops.hooktrace.mark_local.default,
    torch.ops.hooktrace.mark_watched_local,
    torch.ops.hooktrace.mark_watched_local.default,
)
"""Marks of a DTensor's local tensor (the DTensor is the local tensor's argument): a module
output's, or a watched one's."""
WATCH_MARKS = (
    torch.ops.hooktrace.mark_watched,
    torch.ops.hooktrace.mark_watched.default,
    torch.ops.hooktrace.mark_watched_local,
    torch.ops.hooktrace.mark_watched_local.default,
)
"""Marks of a tensor ``hooktrace.watch`` records (its name the mark's argument)."""
MARKS = (
    torch.ops.hooktrace.mark,
    torch.ops.hooktrace.mark.default,
    *LOCAL_MARKS,
    *INPUT_MARKS,
    torch.ops.hooktrace.mark_watched,
    torch.ops.hooktrace.mark_watched.default,
)
