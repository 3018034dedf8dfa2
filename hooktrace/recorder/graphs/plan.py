"""Where the module calls of a graph that dynamo captured return, and what is added to it.

While dynamo traces a module's call it traces the recorder's forward hook too, which marks
each output with its slot (``ops.mark_outputs``). A mark's node says which value, its
argument the slot, and its ``nn_module_stack`` the module: the calls it ran inside, outermost
first, the last the module itself, keyed by the module's id (``"140…"``, ``"140…@1"`` for its
second call in the graph) with its path from the compiled frame (``"L['self'].blocks.0.fc"``).
A mark with no stack is the frame's own module (a module compiled on its own). The marks
come in the order the hooks ran, which is the order an eager run records in; they are taken
out of the graph here. Each value marked is summarised in the graph
(:mod:`hooktrace.recorder.graphs.ops`): its statistics become one row of an extra output of
the graph, its per-unit activity a span of a second one, and its gradient is caught by a tap
whose backward summarises it. An output whose shape is dynamic returns its sizes too. What
the graph itself returns leaves it through a tap where the graph reads it too: the gradient
that use adds arises inside the graph, where the hooks of a compiled root, which run outside
it, could not see it (``Plan.returned_taps``).

Which module ran is settled when the graph runs, not here: one graph serves every block of a
``ModuleList`` compiled block by block. Each frame's modules are found at run time from a
parameter the graph takes (its *anchor*): the parameter's name in the recorded model, less
its path from the frame, is the frame's module. A frame with no parameter is found in the
locals of the Python frame running the graph (``L['self']``: its ``self``); where it is not
found, by the ids the graph was traced with. A dynamic dimension's units are not counted.
"""

from __future__ import annotations

import functools
import inspect
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from hooktrace.recorder.graphs import ops
from hooktrace.recorder.records import shards
from hooktrace.recorder.records.shards import Shard
from hooktrace.recorder.stats.stats import activity, unit_dim

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

Dims = tuple[int, ...] | None

_SELF = "L['self']"
"""The frame of a module's own call (``Module._call_impl``), compiled on its own."""

_IN_PLACE = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}


@dataclass(frozen=True)
class Output:
    """One output of a module call: its slot, its row of the statistics, its span of the
    counts (None: no units counted), its tap (None: its gradient is not caught)."""

    slot: str
    row: int
    counts: tuple[int, int] | None
    tap: int | None
    dtype: torch.dtype
    shape: tuple[int, ...]  # -1 where dynamic
    dims: Dims = None  # where dynamic: its sizes' places among the graph's size outputs
    shard: Shard | None = None  # a DTensor's local tensor: what it is a part of
    kind: str = "output"  # or "input": an argument of the call (``inputs=True``)

    def shape_of(self, sizes: Sequence[int]) -> tuple[int, ...]:
        """The output's shape in this run (``sizes``: the graph's size outputs)."""
        if self.dims is None:
            return self.shape
        return tuple(int(sizes[i]) for i in self.dims)


@dataclass(frozen=True)
class Call:
    """One module call in the graph: the frame it ran under, its path from that frame's
    module, the id of the module traced, and its outputs; or, where its arguments are
    recorded (``inputs=True``), those in an entry of their own, placed where the call began,
    which counts the call only where no entry of its outputs follows (``counts``)."""

    frame: str
    path: str
    traced_id: int
    outputs: tuple[Output, ...]
    counts: bool = True
    watched: str = ""  # a tensor hooktrace.watch records under this name: no module's call
    grad: bool | None = None  # grad mode set inside the graph where it ran (None: as entered)


@dataclass
class Plan:
    """What was added to one graph: the graph's own outputs come first (``returns`` of
    them), then the statistics (one row per output summarised), the counts where any units
    are counted, the sizes of outputs whose shapes are dynamic (``Output.dims``), and in a
    graph compiled for the steps that save tensors whole, the values summarised themselves
    (``values`` of them, one a row, detached)."""

    returns: int
    calls: list[Call]
    anchors: dict[str, tuple[int, str]]  # frame -> (placeholder index, parameter path)
    has_counts: bool
    values: int = 0
    unanchored: tuple[str, ...] = ()  # frames that take no parameter: named by their locals
    # the graph's own outputs that leave it through a tap: (their place among them, the tap)
    returned_taps: tuple[tuple[int, int], ...] = ()
    code: Any = None  # the code object of the Python frame dynamo compiled, which holds them

    def split(
        self, extras: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, Sequence[Any], Sequence[torch.Tensor]]:
        """A run's extra outputs as (statistics, counts, sizes, values)."""
        sizes_at = 2 if self.has_counts else 1
        end = len(extras) - self.values
        return (extras[0], extras[1] if self.has_counts else None, extras[sizes_at:end],
                extras[end:])  # fmt: skip


