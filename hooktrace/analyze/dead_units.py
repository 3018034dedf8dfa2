"""Dead ReLU units: :func:`dead_relus`. Never imports torch.

Works from the per-unit activity the recorder keeps for every activation (how many values of
each unit were positive, out of ``unit_size``), so statistics-only traces are enough. Units are
channels of (N, C, ...) activations and features otherwise, as the recorder counted them.

Definitions (per layer: a ReLU-family module, and its call index when it is called more than
once per micro-step, e.g. one ``nn.ReLU`` shared by several layers):

- a unit's activity at a step is its positive count over its value count, summed over that
  step's records: every call of the same width, every micro-step and every rank; records
  holding NaN are left out (a NaN is not a unit at rest), with a note;
- a unit is *dead* when its activity stayed below ``threshold`` at every recorded step from
  some step to the last one, for at least ``min_steps`` recorded steps (or all of them, in a
  shorter run); that first step is its ``since``;
- a layer is *flagged* when its dead fraction passes ``layer_threshold``.

Memory stays bounded: steps are read in chunks, only the metadata of ReLU outputs, each HDF5
segment once per chunk, and the per-unit state is a few arrays per layer, whatever the
number of steps.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import (
    Finding,
    StepsSpec,
    findings_frame,
    fmt,
    modules_of_type,
    step_chunks,
    step_filter,
)
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace.reader import Trace, load

RELU_FAMILY = ("ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "Threshold")
"""Class names (the last component of the module's type) that dead-unit analysis covers."""

LAYER_DTYPES = {
    "module": "str", "call": "int64", "type": "str", "units": "int64", "dead": "int64",
    "dead_fraction": "float64", "flagged": "bool", "since": "Int64", "last_since": "Int64",
    "activity": "float64", "steps": "int64", "first_step": "int64", "last_step": "int64",
}  # fmt: skip
UNIT_DTYPES = {
    "module": "str", "call": "int64", "unit": "int64", "activity": "float64", "since": "int64",
    "dead_steps": "int64",
}  # fmt: skip

LayerKey = tuple[str, int, int]  # module, call, units
Pending = dict[LayerKey, dict[int, tuple[np.ndarray, int]]]


@dataclass
class DeadUnits:
    """The result of :func:`dead_relus`.

    ``layers``: one row per ReLU layer, worst first: module, call, type, units, dead,
    dead_fraction, flagged, since (the first step a currently dead unit died), last_since (the
    last), activity (the layer's mean activity over the steps read), steps, first_step,
    last_step. ``units``: one row per dead unit: module, call, unit, activity, since,
    dead_steps (recorded steps it has been dead).
    """

    layers: pd.DataFrame
    units: pd.DataFrame
    threshold: float
    layer_threshold: float
    notes: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> pd.DataFrame:
        return self.layers[self.layers["flagged"]].reset_index(drop=True)

    def findings(self) -> pd.DataFrame:
        """The flagged layers as findings (kind ``dead_layer``, severity ``warning``)."""
        found = [
            Finding(
                kind="dead_layer",
                severity="warning",
                module=str(row["module"]),
                step=int(row["since"]),
                last_step=int(row["last_step"]),
                evidence=(
                    f"{row['dead']} of {row['units']} units dead ({row['dead_fraction']:.0%}), "
                    f"since step {row['since']}"
                    + (
                        f" (the last from {row['last_since']})"
                        if row["last_since"] != row["since"]
                        else ""
                    )
                ),
                explanation=(
                    f"these units were positive in under {fmt(self.threshold)} of their values "
                    "through the last step: they pass no signal and get no gradient"
                ),
                value=float(row["dead_fraction"]),
                reference=self.layer_threshold,
                count=int(row["dead"]),
            )
            for row in self.flagged.to_dict("records")
        ]
        return findings_frame(found)

    def __len__(self) -> int:
        return len(self.flagged)

    def __repr__(self) -> str:
        dead = int(self.layers["dead"].sum()) if not self.layers.empty else 0
        return (
            f"<DeadUnits: {len(self.layers)} ReLU layers, {dead} dead units, "
            f"{len(self.flagged)} layers flagged (threshold {fmt(self.threshold)}, layer "
            f"threshold {fmt(self.layer_threshold)})>"
        )


def dead_relus(
    run: str | os.PathLike[str] | Trace,
    *,
    threshold: float = 1e-3,
    layer_threshold: float = 0.25,
    min_steps: int = 3,
    steps: StepsSpec = None,
    phases: Iterable[str] | None = ("train",),
    chunk_rows: int = 250_000,
) -> DeadUnits:
    """Dead units of every ReLU-family module of ``run`` (see the module docstring).

    ``threshold``: a unit active (positive) in less than this fraction of its values at a step
    is below it. ``layer_threshold``: a layer is flagged when its dead fraction passes this.
    ``min_steps``: how many recorded steps a unit must have stayed below to count as dead.
    ``steps``: which steps to read (``"0-100"``, ``(first, last)`` or step numbers).
    ``phases``: train only by default (eval batches differ); None reads every phase.
    ``chunk_rows``: steps are read in chunks of about this many records (of all kinds).
    """
    if not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a fraction in (0, 1] (got {threshold})")
    if not 0 <= layer_threshold < 1:
        raise ConfigError(f"layer_threshold must be a fraction in [0, 1) (got {layer_threshold})")
    if min_steps < 1:
        raise ConfigError(f"min_steps must be 1 or more (got {min_steps})")
    trace = run if isinstance(run, Trace) else load(run)
    types = modules_of_type(trace.modules, RELU_FAMILY)
    result = DeadUnits(_empty_layers(), _empty_units(), threshold, layer_threshold)
    if not types:
        result.notes.append("the trace has no ReLU-family modules (" + ", ".join(RELU_FAMILY) + ")")
        return result
    states: dict[LayerKey, _LayerState] = {}
    with_nan = 0
    for chunk in step_chunks(trace, step_filter(steps), chunk_rows):
        rows = trace.query(
            columns=["step", "module", "call", "units", "unit_size", "activity_offset", "segment",
                     "nan_count"],
            modules=sorted(types),
            kinds=["output"],
            phases=list(phases) if phases is not None else None,
            steps=chunk,
        )  # fmt: skip
        nan = rows["nan_count"].fillna(0).to_numpy() > 0
        with_nan += int((nan & (rows["units"] > 0).to_numpy()).sum())
        rows = rows[(rows["units"] > 0).to_numpy() & ~nan]
        if not rows.empty:
            _scan(trace, rows, threshold, states)
    if with_nan:
        result.notes.append(
            f"{with_nan} ReLU output record(s) holding NaN were left out (NaN is not inactivity): "
            "see `hooktrace anomalies`"
        )
    if not states:
        result.notes.append(
            "no per-unit activity was recorded for the ReLU outputs in the steps read"
        )
        return result
    layers, units = _tables(states, types, min_steps, layer_threshold)
    result.layers, result.units = layers, units
    return result


class _LayerState:
    """Running per-unit state of one layer, updated one step at a time in step order."""

    def __init__(self, units: int) -> None:
        self.positive = np.zeros(units, dtype=np.int64)
        self.values = 0
        self.since = np.full(units, -1, dtype=np.int64)  # start of the current run below
        self.run = np.zeros(units, dtype=np.int64)  # recorded steps in that run
        self.steps = 0
        self.first_step = self.last_step = -1

    def update(
        self, steps: np.ndarray, positive: np.ndarray, values: np.ndarray, threshold: float
    ) -> None:
        """Steps in increasing order; ``positive`` (steps, units); ``values`` (steps,)."""
        self.positive += positive.sum(axis=0)
        self.values += int(values.sum())
        below = positive < threshold * values[:, None]
        n = len(steps)
        # the last step of this block at which each unit was above (-1: none)
        above_at = np.where(~below, np.arange(n)[:, None], -1).max(axis=0)
        fresh = above_at >= 0
        trailing = n - 1 - above_at  # steps below after the last step above
        start = np.minimum(above_at + 1, n - 1)
        self.since = np.where(
            fresh,
            np.where(trailing > 0, steps[start], -1),
            np.where(self.since >= 0, self.since, steps[0]),
        )
        self.run = np.where(fresh, trailing, self.run + n)
        self.first_step = int(steps[0]) if self.steps == 0 else self.first_step
        self.last_step = int(steps[-1])
        self.steps += n


def _scan(
    trace: Trace, rows: pd.DataFrame, threshold: float, states: dict[LayerKey, _LayerState]
) -> None:
    """Fold the activity of ``rows`` (whole steps, after every step already in ``states``)
    into ``states``, one segment at a time, in step order (all ranks together)."""
    rows = rows.assign(module=rows["module"].astype(str), segment=rows["segment"].astype(str))
    segments = rows.groupby("segment", sort=False)["step"].min().sort_values(kind="stable")
    order = list(segments.index)
    # layer -> step -> (positive counts, value count), for steps later segments may add to
    pending: Pending = defaultdict(dict)
    by_segment = dict(tuple(rows.groupby("segment", sort=False)))
    for i, segment in enumerate(order):
        part = by_segment[segment]
        horizon = int(segments.iloc[i + 1]) if i + 1 < len(order) else None
        counts = _activity_block(trace, segment, part)
        # rows by layer, then step: each layer's rows one contiguous run
        layer = pd.MultiIndex.from_arrays(
            [part["module"], part["call"], part["units"]]
        ).factorize()[0]
        steps = part["step"].to_numpy()
        order_rows = np.lexsort((steps, layer))
        layer, steps = layer[order_rows], steps[order_rows]
        counts = counts[order_rows]
        unit_size = part["unit_size"].to_numpy()[order_rows]
        modules = part["module"].to_numpy()[order_rows]
        calls = part["call"].to_numpy()[order_rows]
        units_of = part["units"].to_numpy()[order_rows]
        starts = np.flatnonzero(np.r_[True, layer[1:] != layer[:-1]])
        ends = np.r_[starts[1:], len(layer)]
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True):
            units = int(units_of[start])
            key = (str(modules[start]), int(calls[start]), units)
            reduced = _per_step(steps[start:end], counts[start:end, :units], unit_size[start:end])
            held = pending.get(key)
            if not held and (horizon is None or int(steps[end - 1]) < horizon):
                # the usual case: no step of this layer is waiting on another segment
                state = states.get(key) or states.setdefault(key, _LayerState(units))
                state.update(*reduced, threshold)
                continue
            for step, positive, values in zip(*reduced, strict=True):
                before = pending[key].get(step)
                pending[key][step] = (
                    (positive, values)
                    if before is None
                    else (before[0] + positive, before[1] + values)
                )
        _finalize(pending, states, horizon, threshold)


