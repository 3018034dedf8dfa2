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
segment once, and the state is a few numbers per unit, whatever the number of steps. Layers
read at the same steps (usually all of them) are updated together, in one numpy operation.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import pyarrow as pa

from hooktrace.analyze.checks.unit_state import LayerKey, UnitState
from hooktrace.analyze.findings import (
    Finding,
    StepsSpec,
    codes,
    findings_frame,
    fmt,
    modules_of_type,
    step_chunks,
    step_filter,
)
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace.logical import NEEDED
from hooktrace.trace.logical_arrays import parts
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
    relu_modules: int = 0
    """ReLU-family modules the trace holds (those with activity in the steps read or not)."""

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
    ranks: Iterable[int] | None = None,
) -> DeadUnits:
    """Dead units of every ReLU-family module of ``run`` (see the module docstring).

    ``threshold``: a unit active (positive) in less than this fraction of its values at a step
    is below it. ``layer_threshold``: a layer is flagged when its dead fraction passes this.
    ``min_steps``: how many recorded steps a unit must have stayed below to count as dead.
    ``steps``: which steps to read (``"0-100"``, ``(first, last)`` or step numbers).
    ``phases``: train only by default (eval batches differ); None reads every phase.
    ``chunk_rows``: steps are read in chunks of about this many records (of all kinds).
    In a run of several ranks, a unit's counts are summed over the data-parallel ranks'
    parts of the batch; where the recording told each rank's data-parallel place (DDP,
    FSDP2), tensor-parallel peers' parts of an output are its units side by side, in rank
    order, and a replica counts once (:func:`activity_rows`). ``ranks``: only these ranks'
    records (one rank: its own units).
    """
    if not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a fraction in (0, 1] (got {threshold})")
    if not 0 <= layer_threshold < 1:
        raise ConfigError(f"layer_threshold must be a fraction in [0, 1) (got {layer_threshold})")
    if min_steps < 1:
        raise ConfigError(f"min_steps must be 1 or more (got {min_steps})")
    trace = run if isinstance(run, Trace) else load(run)
    types = modules_of_type(trace.modules, RELU_FAMILY)
    result = DeadUnits(
        _empty_layers(), _empty_units(), threshold, layer_threshold, relu_modules=len(types)
    )
    if not types:
        result.notes.append("the trace has no ReLU-family modules (" + ", ".join(RELU_FAMILY) + ")")
        return result
    state = UnitState()
    arrays: dict[str, np.ndarray] = {}  # the activity of the segments the last chunk read
    with_nan = 0
    for chunk in step_chunks(trace, step_filter(steps), chunk_rows):
        rows = activity_rows(
            trace, modules=sorted(types), phases=phases, steps=chunk,
            ranks=None if ranks is None else [int(r) for r in ranks],
        )  # fmt: skip
        nan = rows["nan"].to_numpy()
        with_nan += int((nan & (rows["units"] > 0).to_numpy()).sum())
        rows = rows[(rows["units"] > 0).to_numpy() & ~nan]
        if not rows.empty:
            _scan(trace, rows, threshold, state, arrays)
    if with_nan:
        result.notes.append(
            f"{with_nan} ReLU output record(s) holding NaN were left out (NaN is not inactivity): "
            "see `hooktrace anomalies`"
        )
    if not state.keys:
        result.notes.append(
            "no per-unit activity was recorded for the ReLU outputs in the steps read"
        )
        return result
    layers, units = _tables(state, types, min_steps, layer_threshold)
    result.layers, result.units = layers, units
    return result


ACTIVITY_COLUMNS = ("step", "module", "call", "units", "unit_size", "activity_offset", "segment")