def instrument(
    gm: fx.GraphModule,
    *,
    max_units: int,
    new_tap: Callable[[], int],
    recorded: Callable[[int], bool],
    left_out: Callable[[str], None] = lambda path: None,
    unopened: Callable[[list[str]], None] = lambda paths: None,
    full: bool = False,
) -> Plan | None:
    """Take the marks out of ``gm`` and add, in their place, the statistics of the values
    they marked, and taps on their gradients where the graph trains; only of modules
    ``recorded`` (by id: a model that is not recorded pays nothing). None where no mark is
    left (the graph then only loses its marks).

    A DTensor output (tensor parallelism's, marked by its local tensor) is summarised over
    its local tensor, its record placed by the DTensor's spec, and its gradient tapped as
    the DTensor's (:func:`ops.gradient_place`); one whose shape is dynamic is left out:
    ``left_out`` is told its module's path.

    The marks in a region the graph calls (activation checkpointing's) are taken out into
    the graph (:func:`_hoist`); ``unopened`` is told the paths of the modules marked in a
    region that is not opened (``torch.cond``'s branches, ``while_loop``'s body): not
    recorded.

    ``full``: the graph also returns each value summarised, and its taps hand on each
    gradient (a variant for the steps that save tensors whole)."""
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    training = torch.is_grad_enabled() and any(
        isinstance(v := p.meta.get("example_value"), torch.Tensor) and v.requires_grad
        for p in placeholders
    )
    _hoist(gm, training=training, new_tap=new_tap, full=full)
    shut = _unopened_regions(gm, recorded)
    if shut:
        unopened(shut)
    marks = [n for n in graph.nodes if n.op == "call_function" and n.target in ops.MARKS]
    if not marks:
        return None
    grad_at = _grad_modes(graph)
    output_node = next(n for n in graph.nodes if n.op == "output")
    returns = len(output_node.args[0])
    starts = _starts(graph)
    changed = {n for n in graph.nodes if _mutated(n)}  # before taps take their users
    calls: dict[str, tuple[str, type | None, list[tuple[str, fx.Node, bool, str, int | None]]]] = {}
    grads: dict[str, bool | None] = {}  # by call: the grad mode at its first mark
    begins: dict[str, tuple[int, int]] = {"": (0, 0)}  # by call: (its first mark, depth)
    ends: dict[str, int] = {}  # by call: its first output's mark
    watched: dict[str, str] = {}  # by call: the name a watched tensor is recorded under
    for position, mark in enumerate(marks):
        value, slot = mark.args
        stack = mark.meta.get("nn_module_stack") or {}
        for depth, outer in enumerate(_call_keys(stack), start=1):  # inside each of them
            begins.setdefault(outer, (position, depth))
        graph.erase_node(mark)
        if mark.target in ops.WATCH_MARKS:  # a call of its own, at its place
            key = f"watched@{position}"
            watched[key], begins[key], ends[key] = str(slot), (position, len(stack) + 1), position
            local = mark.target in ops.LOCAL_MARKS  # a watched DTensor's local tensor
            calls[key] = ("", None, [("0", value, local, "tensor", mark.meta.get(_TAPPED_INSIDE))])
            continue
        key, (path, module_type) = next(reversed(stack.items()), ("", ("", None)))
        if key and not recorded(int(key.split("@")[0])):
            continue  # (no stack: the frame's own module, known only when the graph runs)
        key = _call_keys(stack)[-1] if key else ""
        local = mark.target in ops.LOCAL_MARKS
        kind = "input" if mark.target in ops.INPUT_MARKS else "output"
        if kind == "output":
            ends.setdefault(key, position)
        grads.setdefault(key, grad_at.get(mark))
        calls.setdefault(key, (path, module_type, []))[2].append(
            (str(slot), value, local, kind, mark.meta.get(_TAPPED_INSIDE))
        )
    if not calls:
        gm.recompile()
        return None
    adding = _Adding(
        graph, output_node, max_units=max_units, training=training, new_tap=new_tap, full=full
    )
    placed: list[tuple[tuple[int, int, int], Call]] = []
    for key, (path, module_type, marked) in calls.items():
        outputs = []
        for slot, node, local, kind, tapped_inside in marked:
            shard, tap_on = None, None
            if local:  # a DTensor's local tensor (its to_local()): the gradient tapped on it
                tap_on = cast(fx.Node, node.args[0])
                shard = _shard_of(tap_on)
                if shard is None:  # a dynamic shape: where its shard lies is not known here
                    left_out(watched.get(key) or (_split_path(path)[1] if path else ""))
                    continue
            value = node.meta.get("example_value")
            if isinstance(value, torch.Tensor) and not value.is_complex():
                channels_first = (
                    kind == "output"
                    and module_type is not None
                    and issubclass(module_type, _CHANNELS_FIRST)
                )
                # an argument changed in place since it was made: read as the call begins
                at = starts.get(key) if kind == "input" and node in changed else None
                outputs.append(
                    adding.output(
                        slot,
                        node,
                        value,
                        channels_first=channels_first,
                        shard=shard,
                        tap_on=tap_on,
                        kind=kind,
                        at=at,
                        tapped_inside=tapped_inside,
                    )
                )
        begin, depth = begins[key]
        if key in watched:
            if outputs:
                placed.append(((ends[key], 1, depth), Call("", "", 0, tuple(outputs),
                                                           watched=watched[key])))  # fmt: skip
            continue
        traced_id = int(key.split("@")[0]) if key else 0
        # no stack: the frame's own module, a module's call compiled on its own
        frame, relative = _split_path(path) if path else (_SELF, "")
        arguments = tuple(o for o in outputs if o.kind == "input")
        returned = tuple(o for o in outputs if o.kind == "output")
        grad = grads.get(key)
        if arguments:  # where the call began, before the calls inside it, as hooks see them
            call = Call(frame, relative, traced_id, arguments, counts=not returned, grad=grad)
            placed.append(((begin, 0, depth), call))
        if returned:
            call = Call(frame, relative, traced_id, returned, grad=grad)
            placed.append(((ends[key], 1, depth), call))
    planned = [call for _, call in sorted(placed, key=lambda p: p[0])]
    if not planned:  # marks of values with nothing to summarise (complex, not tensors)
        gm.recompile()
        return None
    returned_taps = adding.tap_returned(returns, changed)
    extra = adding.finish()
    output_node.args = (tuple(output_node.args[0]) + tuple(extra),)  # taps' in place now
    graph.lint()
    gm.recompile()
    frames = {c.frame for c in planned if not c.watched}
    anchors = _anchors(placeholders, frames, recorded)
    return Plan(
        returns=returns,
        calls=planned,
        anchors=anchors,
        has_counts=bool(adding.count_nodes),
        values=len(adding.values),
        unanchored=tuple(sorted(frames - anchors.keys())),
        returned_taps=returned_taps,
    )


