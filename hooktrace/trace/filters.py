"""What a question to the reader reads: the pyarrow filter for ``Trace.query``'s arguments,
the step range that picks the parts to open, and whether the rows came back in order. Never
imports torch.

Apart from the reader because it is pure translation, from the arguments people pass to what
pyarrow pushes down, and the analyses that read many windows (``diff``) check order the same
way.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from hooktrace.errors import TraceError


def in_order(frame: pd.DataFrame, columns: list[str]) -> bool:
    """Whether the rows are sorted by ``columns`` already (as a part written in (step, seq)
    order reads back): sorting them again is most of a window's read."""
    if len(frame) < 2:
        return True
    keys = [frame[c].to_numpy() for c in columns]
    ahead = np.zeros(len(frame) - 1, dtype=bool)  # decided: this row is before the next
    for key in keys:
        before, after = key[:-1], key[1:]
        if ((before > after) & ~ahead).any():
            return False
        ahead |= before < after
    return True


STEP_MAX = 2**63 - 1
"""The largest step a trace can hold (an int64)."""


def step_pair(spec: object) -> tuple[int, int] | None:
    """``spec`` as a (first, last) pair of steps where it is a 2-tuple of integers (Python's
    or numpy's, as a DataFrame's ``min()`` and ``max()`` give them; not bools), else None."""
    if not isinstance(spec, tuple) or len(spec) != 2:
        return None
    if any(isinstance(v, bool | np.bool_) or not isinstance(v, int | np.integer) for v in spec):
        return None
    return int(spec[0]), int(spec[1])


def steps_given(
    steps: Iterable[int] | tuple[int, int] | None,
) -> list[int] | tuple[int, int] | None:
    """``steps`` as a list, unless a (first, last) range or None: a generator is read once.
    Raises TraceError for what names no steps (a string such as ``"0-10"``, a lone int)."""
    if steps is None:
        return None
    try:
        if isinstance(steps, str | bytes):
            raise TypeError
        chosen = [int(s) for s in steps]
    except (TypeError, ValueError):
        raise TraceError(
            f"steps takes step numbers, such as [3, 5], or an inclusive (first, last) pair, "
            f"such as (0, 10); not {steps!r}"
        ) from None
    return steps if isinstance(steps, tuple) and len(steps) == 2 else chosen  # a range as given


def row_filter(
    *,
    steps: Iterable[int] | tuple[int, int] | None = None,
    modules: Iterable[str] | None = None,
    kinds: Iterable[str] | None = None,
    ranks: Iterable[int] | None = None,
    phases: Iterable[str] | None = None,
) -> Any:
    """A dataset filter for every condition given (None: no condition)."""
    conditions = []
    if isinstance(steps, tuple) and len(steps) == 2:
        conditions.append((pc.field("step") >= steps[0]) & (pc.field("step") <= steps[1]))
    elif steps is not None:  # value sets typed: an empty one is then no row, not an error
        chosen = pa.array([int(s) for s in steps], pa.int64())
        conditions.append(pc.field("step").isin(chosen))
    for name, values in (("module", modules), ("kind", kinds), ("phase", phases)):
        if values is not None:
            value_set = pa.array([str(v) for v in values], pa.string())
            conditions.append(pc.field(name).cast(pa.string()).isin(value_set))
    if ranks is not None:
        conditions.append(pc.field("rank").isin(pa.array([int(r) for r in ranks], pa.int32())))
    expr = None
    for condition in conditions:
        expr = condition if expr is None else expr & condition
    return expr


def step_range(steps: Iterable[int] | tuple[int, int] | None) -> tuple[int, int] | None:
    """The steps' first and last, to pick the parts that may hold them (None: all)."""
    if steps is None:
        return None
    if isinstance(steps, tuple) and len(steps) == 2:
        return int(steps[0]), int(steps[1])
    chosen = [int(s) for s in steps]
    return (min(chosen), max(chosen)) if chosen else (1, 0)
