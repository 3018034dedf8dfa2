"""One recorded step in execution order, with nesting: :func:`timeline`, behind
``Trace.timeline()``. Never imports torch.

It lives beside the reader, not with the analyses, because ``Trace`` returns it: it is how the
format's ``seq``, ``call`` and ``kind`` columns and the modules' ``parent`` read back as one
step's calls, as ``Trace.histograms()`` is how the stored spans read back as whole rows. What
is made of it lives in :mod:`hooktrace.analyze.overview.timeline` (:func:`largest_jumps`, and
:func:`~hooktrace.analyze.overview.timeline.timeline` for a run directory).

Every record of the step is an event, in ``seq`` order. Three passes follow each other:

- ``params``: the ``param`` and ``buffer`` rows, taken at the step's first forward, before
  anything ran. They come first; filter them out with ``frame[frame["pass"] != "params"]``
  (``hooktrace replay`` shows them as one line unless asked with ``--params``).
- ``forward``: ``input`` rows at the start of a call (when inputs were recorded), ``output``
  rows at its end, ``tensor`` rows of watched tensors in between. Calls nest as the modules
  did while they ran; ``depth`` is 0 for a call made outside any recorded call (a root).
- ``backward``: ``grad_output`` and ``grad_tensor`` in the order gradients arrived, then
  ``grad_param`` at the step's end. Each takes the depth and parent of the call it belongs to.

How nesting is found. Where a call's inputs were recorded, its ``input`` rows open it and its
``output`` rows close it, so everything in between ran inside it: the call stack is exact,
shared modules included (a module called from two parents nests under whichever called it).
Where inputs were not recorded, only call ends are known. Calls end in post-order (children
before their parent), so a call adopts the calls that ended just before it whose modules lie
below its own in the module hierarchy (``Trace.modules``'s ``parent``). That is exact for
modules that are only called by their parent, but a shared module called from elsewhere than
its first name's parent, or a watched tensor taken before a call's first child, shows one
level out.

Two columns help reading: ``gain`` is how the root mean square (``norm / sqrt(numel)``) of a
floating-point event compares with what it came from: an output with its call's first input
(when inputs were recorded) or else with the forward event before it, a gradient with the
gradient that arrived before it. ``first_nonfinite`` marks the step's first record holding a
NaN or Inf. :func:`hooktrace.analyze.overview.timeline.largest_jumps` picks the events whose gain is
furthest from 1.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import pandas as pd

from hooktrace.errors import TensorNotRecorded, TraceError


class Traced(Protocol):
    """What a timeline reads of a :class:`~hooktrace.trace.reader.Trace` (which imports this
    module: ``Trace.timeline()``)."""

    path: Path
    skipped: list[str]  # the damaged parts left out

    @property
    def steps(self) -> pd.DataFrame: ...

    @property
    def modules(self) -> pd.DataFrame: ...

    @property
    def ranks(self) -> list[int]: ...

    def query(
        self,
        *,
        columns: Sequence[str] | None = None,
        steps: Iterable[int] | tuple[int, int] | None = None,
        ranks: Iterable[int] | None = None,
    ) -> pd.DataFrame: ...


PASSES = {
    "param": "params",
    "buffer": "params",
    "input": "forward",
    "output": "forward",
    "tensor": "forward",
    "grad_output": "backward",
    "grad_tensor": "backward",
    "grad_param": "backward",
}
STAT_COLUMNS = [
    "dtype",
    "shape",
    "numel",
    "mean",
    "std",
    "min",
    "max",
    "norm",
    "zero_fraction",
    "nan_count",
    "inf_count",
]
COLUMNS = [
    "seq",
    "micro_step",
    "phase",
    "pass",
    "depth",
    "parent",
    "parent_call",
    "module",
    "call",
    "kind",
    "slot",
    *STAT_COLUMNS,
    "full",
    "gain",
    "first_nonfinite",
]
_READ = ["seq", "micro_step", "phase", "module", "call", "kind", "slot", *STAT_COLUMNS]
_READ += ["tensor_key"]

Key = tuple[int, str, str, int]  # (micro_step, phase, module, call)


def timeline(
    trace: Traced, step: int, *, micro_step: int | None = None, rank: int = 0
) -> pd.DataFrame:
    """The events of ``step`` (one rank) in execution order, one row per record.

    Columns: ``seq``, ``micro_step``, ``phase``, ``pass`` (params, forward, backward),
    ``depth`` and ``parent`` / ``parent_call`` (the enclosing call, "" and -1 at the top),
    ``module``, ``call``, ``kind``, ``slot``, the statistics, ``full`` (the tensor was saved),
    ``gain`` and ``first_nonfinite`` (see the module docstring). ``micro_step`` keeps only
    that micro-step's events (parameters belong to micro-step 0, gradients of parameters to
    the last). Raises :class:`TensorNotRecorded` naming the steps that exist.
    """
    for name, value in (("step", step), ("rank", rank)):
        if (
            isinstance(value, bool)
            or not isinstance(value, numbers.Real)
            or not float(value).is_integer()
        ):
            raise TraceError(f"timeline() takes the {name} as a whole number (got {value!r})")
    rows = trace.query(columns=_READ, steps=[int(step)], ranks=[int(rank)])
    if rows.empty:
        raise TensorNotRecorded(_no_step(trace, int(step), int(rank)))
    if micro_step is not None:
        present = sorted(int(m) for m in rows["micro_step"].unique())
        rows = rows[rows["micro_step"] == micro_step]
        if rows.empty:
            raise TensorNotRecorded(
                f"step {step} (rank {rank}) has no micro-step {micro_step}: it has micro-steps "
                f"{spans(present)}"
            )
    rows = rows.reset_index(drop=True)
    for column in ("phase", "module", "kind", "slot", "dtype"):
        rows[column] = rows[column].astype(str)
    rows["pass"] = rows["kind"].map(PASSES).fillna("forward")
    rows["full"] = rows.pop("tensor_key").fillna("") != ""
    containers = _nest(rows, _static_parents(trace, int(rank)))
    rows["gain"] = _gains(rows, containers)
    bad = (rows["nan_count"].fillna(0) > 0) | (rows["inf_count"].fillna(0) > 0)
    rows["first_nonfinite"] = False
    if bad.any():
        rows.loc[bad.idxmax(), "first_nonfinite"] = True
    return rows[COLUMNS]


def spans(values: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``0–2, 5, 7–8``."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs) or "none"


# -- nesting ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Node:
    """A call (or a watched tensor) in the step's call tree."""

    key: Key | None
    started: bool = False  # opened by its input rows
    children: list[_Node] = field(default_factory=list)
    parent: _Node | None = None
    depth: int = 0