def strip_marks(gm: fx.GraphModule) -> None:
    """Take the marks out of ``gm``, adding nothing (a graph compiled as it was)."""
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ops.MARKS]:
        gm.graph.erase_node(node)
    gm.recompile()
    for child in gm.children():  # the regions it calls (activation checkpointing's)
        if isinstance(child, fx.GraphModule):
            strip_marks(child)


class _Adding:
    """The nodes added to one graph: each value's statistics once (a value several modules
    returned is each one's output), its counts, its tap, its sizes."""

    def __init__(
        self,
        graph: fx.Graph,
        output_node: fx.Node,
        *,
        max_units: int,
        training: bool,
        new_tap: Callable[[], int],
        full: bool = False,
    ) -> None:
        self.graph = graph
        self.full = full
        self.values: list[fx.Node] = []  # where full: each value summarised, by its row
        self.output_node = output_node
        self.max_units = max_units
        self.training = training
        self.new_tap = new_tap
        self.rows: list[fx.Node] = []
        self.count_nodes: list[fx.Node] = []
        self.counted = 0
        self.sizes: list[fx.Node] = []  # dynamic outputs' sizes, returned after the statistics
        self.channel_shapes: set[tuple[int, ...]] = set()  # of channels-first 3-D outputs
        # by value (and where it is read, if not where it is made)
        self.made: dict[Any, tuple[int, tuple[int, int] | None, int | None, Dims]] = {}
        self._ours: dict[fx.Node, set[fx.Node]] = {}  # by value: the nodes added to read it
        self._after: dict[fx.Node, fx.Node] = {}  # by value: the last of them
        self._tapped: dict[fx.Node, fx.Node] = {}  # by value: its tap, which later nodes read

    def output(
        self,
        slot: str,
        node: fx.Node,
        value: torch.Tensor,
        *,
        channels_first: bool,
        shard: Shard | None = None,
        tap_on: fx.Node | None = None,
        kind: str = "output",
        at: fx.Node | None = None,
        tapped_inside: int | None = None,
    ) -> Output:
        """``node`` summarised (``value`` its example) where it is made, or just before
        ``at`` (the first node of a call whose argument was changed in place after it was
        made); its gradient tapped at ``tap_on`` (the DTensor whose local tensor ``node``
        is) or at ``node`` where it is an output (an argument's gradient is not recorded,
        as in an eager run); ``tapped_inside``: the tap ``node``'s gradient has already, in
        the region it was taken out of (:func:`_hoist`)."""
        shape = tuple(d if isinstance(d, int) else -1 for d in value.shape)
        static = -1 not in shape
        if static and channels_first and len(shape) == 3:
            self.channel_shapes.add(shape)
        made: Any = node if at is None else (node, at)
        if made not in self.made:
            self.made[made] = self._summarise(node, value, shape, static, at)
        row, span, tap, dims = self.made[made]
        if tap is None and kind != "input":  # (an argument of a call before: not tapped)
            tap = tapped_inside if tapped_inside is not None else self._tap(node, tap_on)
            self.made[made] = (row, span, tap, dims)
        return Output(slot, row, span, tap, value.dtype, shape, dims, shard, kind)

    def _summarise(
        self,
        node: fx.Node,
        value: torch.Tensor,
        shape: tuple[int, ...],
        static: bool,
        at: fx.Node | None = None,
    ) -> tuple[int, tuple[int, int] | None, int | None, Dims]:
        """Add ``node``'s statistics (and counts, its copy on a full variant, its sizes
        where dynamic), after it or before ``at``; its row, its span of the counts, no tap
        yet, its sizes' places."""
        graph = self.graph
        dim = unit_dim(value, channels_first=shape in self.channel_shapes)
        # (a dynamic dimension is -1: its units are not counted)
        counting = (
            value.is_floating_point() and dim is not None and 0 < shape[dim] <= self.max_units
        )
        span = None
        if counting:
            span = (self.counted, self.counted + shape[dim])  # type: ignore[index]
            self.counted += shape[dim]  # type: ignore[index]
        where = graph.inserting_after(node) if at is None else graph.inserting_before(at)
        if at is not None:  # the value the call reads: a tap's, where one hands it on
            node = self._tapped.get(node, node)
        if not ops.FUSED:  # the hooks' route, called
            with where:
                both = graph.call_function(ops.summarize, (node, dim if counting else -1))
            with graph.inserting_after(both):
                summary = graph.call_function(operator.getitem, (both, 0))
            last = summary
            if counting:
                with graph.inserting_after(summary):
                    last = graph.call_function(operator.getitem, (both, 1))
        else:  # statistics the compiler fuses with the model's kernels
            with where:
                summary = graph.call_function(ops.summary, (node,))
            last = summary
            if counting:
                with graph.inserting_after(summary):
                    last = graph.call_function(activity, (node, dim))
        self.rows.append(summary)
        kept = None
        if self.full:  # the value as the module returned it (before an in-place change)
            with graph.inserting_after(last):
                kept = graph.call_function(ops.kept_copy, (node,))
            self.values.append(kept)
        if counting:
            self.count_nodes.append(last)
        if at is None:  # (one read before a call is never tapped)
            self._ours[node] = {summary, last, node, *summary.all_input_nodes}
            if kept is not None:
                self._ours[node] |= {kept, *kept.all_input_nodes}
            self._after[node] = kept if kept is not None else last
        dims = None
        if not static:  # its sizes leave the graph with the statistics
            dims = tuple(range(len(self.sizes), len(self.sizes) + len(shape)))
            for d in range(len(shape)):
                with graph.inserting_before(self.output_node):
                    size = graph.call_function(torch.ops.aten.sym_size.int, (node, d))
                self.sizes.append(size)
        return len(self.rows) - 1, span, None, dims

    def _tap(self, node: fx.Node, tap_on: fx.Node | None) -> int | None:
        """A tap on the gradient of ``node`` (or of ``tap_on``, the DTensor whose local
        tensor it is), after its statistics: its site, or None where the graph does not
        train or the value takes no gradient."""
        graph = self.graph
        target = node if tap_on is None else tap_on
        grads = getattr(target.meta.get("example_value"), "requires_grad", False)
        if not (self.training and grads):
            return None
        tap = self.new_tap()
        copy = self.output_node in target.users or _mutated(target)
        with graph.inserting_after(self._after[node]):
            tapped = graph.call_function(ops.tap, (target, tap, copy, self.full))
        self._tapped[target] = tapped
        ours = (self._ours[node] | {tapped}) - {target}
        for user in list(target.users):
            if user not in ours:
                user.replace_input_with(target, tapped)
        return tap

    def tap_returned(self, returns: int, changed: set[fx.Node]) -> tuple[tuple[int, int], ...]:
        """The graph's own outputs (``returns`` of them) that leave it through a tap, as
        (their place, the tap). A module whose hooks run outside the graph (a compiled
        root, a block compiled on its own) records the gradient of what it returns from its
        tap: a hook on the tensor the graph returns sees only the gradient from outside the
        graph, where an eager run's sees what the graph's own uses add too (``return logits,
        F.cross_entropy(logits, y)``). A value the graph returns and reads, that no module
        returned, is tapped here; one that is a view, or changed in place (``changed``: the
        values changed later, as the graph was traced), is not: a hook on the tensor records
        it as before."""
        if not self.training:
            return ()
        sites = []
        for index in range(returns):
            # (read again each time: a tap added takes its value's places)
            node = cast(Sequence[Any], self.output_node.args[0])[index]
            if not isinstance(node, fx.Node):
                continue
            if node.op == "call_function" and node.target is ops.tap:
                if node.args[0] not in changed:  # (else its gradient is not the tap's)
                    sites.append((index, cast(int, node.args[1])))
                continue
            value = node.meta.get("example_value")
            if (
                isinstance(value, torch.Tensor)
                and value.requires_grad
                and not value._is_view()
                and node.op != "placeholder"
                and node not in changed
                and any(_reads(user) for user in node.users if user is not self.output_node)
            ):
                tap = self.new_tap()
                with self.graph.inserting_after(node):
                    tapped = self.graph.call_function(ops.tap, (node, tap, True, self.full))
                for user in list(node.users):
                    if user is not tapped and _reads(user):
                        user.replace_input_with(node, tapped)  # (the output's too)
                sites.append((index, tap))
        return tuple(sites)

    def finish(self) -> list[fx.Node]:
        """The extra outputs: the statistics, the counts (if any), the sizes, the values."""
        with self.graph.inserting_before(self.output_node):
            extra = [self.graph.call_function(torch.stack, (self.rows,))]
            if self.count_nodes:
                extra.append(self.graph.call_function(torch.cat, (self.count_nodes,)))
        return extra + self.sizes + self.values


