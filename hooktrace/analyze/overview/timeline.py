"""A step's timeline for the analyses: :func:`timeline` of a trace or a run directory, and
:func:`largest_jumps`, the events whose size changed most. Never imports torch.

The timeline itself (execution order, nesting, gains) is made in
:mod:`hooktrace.trace.timeline`, beside the reader, because ``Trace.timeline()`` returns it;
its module docstring says how nesting and gains are found.
"""

from __future__ import annotations

import os

import numpy as np
import pandas as pd

from hooktrace.trace.reader import Trace, load
from hooktrace.trace.timeline import spans

__all__ = ["largest_jumps", "spans", "timeline"]


def timeline(
    trace: Trace | str | os.PathLike[str],
    step: int,
    *,
    micro_step: int | None = None,
    rank: int = 0,
) -> pd.DataFrame:
    """The events of ``step`` (one rank) in execution order, one row per record: what
    :meth:`Trace.timeline <hooktrace.trace.reader.Trace.timeline>` returns, for a
    :class:`Trace` or the path of a run. Raises :class:`TensorNotRecorded` naming the steps
    that exist."""
    trace = trace if isinstance(trace, Trace) else load(trace)
    return trace.timeline(step, micro_step=micro_step, rank=rank)


def largest_jumps(frame: pd.DataFrame, *, top: int = 3, min_factor: float = 2.0) -> pd.DataFrame:
    """The ``top`` events of a timeline whose ``gain`` is furthest from 1, of those that grew
    or shrank by at least ``min_factor``; largest first."""
    gain = frame["gain"]
    with np.errstate(divide="ignore", invalid="ignore"):
        size = np.abs(np.log10(gain.to_numpy(dtype=float)))
    ranked = frame.assign(_size=size)
    ranked = ranked[np.isfinite(size) & (size >= np.log10(min_factor))]
    return (
        ranked.sort_values("_size", ascending=False, kind="stable").head(top).drop(columns="_size")
    )