def activity_rows(
    trace: Trace,
    *,
    modules: list[str],
    phases: Iterable[str] | None,
    steps: list[int] | tuple[int, int] | None,
    ranks: list[int] | None = None,
) -> pd.DataFrame:
    """The output records of ``modules`` at ``steps`` whose per-unit activity is summed into
    a layer's: :data:`ACTIVITY_COLUMNS`, ``nan`` (the record, or its logical tensor, holds a
    NaN: left out), ``inf``, ``base`` (where its units begin among the layer's) and
    ``own_units`` (its own, from there); ``units`` is the layer's width.

    The records as they are, their units from 0 (``base`` 0), where ``ranks`` chooses one,
    in a run of one rank, and where the recording did not tell the ranks' data-parallel
    places (DDP, FSDP2, tensor parallelism: a unit's counts are then summed over every
    rank). Else the parts of the logical records of every rank (or of ``ranks``')
    (:func:`hooktrace.trace.logical_arrays.parts`): a replica once; the
    data-parallel ranks' parts of the batch summed; tensor-parallel peers' parts (the local
    shards tensor parallelism hands between its layers) side by side, in rank order, their
    values counted once (``unit_size`` 0 but the first's)."""
    one_rank = len(trace.ranks) < 2 or (ranks is not None and len(set(ranks)) == 1)
    layout = None if one_rank else trace.layout
    chosen = list(phases) if phases is not None else None
    if layout is None:
        rows = trace.query(
            columns=[*ACTIVITY_COLUMNS, "nan_count", "inf_count"], modules=modules,
            kinds=["output"], phases=chosen, steps=steps, ranks=ranks, logical=False,
        )  # fmt: skip
        return rows.assign(
            nan=rows["nan_count"].fillna(0).to_numpy() > 0,
            inf=rows["inf_count"].fillna(0).to_numpy() > 0,
            base=0,
            own_units=rows["units"].to_numpy(),
        ).drop(columns=["nan_count", "inf_count"])
    table = trace.query_table(
        columns=list(dict.fromkeys([*ACTIVITY_COLUMNS, *NEEDED])), modules=modules,
        kinds=["output"], phases=chosen, steps=steps, ranks=ranks,
    )  # fmt: skip
    at, record, dp_rank = parts(table, layout)
    rows = table.take(pa.array(at)).select(list(ACTIVITY_COLUMNS)).to_pandas()
    nan, inf = (np.nan_to_num(table.column(c).to_numpy(zero_copy_only=False)[at]) > 0
                for c in ("nan_count", "inf_count"))  # fmt: skip
    peers = pd.DataFrame({"record": record, "dp": dp_rank, "units": rows["units"].to_numpy()})
    by_peers = peers.groupby(["record", "dp"], sort=False)["units"]
    base = (by_peers.cumsum() - peers["units"]).to_numpy()  # rows come in rank order
    width = by_peers.transform("sum").groupby(peers["record"]).transform("max").to_numpy()
    first = by_peers.cumcount().to_numpy() == 0
    any_of = peers.assign(nan=nan, inf=inf).groupby("record")[["nan", "inf"]].transform("any")
    return rows.assign(
        units=width,
        unit_size=np.where(first, rows["unit_size"].to_numpy(), 0),
        nan=any_of["nan"].to_numpy(),
        inf=any_of["inf"].to_numpy(),
        base=base,
        own_units=peers["units"].to_numpy(),
    )