_NOT_READING = {ops.summarize, ops.summary, ops.kept_copy, activity, torch.ops.aten.sym_size.int}
"""What the recorder adds to a graph that takes a value without using it in the model's
computation: its statistics, its copy, its sizes."""


def _reads(user: fx.Node) -> bool:
    """Whether ``user`` takes a value into the model's computation (not the recorder's)."""
    return not (user.op == "call_function" and user.target in _NOT_READING)


_REGIONS = tuple(
    op
    for op in (
        getattr(torch.ops.higher_order, "tag_activation_checkpoint", None),
        getattr(torch.ops.higher_order, "wrap", None),
    )
    if op is not None
)
"""Regions dynamo traces as a graph of their own, called from the frame's graph, that are
taken apart: activation checkpointing's (``torch.utils.checkpoint``), and a function dynamo
wraps whole (``higher_order.wrap``: a call it keeps out of the frame's graph, such as one
under a ``torch.autograd.graph.saved_tensors_hooks`` context)."""

_HOISTED = (
    torch.ops.hooktrace.mark,
    torch.ops.hooktrace.mark.default,
    *ops.INPUT_MARKS,
    torch.ops.hooktrace.mark_watched,
    torch.ops.hooktrace.mark_watched.default,
)
"""The marks taken out of a region: a DTensor's local tensor's (``ops.LOCAL_MARKS``) stays
in it, not recorded (where its shard lies is read from the DTensor, inside the region)."""