def _nest(rows: pd.DataFrame, parents: dict[str, str]) -> set[Key]:
    """Add ``depth``, ``parent`` and ``parent_call`` to ``rows`` (a step in seq order);
    return the calls that had calls (or watched tensors) inside them."""
    top = _Node(None)
    frames = [top]  # open calls, innermost last
    nodes: dict[Key, _Node] = {}
    ended: set[Key] = set()
    ancestors = _Ancestors(parents)
    micro = rows["micro_step"].to_numpy()
    kinds, modules = rows["kind"].to_numpy(), rows["module"].to_numpy()
    phases, calls = rows["phase"].to_numpy(), rows["call"].to_numpy()
    for i in range(len(rows)):
        kind = kinds[i]
        if PASSES.get(kind) != "forward":
            continue
        key: Key = (int(micro[i]), str(phases[i]), str(modules[i]), int(calls[i]))
        node = nodes.get(key)
        if kind == "input" and node is None:
            node = nodes[key] = _Node(key, started=True)
            _adopt_into(frames[-1], node)
            frames.append(node)
        elif kind == "tensor" and node is None:
            nodes[key] = _adopt_into(frames[-1], _Node(key))
        elif kind == "output" and key not in ended:
            ended.add(key)
            if node is not None and node.started:
                if node in frames:  # close it, and any call inside it that never ended
                    del frames[frames.index(node) :]
            else:
                node = nodes[key] = _Node(key)
                _adopt_ended(frames[-1], node, ancestors)
    _set_depths(top)

    first_call: dict[str, _Node] = {}
    for key, node in nodes.items():
        first_call.setdefault(key[2], node)
    depth, parent, parent_call = [], [], []
    for i in range(len(rows)):
        node = nodes.get((int(micro[i]), str(phases[i]), str(modules[i]), int(calls[i])))
        if node is None or PASSES.get(kinds[i]) == "params" or kinds[i] == "grad_param":
            node = first_call.get(str(modules[i]))
        if node is None:  # never called in this step: where the module hierarchy puts it
            chain = ancestors(str(modules[i]))
            depth.append(len(chain))
            parent.append(chain[0] if chain else "")
            parent_call.append(-1)
            continue
        up = node.parent
        depth.append(node.depth)
        parent.append(up.key[2] if up is not None and up.key is not None else "")
        parent_call.append(up.key[3] if up is not None and up.key is not None else -1)
    rows["depth"] = np.array(depth, dtype=np.int32)
    rows["parent"] = parent
    rows["parent_call"] = np.array(parent_call, dtype=np.int32)
    return {key for key, node in nodes.items() if node.children}


def _adopt_into(frame: _Node, node: _Node) -> _Node:
    frame.children.append(node)
    node.parent = frame
    return node


