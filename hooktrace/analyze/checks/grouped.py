"""Reductions of rows grouped by integer keys, in numpy: what :func:`hooktrace.anomalies`
computes per chunk, without pandas' groupby. Never imports torch.

The groups come as ``DataFrame.groupby(keys, sort=True)`` makes them (in key order, each
group's rows in their order), and the float sums are pandas' own to the bit: Kahan's
compensated sum, row by row in that order, NaN left out (a compensation that turns NaN, by an
infinity, starts again from zero). So a result does not change with the way it is computed.
"""

from __future__ import annotations

import numpy as np


class Groups:
    """The rows of integer ``keys`` (arrays of one length), grouped; ``keys`` then holds each
    group's key values, in group order."""

    def __init__(self, *keys: np.ndarray) -> None:
        self.order = np.lexsort(keys[::-1])  # stable: a group's rows stay in their order
        ordered = [k[self.order] for k in keys]
        change = np.zeros(len(self.order), dtype=bool)
        change[:1] = True
        for k in ordered:
            change[1:] |= k[1:] != k[:-1]
        self.starts = np.flatnonzero(change)
        self.sizes = np.diff(np.r_[self.starts, len(self.order)])
        self.keys = [k[self.starts] for k in ordered]

    def __len__(self) -> int:
        return len(self.starts)

    def sum(self, values: np.ndarray) -> np.ndarray:
        """The sum of each group's values, NaN left out (0 for none), as pandas sums."""
        return self._kahan(values)[0]

    def mean(self, values: np.ndarray) -> np.ndarray:
        """The mean of each group's values, NaN left out (NaN for none), as pandas averages."""
        total, count = self._kahan(values)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(count > 0, total / np.maximum(count, 1), np.nan)

    def any(self, flags: np.ndarray) -> np.ndarray:
        return np.logical_or.reduceat(flags[self.order], self.starts) if len(self) else flags[:0]

    def count(self, flags: np.ndarray) -> np.ndarray:
        """How many of each group's ``flags`` are set."""
        ordered = flags[self.order].astype(np.int64)
        return np.add.reduceat(ordered, self.starts) if len(self) else ordered[:0]

    def min(self, values: np.ndarray) -> np.ndarray:
        return np.minimum.reduceat(values[self.order], self.starts) if len(self) else values[:0]

    def max(self, values: np.ndarray) -> np.ndarray:
        return np.maximum.reduceat(values[self.order], self.starts) if len(self) else values[:0]

    def count_distinct(self, values: np.ndarray) -> np.ndarray:
        """How many distinct ``values`` (integers) each group holds."""
        if not len(self):
            return np.zeros(0, dtype=np.int64)
        group = np.repeat(np.arange(len(self)), self.sizes)
        mine = values[self.order]
        by = np.lexsort((mine, group))
        group, mine = group[by], mine[by]
        new = np.r_[True, (group[1:] != group[:-1]) | (mine[1:] != mine[:-1])]
        return np.bincount(group[new], minlength=len(self)).astype(np.int64)

    def _kahan(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Kahan sums and counts of the non-NaN values, row by row in each group's order."""
        ordered = values[self.order].astype(np.float64)
        total = np.zeros(len(self))
        compensation = np.zeros(len(self))
        count = np.zeros(len(self), dtype=np.int64)
        for k in range(int(self.sizes.max()) if len(self) else 0):
            group = np.flatnonzero(self.sizes > k)  # the groups that have a k-th row
            value = ordered[self.starts[group] + k]
            keep = ~np.isnan(value)
            group, value = group[keep], value[keep]
            with np.errstate(invalid="ignore"):
                y = value - compensation[group]
                t = total[group] + y
                c = t - total[group] - y
            compensation[group] = np.where(np.isnan(c), 0.0, c)
            total[group] = t
            count[group] += 1
        return total, count