def _activity_block(trace: Trace, segment: str, part: pd.DataFrame) -> np.ndarray:
    """The per-unit counts of ``part``'s rows, one row each, as wide as the widest (a row
    of fewer units has garbage past them, never read)."""
    width = int(part["units"].max())
    merged = trace.activity_array(segment)
    offsets = part["activity_offset"].to_numpy()
    if (offsets < 0).any() or int((offsets + part["units"].to_numpy()).max()) > len(merged):
        raise TraceError(
            f"records point past the end of the activity of segment {segment}: run "
            "`hooktrace check`"
        )
    index = np.minimum(offsets[:, None] + np.arange(width), len(merged) - 1)
    return merged[index]


def _per_step(
    steps: np.ndarray, block: np.ndarray, unit_size: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sum the rows of ``block`` that share a step (calls, micro-steps): the steps in order,
    the positive counts (steps, units) and the values counted per step."""
    if len(steps) < 2 or (steps[1:] > steps[:-1]).all():  # a row a step, in order: as is
        return steps.astype(np.int64), block, unit_size.astype(np.int64)
    order = np.argsort(steps, kind="stable")
    steps, block, unit_size = steps[order], block[order], unit_size[order]
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    positive = np.add.reduceat(block, starts, axis=0)
    values = np.add.reduceat(unit_size, starts)
    return steps[starts].astype(np.int64), positive, values.astype(np.int64)


def _finalize(
    pending: Pending,
    states: dict[LayerKey, _LayerState],
    horizon: int | None,
    threshold: float,
) -> None:
    """Fold every pending step before ``horizon`` (all of them when None) into the states."""
    for key, by_step in pending.items():
        ready = sorted(s for s in by_step if horizon is None or s < horizon)
        if not ready:
            continue
        positive = np.stack([by_step[s][0] for s in ready])
        values = np.array([by_step[s][1] for s in ready], dtype=np.int64)
        state = states.get(key) or states.setdefault(key, _LayerState(key[2]))
        state.update(np.array(ready, dtype=np.int64), positive, values, threshold)
        for s in ready:
            del by_step[s]


def _tables(
    states: dict[LayerKey, _LayerState],
    types: dict[str, str],
    min_steps: int,
    layer_threshold: float,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    layer_rows = []
    unit_frames = []
    for (module, call, units), state in states.items():
        needed = min(min_steps, state.steps)
        dead = (state.since >= 0) & (state.run >= needed)
        activity = state.positive / max(state.values, 1)
        n_dead = int(dead.sum())
        since = state.since[dead]
        layer_rows.append(
            {
                "module": module,
                "call": call,
                "type": types.get(module, ""),
                "units": units,
                "dead": n_dead,
                "dead_fraction": n_dead / units,
                "flagged": n_dead / units > layer_threshold,
                "since": int(since.min()) if n_dead else None,
                "last_since": int(since.max()) if n_dead else None,
                "activity": float(activity.mean()),
                "steps": state.steps,
                "first_step": state.first_step,
                "last_step": state.last_step,
            }
        )
        if n_dead:
            index = np.flatnonzero(dead)
            unit_frames.append(
                pd.DataFrame(
                    {
                        "module": module,
                        "call": call,
                        "unit": index,
                        "activity": activity[index],
                        "since": since,
                        "dead_steps": state.run[index],
                    }
                )
            )
    layers = pd.DataFrame(layer_rows, columns=list(LAYER_DTYPES)).astype(LAYER_DTYPES)
    layers = layers.sort_values(
        ["dead_fraction", "dead", "module", "call"],
        ascending=[False, False, True, True],
        kind="stable",
    ).reset_index(drop=True)
    units_table = pd.concat(unit_frames, ignore_index=True) if unit_frames else _empty_units()
    return layers, units_table.astype(UNIT_DTYPES)


def _empty_layers() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in LAYER_DTYPES.items()})


def _empty_units() -> pd.DataFrame:
    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in UNIT_DTYPES.items()})