def _scan(
    trace: Trace,
    rows: pd.DataFrame,
    threshold: float,
    state: UnitState,
    arrays: dict[str, np.ndarray],
) -> None:
    """Fold the activity of ``rows`` (whole steps, after every step already in ``state``)
    into ``state``, one segment at a time, in step order (all ranks together). ``arrays``
    keeps the activity of the segments read, for the next chunk: a segment is read once."""
    segment, segment_names = codes(rows["segment"])
    module, module_names = codes(rows["module"])
    step, call, units = (rows[c].to_numpy().astype(np.int64) for c in ("step", "call", "units"))
    offsets = rows["activity_offset"].to_numpy().astype(np.int64)
    bases, own = (rows[c].to_numpy().astype(np.int64) for c in ("base", "own_units"))
    values = rows["unit_size"].to_numpy().astype(np.int64)
    layer = (module * (call.max() + 1) + call) * (units.max() + 1) + units  # module, call, width
    firsts = pd.Series(step).groupby(segment, sort=False).min().sort_values(kind="stable")
    order = firsts.index.to_numpy()
    for done in set(arrays) - {str(segment_names[c]) for c in order}:
        del arrays[done]
    # layer -> step -> (positive counts, value count), for steps later segments may add to
    pending: Pending = defaultdict(dict)
    for i, code in enumerate(order.tolist()):
        horizon = int(firsts.iloc[i + 1]) if i + 1 < len(order) else None
        mine = np.flatnonzero(segment == code)
        # by layer (numbered in the order they first appear), then step
        mine = mine[np.lexsort((step[mine], pd.factorize(layer[mine])[0]))]
        counts = _activity_block(
            trace, str(segment_names[code]), offsets[mine], own[mine], arrays, bases[mine],
            int(units[mine].max()),
        )  # fmt: skip
        # one row per layer and step: its calls and micro-steps summed
        lay, steps, sizes = layer[mine], step[mine], values[mine]
        first = np.flatnonzero(np.r_[True, (lay[1:] != lay[:-1]) | (steps[1:] != steps[:-1])])
        if len(first) < len(mine):
            counts = np.add.reduceat(counts, first, axis=0)
            sizes = np.add.reduceat(sizes, first)
        lay, steps, row = lay[first], steps[first], mine[first]
        starts = np.flatnonzero(np.r_[True, lay[1:] != lay[:-1]])
        ends = np.r_[starts[1:], len(lay)]
        keys = [
            (str(module_names[module[r]]), int(call[r]), int(units[r]))
            for r in row[starts].tolist()
        ]
        # the usual case: no step of the layer is waiting on another segment
        ready = np.array([not pending.get(key) for key in keys], dtype=bool)
        if horizon is not None:
            ready &= steps[ends - 1] < horizon
        for j in np.flatnonzero(~ready).tolist():
            key, width = keys[j], keys[j][2]
            for r in range(starts[j], ends[j]):
                before = pending[key].get(int(steps[r]))
                positive, value = counts[r, :width], int(sizes[r])
                pending[key][int(steps[r])] = (
                    (positive, value)
                    if before is None
                    else (before[0] + positive, before[1] + value)
                )
        taken = np.flatnonzero(ready)
        if len(taken):
            ids = state.ids([keys[j] for j in taken.tolist()])
            state.fold(ids, starts[taken], ends[taken], steps, counts, sizes, threshold)
        _finalize(pending, state, horizon, threshold)


def _activity_block(
    trace: Trace,
    segment: str,
    offsets: np.ndarray,
    units: np.ndarray,
    arrays: dict[str, np.ndarray],
    bases: np.ndarray,
    width: int,
) -> np.ndarray:
    """The per-unit counts of the records at ``offsets`` of ``units`` each, a row each,
    ``width`` wide (the widest layer's); a record's counts from column ``bases`` on (a part
    of a layer's units), zero elsewhere, so that the rows of one layer's parts add up."""
    merged = arrays.get(segment)
    if merged is None:
        merged = arrays[segment] = trace.activity_array(segment)
    if (offsets < 0).any() or int((offsets + units).max()) > len(merged):
        raise TraceError(
            f"records point past the end of the activity of segment {segment}: run "
            "`hooktrace check`"
        )
    columns = np.arange(max(width, int((bases + units).max())))
    within = columns - bases[:, None]
    inside = (within >= 0) & (within < units[:, None])
    return np.where(inside, merged.take(offsets[:, None] + within, mode="clip"), 0)


def _finalize(
    pending: Pending,
    state: UnitState,
    horizon: int | None,
    threshold: float,
) -> None:
    """Fold every pending step before ``horizon`` (all of them when None) into the state."""
    for key, by_step in pending.items():
        ready = sorted(s for s in by_step if horizon is None or s < horizon)
        if not ready:
            continue
        positive = np.stack([by_step[s][0] for s in ready])
        values = np.array([[by_step[s][1] for s in ready]], dtype=np.int64)
        steps = np.array(ready, dtype=np.int64)
        state.update(state.ids([key]), steps, positive, values, threshold)
        for s in ready:
            del by_step[s]


def _tables(
    state: UnitState,
    types: dict[str, str],
    min_steps: int,
    layer_threshold: float,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    layer_rows = []
    unit_frames = []
    for layer, (module, call, units) in enumerate(state.keys):
        mine = slice(int(state.offset[layer]), int(state.offset[layer]) + units)
        steps = int(state.steps[layer])
        run = state.run[mine]
        dead = (state.since[mine] >= 0) & (run >= min(min_steps, steps))
        activity = state.positive[mine] / max(int(state.values[layer]), 1)
        n_dead = int(dead.sum())
        since = state.since[mine][dead]
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
                "steps": steps,
                "first_step": int(state.first_step[layer]),
                "last_step": int(state.last_step[layer]),
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
                        "dead_steps": run[index],
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
