"""Records per step from the steps table, where the records parts' footers agree: what a
question that needs only counts reads instead of the records. Never imports torch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from hooktrace.trace.reader import Trace


def records_per_step(trace: Trace) -> pd.DataFrame | None:
    """``rank``, ``step`` and ``records`` of every (rank, step) that has records, from the
    steps table, where it agrees with the parts' footers: every records part's rows are the
    records its steps' rows count (a flush writes whole steps and their rows together). None
    where they disagree (a part lost, a steps part damaged): then only the records say."""
    spans = trace.part_spans()
    spans = spans[spans["records"] > 0]  # an empty part holds no step, and no statistics
    table = trace.steps
    if spans.empty or table.empty or (spans["first"] < 0).any():
        return None
    listed = table[table["records"] > 0]
    found: list[pd.DataFrame] = []
    for rank, mine in spans.groupby("rank"):
        mine = mine.sort_values("first")
        if (mine["first"].to_numpy()[1:] <= mine["last"].to_numpy()[:-1]).any():
            return None  # parts of one rank overlap: not as the writer writes them
        steps = listed.loc[listed["rank"] == rank, ["rank", "step", "records"]]
        part = np.searchsorted(mine["first"].to_numpy(), steps["step"].to_numpy(), "right") - 1
        inside = (part >= 0) & (steps["step"].to_numpy() <= mine["last"].to_numpy()[part])
        counted = np.bincount(part[inside], steps["records"].to_numpy()[inside], len(mine))
        if not np.array_equal(counted, mine["records"].to_numpy()):
            return None
        found.append(steps.loc[inside])
    if not found:
        return None
    return pd.concat(found, ignore_index=True).astype("int64")
