"""The running per-unit state of every ReLU-family layer that :func:`hooktrace.dead_relus`
reads (its module docstring has the definitions). Never imports torch.

The units of all layers lie end to end in a few flat arrays (a layer's from its ``offset``),
so that the layers read at the same steps, usually all of them, are updated together in one
numpy operation, whatever their number and widths.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

LayerKey = tuple[str, int, int]  # module, call, units


class UnitState:
    """Running per-unit state of every layer, updated in step order: the units of all layers
    end to end (a layer's from its ``offset``), so that layers read at the same steps are
    updated together, in one numpy operation."""

    def __init__(self) -> None:
        self.keys: list[LayerKey] = []
        self._ids: dict[LayerKey, int] = {}
        # per layer
        self.offset = np.zeros(0, dtype=np.int64)
        self.units = np.zeros(0, dtype=np.int64)
        self.values = np.zeros(0, dtype=np.int64)
        self.steps = np.zeros(0, dtype=np.int64)
        self.first_step = np.zeros(0, dtype=np.int64)
        self.last_step = np.zeros(0, dtype=np.int64)
        # per unit
        self.positive = np.zeros(0, dtype=np.int64)
        self.since = np.zeros(0, dtype=np.int64)  # start of the current run below (-1: none)
        self.run = np.zeros(0, dtype=np.int64)  # recorded steps in that run

    def ids(self, keys: list[LayerKey]) -> np.ndarray:
        """The layers' ids; layers not seen before are added, in the order given."""
        new = [key for key in dict.fromkeys(keys) if key not in self._ids]
        if new:
            units = np.array([key[2] for key in new], dtype=np.int64)
            for key in new:
                self._ids[key] = len(self.keys)
                self.keys.append(key)
            zeros, minus = np.zeros(len(new), dtype=np.int64), np.full(len(new), -1, dtype=np.int64)
            offset = int(self.units.sum()) + np.cumsum(units) - units
            self.offset = np.concatenate([self.offset, offset])
            self.units = np.concatenate([self.units, units])
            self.values = np.concatenate([self.values, zeros])
            self.steps = np.concatenate([self.steps, zeros])
            self.first_step = np.concatenate([self.first_step, minus])
            self.last_step = np.concatenate([self.last_step, minus])
            total = int(units.sum())
            self.positive = np.concatenate([self.positive, np.zeros(total, dtype=np.int64)])
            self.since = np.concatenate([self.since, np.full(total, -1, dtype=np.int64)])
            self.run = np.concatenate([self.run, np.zeros(total, dtype=np.int64)])
        return np.array([self._ids[key] for key in keys], dtype=np.int64)

    def update(
        self,
        layers: np.ndarray,
        steps: np.ndarray,
        positive: np.ndarray,
        values: np.ndarray,
        threshold: float,
    ) -> None:
        """``layers`` (L,) read at the same ``steps`` (n,), in increasing order, after every
        step already folded in; ``positive`` (n, U): their counts, the layers' units end to
        end; ``values`` (L, n): the values counted per layer and step."""
        units = self.units[layers]
        unit = np.arange(int(units.sum())) + np.repeat(
            self.offset[layers] - (np.cumsum(units) - units), units
        )
        self.positive[unit] += positive.sum(axis=0)
        self.values[layers] += values.sum(axis=1)
        limit = threshold * values.T  # (n, L)
        if (units == units[0]).all():  # one width: no need to repeat the limits per unit
            above = (positive.reshape(len(steps), len(units), -1) >= limit[:, :, None]).reshape(
                len(steps), -1
            )
        else:
            above = positive >= np.repeat(limit, units, axis=1)  # not below
        n = len(steps)
        # the last step of this block at which each unit was above (-1: none)
        fresh = above.any(axis=0)
        above_at = np.where(fresh, n - 1 - np.argmax(above[::-1], axis=0), -1)
        trailing = n - 1 - above_at  # steps below after the last step above
        start = np.minimum(above_at + 1, n - 1)
        since = self.since[unit]
        self.since[unit] = np.where(
            fresh,
            np.where(trailing > 0, steps[start], -1),
            np.where(since >= 0, since, steps[0]),
        )
        self.run[unit] = np.where(fresh, trailing, self.run[unit] + n)
        self.first_step[layers] = np.where(
            self.steps[layers] == 0, steps[0], self.first_step[layers]
        )
        self.last_step[layers] = steps[-1]
        self.steps[layers] += n

    def fold(
        self,
        ids: np.ndarray,
        starts: np.ndarray,
        ends: np.ndarray,
        steps: np.ndarray,
        counts: np.ndarray,
        values: np.ndarray,
        threshold: float,
    ) -> None:
        """Fold layers ``ids`` in: layer i's rows of ``counts`` (as wide as the widest
        layer) and ``values`` are ``starts[i]:ends[i]``, one per step of ``steps``, in order.
        Layers read at the same steps (usually all) are folded together."""
        lengths = ends - starts
        n = int(lengths[0])
        first = steps[starts[0] : starts[0] + n]
        if (lengths == n).all() and (steps[starts[:, None] + np.arange(n)] == first).all():
            groups = [np.arange(len(ids))]
        else:
            same: dict[bytes, list[int]] = defaultdict(list)
            for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
                same[steps[s:e].tobytes()].append(i)
            groups = [np.array(members) for members in same.values()]
        for members in groups:
            n = int(lengths[members[0]])
            at = starts[members][:, None] + np.arange(n)  # (L, n) rows
            units = self.units[ids[members]]
            mine = np.arange(counts.shape[1]) < units[:, None]  # (L, width): each layer's units
            block = counts[at.T]  # (n, L, width)
            positive = block.reshape(n, -1) if mine.all() else block[:, mine]  # (n, U)
            self.update(ids[members], steps[at[0]], positive, values[at], threshold)