_TAPPED_INSIDE = "hooktrace_tapped_inside"
"""A hoisted mark's meta: the tap its value's gradient has inside its region (or None)."""


def _hoist(gm: fx.GraphModule, *, training: bool, new_tap: Callable[[], int], full: bool) -> None:
    """Take the marks out of the regions ``gm`` calls (:data:`_REGIONS`) into ``gm`` itself:
    each value marked in a region leaves it as an extra output, marked in ``gm`` just after
    the region's call, where it is summarised as any other; its gradient is tapped inside
    the region, where it flows (a checkpointed region's backward recomputes its forward and
    runs the tap's backward once). The marks come out in the order they were made, before
    the marks that follow the region: an eager run's order. A region is copied before it
    is changed: the graph compiled as it was shares the original."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _REGIONS:
            continue
        holder = node.args[0]
        if not isinstance(holder, fx.Node) or holder.op != "get_attr":
            continue
        body = getattr(gm, str(holder.target), None)
        if not isinstance(body, fx.GraphModule):
            continue
        if not _marked(body):
            continue
        body = fx.GraphModule(body, copy_graph(body.graph))
        setattr(gm, str(holder.target), body)
        _hoist(body, training=training, new_tap=new_tap, full=full)  # a region in this one
        marks = [n for n in body.graph.nodes if n.op == "call_function" and n.target in _HOISTED]
        output = next(n for n in body.graph.nodes if n.op == "output")
        first = len(output.args[0])  # the region's own outputs, then the values marked
        marked = [(mark.target, mark.args, dict(mark.meta)) for mark in marks]
        for mark in marks:  # (all of them before the taps take their values' users)
            body.graph.erase_node(mark)
        # by value: its output's place, its tap, the node that leaves the region
        places: dict[fx.Node, tuple[int, int | None, fx.Node]] = {}
        hoisted = []
        for target, args, meta in marked:
            value = args[0]
            if not isinstance(value, fx.Node):
                continue
            if value not in places:
                tap = meta.get(_TAPPED_INSIDE)  # a value of a region inside this one
                example = value.meta.get("example_value")
                grads = isinstance(example, torch.Tensor) and example.requires_grad
                leaving = value  # what leaves the region: the value as it was made
                if tap is None and training and grads and target not in ops.INPUT_MARKS:
                    tap = new_tap()
                    copy = output in value.users or _mutated(value)
                    with body.graph.inserting_after(value):
                        tapped = body.graph.call_function(ops.tap, (value, tap, copy, full))
                    for user in list(value.users):
                        if user is not tapped:
                            user.replace_input_with(value, tapped)
                elif _mutated(value):  # changed in place later in the region: a copy now
                    with body.graph.inserting_after(value):
                        leaving = body.graph.call_function(ops.kept_copy, (value,))
                places[value] = (first + len(places), tap, leaving)
            hoisted.append((target, args, meta, value, *places[value][:2]))
        leaving_values = [leaving for _, _, leaving in places.values()]
        output.args = (tuple(output.args[0]) + tuple(leaving_values),)  # (after the taps)
        body.graph.lint()
        body.recompile()
        examples = node.meta.get("example_value")
        after = node
        got: dict[int, fx.Node] = {}  # by output: its value in the frame's graph
        for target, args, meta, value, index, tap in hoisted:
            if index not in got:
                with gm.graph.inserting_after(after):
                    got[index] = gm.graph.call_function(operator.getitem, (node, index))
                got[index].meta["example_value"] = value.meta.get("example_value")
                after = got[index]
            with gm.graph.inserting_after(after):
                moved = gm.graph.call_function(target, (got[index], *args[1:]))
            moved.meta.update(meta)
            moved.meta[_TAPPED_INSIDE] = tap
            after = moved
        if isinstance(examples, (tuple, list)):
            extra = [value.meta.get("example_value") for value in places]
            node.meta["example_value"] = (*examples, *extra)


def _unopened_regions(gm: fx.GraphModule, recorded: Callable[[int], bool]) -> list[str]:
    """The paths of the ``recorded`` modules marked in the regions ``gm`` calls that
    :func:`_hoist` does not open, once each, in order. A nested compile region's body is
    traced for the first call of it, and other calls run it for other modules: each of
    those is named from the parameters it hands the region (``blocks.2`` for ``blocks.1``)."""
    paths: dict[str, None] = {}
    sites: dict[str, list[fx.Node]] = {}  # by region: its calls (from any graph, region)
    for owner, caller in gm.named_modules():
        if not isinstance(caller, fx.GraphModule):
            continue
        for node in caller.graph.nodes:
            if node.op == "call_function" and node.target is _INVOKE_SUBGRAPH and node.args:
                body = node.args[0]
                if isinstance(body, fx.Node) and body.op == "get_attr":
                    region = f"{owner}.{body.target}" if owner else str(body.target)
                    sites.setdefault(region, []).append(node)
    shared = any(len(calls) > 1 for calls in sites.values())
    sources = _sources(gm) if shared else {}  # (read once: a region's calls are named by them)
    for name, child in gm.named_modules():
        if child is gm or not isinstance(child, fx.GraphModule):
            continue
        found: list[str] = []
        for node in child.graph.nodes:
            if node.op == "call_function" and node.target in ops.WATCH_MARKS:
                paths[str(node.args[1])] = None  # hooktrace.watch's name
            elif node.op == "call_function" and node.target in ops.MARKS:
                stack = node.meta.get("nn_module_stack") or {}
                key, (path, _) = next(reversed(stack.items()), ("", ("", None)))
                if key and recorded(int(key.split("@")[0])):
                    found.append(_split_path(path)[1] if path else "")
        paths.update(dict.fromkeys(found))
        calls = sites.get(name, [])
        for site in calls[1:]:
            moved = _moved(calls[0], site, sources)
            if moved is not None:
                was, now = moved
                paths.update(
                    dict.fromkeys(now + p[len(was) :] for p in found if p.startswith(was + "."))
                )
    return list(paths)


_INVOKE_SUBGRAPH = getattr(torch.ops.higher_order, "invoke_subgraph", None)
"""A nested compile region's call (``torch.compiler.nested_compile_region``)."""


