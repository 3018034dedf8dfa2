"""What a step's records say apart from their values: each record's :class:`Meta` in the hook,
and the columns built from them once, in the writer.

Most of what a step's records say (module, kind, slot, shape, ...) is the same from step to
step; the writer's time is not free on a 2-core machine (it runs beside the training's
second thread), so those columns are built once per :class:`Layout` and shared, and a step
adds its values only.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import torch

from hooktrace.trace.schema import NO_GRADIENT_DTYPE, NOTE_SKIPPED, RECORD_SCHEMA, SHARD_COLUMNS
from hooktrace.trace.step_data import arrow_strings


class Meta(NamedTuple):
    """What a hook knows about one record, kept as cheap Python values. A record's ``seq`` is
    its row in the step (the writer numbers them)."""

    micro_step: int
    phase: str
    module: str
    call: int
    kind: str
    slot: str
    dtype: torch.dtype | None  # None: a parameter with no gradient
    shape: tuple[int, ...]
    units: int
    unit_size: int
    note: str = ""  # schema's ``note``: why there are no statistics, or how they were taken
    shard: tuple[str, str, str, str, str] | None = None  # schema's SHARD_COLUMNS; None: whole


MetaRow = tuple[
    int, str, str, int, str, str, torch.dtype | None, tuple[int, ...], int, int, str,
    tuple[str, str, str, str, str] | None,
]  # fmt: skip
"""A record's :class:`Meta` as a step holds it: a Meta, or, as the hooks make them, a plain
tuple of its fields in order. Python's collector stops tracking a plain tuple of plain
values at its first look, and tracks a NamedTuple for as long as it lives: a step's records
alive at a collection of the second generation were each counted towards the next full
one, which took 350 to 450 ms every hundred steps on the 200-layer benchmark, 2026-11-30."""


class Layout:
    """The columns of a step's records that do not depend on the values recorded: where each
    record comes from (module, call, kind, slot), what it holds (dtype, shape, units) and its
    place in the step. Built once, shared by every step whose records line up the same way;
    the writer repeats them without rebuilding (``step_data.concat_columns``)."""

    def __init__(self, meta: list[MetaRow]) -> None:
        n = len(meta)
        (micro_step, phase, module, call, kind, slot, dtype, shape, units, unit_size, note,
         shard) = zip(*meta, strict=True) if n else ((),) * len(Meta._fields)  # fmt: skip
        self.rows = n
        self.numel = np.array(
            [_numel(s) if d is not None else 0 for s, d in zip(shape, dtype, strict=True)],
            dtype=np.int64,
        )
        strings = {
            "phase": list(phase),
            "module": list(module),
            "kind": list(kind),
            "slot": list(slot),
            "dtype": [dtype_name(d) for d in dtype],
            "shape": [shape_text(s) for s in shape],
            "note": list(note),
        }
        whole = ("",) * len(SHARD_COLUMNS)  # a tensor that is no shard
        shards = list(zip(*(s or whole for s in shard), strict=True)) if n else [()] * len(whole)
        for name, column in zip(SHARD_COLUMNS, shards, strict=True):
            strings[name] = list(column)
        self.columns: dict[str, Any] = {
            "micro_step": np.array(micro_step, dtype=np.int32),
            "seq": np.arange(n, dtype=np.int64),  # the order the hooks saw the records in
            "call": np.array(call, dtype=np.int32),
            "numel": self.numel,
            "units": np.array(units, dtype=np.int32),
            "unit_size": np.array(unit_size, dtype=np.int64),
        }
        for name, values in strings.items():
            self.columns[name] = arrow_strings(values, RECORD_SCHEMA.field(name).type)
        self.no_specs = arrow_strings([""] * n, pa.string())  # call_spec where none was saved
        # records of tensors that were not summarised: no statistics, zero counts unknown
        self.skipped = np.array([s.startswith(NOTE_SKIPPED) for s in note], dtype=bool)


class Layouts:
    """The layouts of recent steps, by their records' :class:`Meta`: a training loop
    alternates between a few (a training step, an evaluation pass)."""

    def __init__(self, keep: int = 8) -> None:
        self._keep = keep
        self._recent: OrderedDict[tuple[MetaRow, ...], Layout] = OrderedDict()
        self._last: tuple[list[MetaRow], Layout] | None = None  # the last found, and its records
        self._lock = threading.Lock()  # materialize() normally runs in the writer thread only
        self.built = 0  # layouts built, over the cache's life

    def of(self, meta: list[MetaRow]) -> Layout:
        last = self._last
        # most steps line up as the one before: compared in order, without hashing the
        # records (many of which are the very objects of the step before: parameters')
        if last is not None and last[0] == meta:
            return last[1]
        key = tuple(meta)
        with self._lock:
            layout = self._recent.get(key)
            if layout is not None:
                self._recent.move_to_end(key)
                self._last = (meta, layout)
                return layout
        layout = Layout(meta)
        with self._lock:
            self.built += 1
            self._recent[key] = layout
            while len(self._recent) > self._keep:
                self._recent.popitem(last=False)
            self._last = (meta, layout)
        return layout


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


_DTYPE_NAMES: dict[torch.dtype, str] = {}
_SHAPE_TEXTS: dict[tuple[int, ...], str] = {}


def shape_text(shape: tuple[int, ...]) -> str:
    """'32,16,8,8': the shape column's form (remembered: the same shapes recur every step)."""
    text = _SHAPE_TEXTS.get(shape)
    if text is None:
        text = ",".join(map(str, shape))
        if len(_SHAPE_TEXTS) < 65536:
            _SHAPE_TEXTS[shape] = text
    return text


def dtype_name(dtype: torch.dtype | None) -> str:
    if dtype is None:
        return NO_GRADIENT_DTYPE
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name