def _adopt_ended(frame: _Node, node: _Node, ancestors: _Ancestors) -> None:
    """``node`` ended without having been seen to start: it takes, from the end of the open
    frame's children, the calls of the same pass whose modules lie below its own (and watched
    tensors between them)."""
    assert node.key is not None
    micro_step, phase, module, _ = node.key
    children = frame.children
    start = len(children)
    for i in range(len(children) - 1, -1, -1):
        child = children[i]
        assert child.key is not None
        if child.key[0] != micro_step or child.key[1] != phase:
            break
        if not ancestors.known(child.key[2]):  # a watched tensor: goes with its neighbours
            continue
        if module not in ancestors(child.key[2]):
            break
        start = i
    adopted = children[start:]
    del children[start:]
    for child in adopted:
        _adopt_into(node, child)
    _adopt_into(frame, node)


def _set_depths(top: _Node) -> None:
    stack = [(child, 0) for child in top.children]
    while stack:
        node, depth = stack.pop()
        node.depth = depth
        if node.parent is top:
            node.parent = None
        stack.extend((child, depth + 1) for child in node.children)


class _Ancestors:
    """A module's enclosing modules by ``Trace.modules``'s ``parent``, nearest first."""

    def __init__(self, parents: dict[str, str]) -> None:
        self.parents = parents
        self._cache: dict[str, tuple[str, ...]] = {}

    def known(self, module: str) -> bool:
        return module in self.parents

    def __call__(self, module: str) -> tuple[str, ...]:
        cached = self._cache.get(module)
        if cached is None:
            chain: list[str] = []
            up = self.parents.get(module, "")
            while up and up not in chain and up != module:
                chain.append(up)
                up = self.parents.get(up, "")
            cached = self._cache[module] = tuple(chain)
        return cached


def _static_parents(trace: Traced, rank: int) -> dict[str, str]:
    modules = trace.modules
    if modules.empty:
        return {}
    mine = modules[modules["rank"].astype(int) == rank]
    return dict(zip(mine["module"].astype(str), mine["parent"].astype(str), strict=True))


# -- gains --------------------------------------------------------------------------------


def _gains(rows: pd.DataFrame, containers: set[Key]) -> np.ndarray:
    """Each event's root mean square over that of what it came from.

    An output compares with its call's first input when the call ran no recorded call
    inside it and its inputs were recorded; otherwise with the forward event just before the
    call's first output (the last thing that happened inside it, or, for a leaf without
    inputs, the output it most likely consumed). Every slot of a call compares with the same
    reference. A watched tensor compares with the forward event before it; a gradient with
    the gradient that arrived before it in the same micro-step.
    """
    numel = rows["numel"].to_numpy(dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        rms = rows["norm"].to_numpy(dtype=float) / np.sqrt(numel)
    floating = rows["dtype"].str.contains("float|complex", regex=True).to_numpy()
    usable = floating & np.isfinite(rms) & (numel > 0)
    kinds = rows["kind"].to_numpy()
    keys: list[Key] = list(
        zip(rows["micro_step"], rows["phase"], rows["module"], rows["call"], strict=True)
    )
    first_input: dict[Key, float] = {}
    reference: dict[Key, float | None] = {}  # a call's, fixed at its first output row
    previous: dict[tuple[object, ...], float] = {}  # (pass, micro_step, phase) -> last rms
    gains = np.full(len(rows), np.nan)
    for i, kind in enumerate(kinds):
        key = keys[i]
        stream = (PASSES.get(kind), key[0], key[1])
        if kind == "output":
            if key not in reference:
                own = None if key in containers else first_input.get(key)
                reference[key] = own if own is not None else previous.get(stream)
            ref = reference[key]
        elif kind in ("tensor", "grad_output", "grad_tensor"):
            ref = previous.get(stream)
        else:
            ref = None
        if not usable[i]:
            continue
        if ref is not None and ref > 0:
            gains[i] = rms[i] / ref
        if kind == "input":
            first_input.setdefault(key, rms[i])
        if kind in ("input", "output", "tensor", "grad_output", "grad_tensor"):
            previous[stream] = rms[i]
    return gains


def _no_step(trace: Traced, step: int, rank: int) -> str:
    steps = trace.steps
    if not steps.empty:
        steps = steps[steps["rank"].astype(int) == rank]
        recorded = sorted(int(s) for s in steps["step"])
    else:
        recorded = sorted(
            int(s) for s in trace.query(columns=["step"], ranks=[rank])["step"].unique()
        )
    if step in recorded and trace.skipped:
        return (
            f"step {step} of {trace.path} (rank {rank}) was recorded, but its records are in a "
            f"damaged part, left out: `hooktrace check {trace.path}` says what was lost"
        )
    if not recorded:
        ranks = ", ".join(map(str, trace.ranks)) or "none"
        return f"{trace.path} has no records at rank {rank} (ranks: {ranks})"
    return (
        f"step {step} was not recorded in {trace.path} (rank {rank}): it has steps "
        f"{spans(recorded)}"
    )