def _moved(first: fx.Node, other: fx.Node, sources: dict[fx.Node, str]) -> tuple[str, str] | None:
    """Where ``other``, a call of the region ``first`` calls too, runs the region's modules:
    (the module path in ``first``, the one in ``other``) of the first parameter they take
    from different modules (``("blocks.1", "blocks.2")``); None where none differs.
    ``sources``: the source names of placeholders of the frame's graph and its regions."""
    for one, two in zip(first.args[2:], other.args[2:], strict=False):
        paths = [
            _split_source(name)[1]
            if isinstance(n, fx.Node) and (name := sources.get(n)) is not None
            else None
            for n in (one, two)
        ]
        if paths[0] is None or paths[1] is None or paths[0] == paths[1]:
            continue
        was, now = paths[0].split("."), paths[1].split(".")
        while was and now and was[-1] == now[-1]:  # the path inside the module, taken off
            was.pop()
            now.pop()
        if was and now:
            return ".".join(was), ".".join(now)
    return None


def _sources(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """The source name of each placeholder of ``gm`` that dynamo took from the frame, and of
    each placeholder of the regions it calls (in a region, the name of what its caller
    hands it: a block's parameter inside activation checkpointing's region)."""
    sources: dict[fx.Node, str] = {}

    def read(graph: fx.GraphModule) -> None:
        for node in graph.graph.nodes:
            name = _source_name(node) if node.op == "placeholder" else None
            if name is not None:
                sources.setdefault(node, name)
            body = node.args[0] if node.op == "call_function" and node.args else None
            if not (isinstance(body, fx.Node) and body.op == "get_attr"):
                continue
            region = getattr(graph, str(body.target), None)
            if not isinstance(region, fx.GraphModule):
                continue
            handed = [a for a in node.args[1:] if isinstance(a, fx.Node)]
            held = [n for n in region.graph.nodes if n.op == "placeholder"]
            for argument, placeholder in zip(handed, held, strict=False):
                if argument in sources:
                    sources.setdefault(placeholder, sources[argument])
            read(region)

    read(gm)
    return sources


def _source_name(node: Any) -> str | None:
    """The name of the source dynamo took a placeholder's value from
    (``"L['self']._modules['fc']._parameters['weight']"``); None for any other node."""
    name = getattr(getattr(node, "_dynamo_source", None), "name", None)
    if callable(name):  # a method in older torch, a property in newer
        name = name()
    return name if isinstance(name, str) else None


def _marked(gm: fx.GraphModule) -> bool:
    """Whether ``gm``, or a region it calls, holds a mark."""
    return any(n.op == "call_function" and n.target in ops.MARKS for n in gm.graph.nodes) or any(
        isinstance(child, fx.GraphModule) and _marked(child) for child in gm.children()
    )


def copy_graph(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes keep their ``_dynamo_source`` and metadata."""
    copy = fx.Graph(owning_module=graph.owning_module)
    mapping: dict[fx.Node, fx.Node] = {}
    output = copy.graph_copy(graph, mapping)
    copy.output(output)
    for old, new in mapping.items():
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    return copy


def _grad_modes(graph: fx.Graph) -> dict[fx.Node, bool | None]:
    """The grad mode at each mark, as the graph sets it (dynamo traces ``torch.no_grad()``
    as ``_set_grad_enabled`` calls): None before the first, where it is the caller's."""
    modes: dict[fx.Node, bool | None] = {}
    mode: bool | None = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is torch._C._set_grad_enabled and node.args:
            mode = bool(node.args[0])
        elif node.target in ops.MARKS:
            modes[node] = mode
    return modes


def _call_keys(stack: dict[str, Any]) -> list[str]:
    """The module calls of an ``nn_module_stack``, outermost first, each by its key (the
    module's id, with ``@n`` from its second call) and its path: dynamo counts calls by
    path, so that one module two models share, called through each, has one key twice."""
    return [f"{key}@{value[0]}" for key, value in stack.items()]


def _starts(graph: fx.Graph) -> dict[str, fx.Node]:
    """Where each module call in ``graph`` begins: the first node run inside it (by the
    calls in its ``nn_module_stack``) that is not a mark; for a call that runs nothing but
    its marks, the first node after them."""
    starts: dict[str, fx.Node] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        for key in _call_keys(stack):
            if key not in starts:
                first = node
                while first.op == "call_function" and first.target in ops.MARKS:
                    first = first.next
                starts[key] = first
    return starts


def _shard_of(node: Any) -> Shard | None:
    """The shard columns of the DTensor ``node`` holds (its example value's spec: the
    logical shape, the mesh, this rank's coordinate, the placements), as the hooks record a
    DTensor's; None where they cannot be told here (a dynamic shape)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    spec = getattr(value, "_spec", None)
    if spec is None or not all(isinstance(d, int) for d in spec.shape):
        return None
    return shards.described(spec)


def _mutated(node: fx.Node, depth: int = 0) -> bool:
    """Whether a later node changes ``node`` in place (``x += y``, ``x.add_(y)``,
    ``F.relu(x, inplace=True)``), itself or through a view of it (``x[:, :4].relu_()``,
    ``x.t()[0].mul_(2)``): its tap hands on a copy, which a view may not be."""
    for user in node.users:
        if _in_place(user):
            return True
        if depth < _MOST_VIEWS and _aliases(user, node) and _mutated(user, depth + 1):
            return True
    return False


_MOST_VIEWS = 8
"""Views of views followed from a value, at most, to find it changed in place."""


def _in_place(node: fx.Node) -> bool:
    """Whether ``node`` changes a tensor it takes in place."""
    target: Any = node.target
    if target in _IN_PLACE or node.kwargs.get("inplace") is True:
        return True
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    return callable(target) and True in node.args[1:] and "inplace" in _parameters(target)


def _aliases(view: fx.Node, node: fx.Node) -> bool:
    """Whether ``view``'s value shares ``node``'s memory, as traced (False where the traced
    values cannot tell: no example value, or a tensor without storage)."""
    first, second = (n.meta.get("example_value") for n in (view, node))
    if type(first) is not FakeTensor or type(second) is not FakeTensor:
        return False
    return StorageWeakRef(first.untyped_storage()) == StorageWeakRef(second.untyped_storage())


@functools.lru_cache(maxsize=256)
def _parameters(target: Callable[..., Any]) -> tuple[str, ...]:
    """The names of a function's parameters (none where Python cannot tell)."""
    try:
        return tuple(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        return ()


def _split_path(path: str) -> tuple[str, str]:
    """``"L['self'].blocks.0.fc"`` -> ``("L['self']", "blocks.0.fc")``."""
    end = path.find("]")
    if end < 0:
        return path, ""
    return path[: end + 1], path[end + 2 :]


def _anchors(
    placeholders: list[fx.Node], frames: set[str], recorded: Callable[[int], bool]
) -> dict[str, tuple[int, str]]:
    """For each frame, a placeholder that takes one of its module's parameters, and that
    parameter's path from the module (``"blocks.0.fc.weight"``): the first of a module
    ``recorded`` where there is one (a trainer's method may take a module that is not
    recorded first, its projection or a frozen teacher), else the first."""
    anchors: dict[str, tuple[int, str]] = {}
    others: dict[str, tuple[int, str]] = {}
    for index, node in enumerate(placeholders):
        name = _source_name(node)
        if name is None:
            continue
        frame, rest = _split_source(name)
        if frame not in frames or frame in anchors or rest is None:
            continue
        stack = node.meta.get("nn_module_stack") or {}
        key = next(reversed(stack), "")
        owner = key.split("@")[0]
        if owner.isdigit() and recorded(int(owner)):
            anchors[frame] = (index, rest)
        else:
            others.setdefault(frame, (index, rest))
    return {**others, **anchors}


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
