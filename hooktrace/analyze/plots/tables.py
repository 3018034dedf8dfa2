"""The tables behind the pictures of :mod:`hooktrace.analyze.plots.plots`. Never imports torch.

Each is a DataFrame of modules (rows, in the model's order) by recorded steps (columns),
for notebooks that draw their own. Where the recorded values held a NaN or an Inf, a cell is
inf; where nothing was recorded, NaN; in the diff table, where a record is in one run only,
-inf (:data:`ONE_RUN_ONLY`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np
import pandas as pd

from hooktrace.analyze.checks.dead_units import RELU_FAMILY, activity_rows
from hooktrace.analyze.findings import StepsSpec, modules_of_type, step_filter
from hooktrace.errors import ConfigError
from hooktrace.trace.reader import Trace, load

Run = str | os.PathLike[str] | Trace


def records_of(trace: Trace, rank: int | None, **query: Any) -> pd.DataFrame:
    """:meth:`Trace.query`'s records of ``rank``; with None, of every rank: the logical
    records (:mod:`hooktrace.trace.logical`) where the run has several, partial sums (a
    tensor not yet reduced, no logical tensor) left out."""
    if rank is not None:
        return trace.query(ranks=[rank], **query)
    if not trace.logical_by_default():
        return trace.query(logical=False, **query)
    found = trace.query(logical=True, **query)
    return found[found["merged"] != "partial"].reset_index(drop=True)


def grad_norm_table(
    run: Run, *, steps: StepsSpec = None, modules: str | None = None, rank: int | None = None
) -> pd.DataFrame:
    """Per module (rows) and step (columns): the L2 norm of all of the module's parameter
    gradients together; inf when one held a NaN or an Inf, NaN where none was recorded.
    ``rank``: that rank's; None: every rank's, as logical tensors (:func:`records_of`)."""
    trace = trace_of(run)
    rows = records_of(
        trace,
        rank,
        columns=["step", "module", "dtype", "norm"],
        kinds=["grad_param"],
        steps=step_filter(steps),
    )
    rows = _matching(rows[rows["dtype"].astype(str) != "None"], modules)
    squares = rows.assign(sq=(rows["norm"] ** 2).fillna(np.inf))  # a NaN norm: NaN values
    norms = squares.groupby(["module", "step"], observed=True)["sq"].sum() ** 0.5
    return _ordered(trace, norms.unstack("step"))


def activation_tables(
    run: Run, *, steps: StepsSpec = None, modules: str | None = None, rank: int | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per module and step, over the module's train-phase outputs: the root mean square of
    the values (from mean and std, weighted by numel; inf when they held a NaN or an Inf),
    and the fraction of exact zeros (inf there too). NaN where nothing was recorded.
    ``rank`` as :func:`grad_norm_table` takes it."""
    trace = trace_of(run)
    rows = records_of(
        trace,
        rank,
        columns=["step", "module", "numel", "mean", "std", "zero_fraction"],
        kinds=["output"],
        phases=["train"],
        steps=step_filter(steps),
    )
    rows = _matching(rows[rows["numel"] > 0], modules)
    weighted = pd.DataFrame(
        {
            "module": rows["module"],
            "step": rows["step"],
            "n": rows["numel"].astype("float64"),
            "sq": (rows["numel"] * (rows["std"] ** 2 + rows["mean"] ** 2)).fillna(np.inf),
            "zeros": rows["numel"] * rows["zero_fraction"],
        }
    )
    sums = weighted.groupby(["module", "step"], observed=True).sum(min_count=1)
    rms = ((sums["sq"] / sums["n"]) ** 0.5).unstack("step")
    zeros = (sums["zeros"] / sums["n"]).unstack("step")
    zeros = zeros.mask(np.isinf(rms), np.inf)  # no fraction of values that are not numbers
    return _ordered(trace, rms), _ordered(trace, zeros)


def silent_unit_table(
    run: Run,
    *,
    threshold: float = 1e-3,
    steps: StepsSpec = None,
    modules: str | None = None,
    rank: int | None = None,
) -> pd.DataFrame:
    """Per ReLU-family layer (rows; ``module [call n]`` for a module called more than once
    per micro-step) and step: the share of its units positive in under ``threshold`` of their
    values at that step (train phase, calls and micro-steps of the step summed); inf where
    its outputs held a NaN or an Inf (drawn red: a NaN is no sign of silence). ``rank``: that
    rank's units; None: every rank's, placed as :func:`hooktrace.dead_relus` places them."""
    trace = trace_of(run)
    types = modules_of_type(trace.modules, RELU_FAMILY)
    if not types:  # (an empty module filter would match nothing anyway)
        return pd.DataFrame()
    rows = activity_rows(
        trace, modules=sorted(types), phases=["train"], steps=step_filter(steps),
        ranks=None if rank is None else [rank],
    )  # fmt: skip
    rows = _matching(rows[rows["units"] > 0], modules)
    if rows.empty:
        return pd.DataFrame()
    positive: dict[tuple[str, int, int], np.ndarray] = {}
    values: dict[tuple[str, int, int], int] = {}
    # a NaN is no value a unit can be silent on: such cells are non-finite (red), not silent
    nonfinite = rows[rows["nan"] | rows["inf"]]
    broken = set(
        zip(nonfinite["module"].astype(str), nonfinite["call"], nonfinite["step"], strict=True)
    )
    for segment, part in rows.groupby(rows["segment"].astype(str), sort=False):
        width = int(part["own_units"].max())
        slices = trace.read_activity(str(segment), part["activity_offset"].tolist(), width)
        columns = zip(
            part["module"].astype(str),
            part["call"].tolist(),
            part["step"].tolist(),
            part["units"].tolist(),
            part["base"].tolist(),
            part["own_units"].tolist(),
            part["unit_size"].tolist(),
            slices,
            strict=True,
        )
        for module, call, step, units, base, own, unit_size, counts in columns:
            key = (module, call, step)
            mine = positive.setdefault(key, np.zeros(units, dtype=np.int64))
            mine[base : base + own] += counts[:own]
            values[key] = values.get(key, 0) + unit_size
    calls = rows.groupby(rows["module"].astype(str), observed=True)["call"].nunique()
    silent = pd.Series(
        {
            (layer_name(module, call, int(calls[module])), step): np.inf
            if (module, call, step) in broken
            else float(np.mean(counts < threshold * values[(module, call, step)]))
            for (module, call, step), counts in positive.items()
        }
    )
    table = silent.unstack(1)
    order = {m: i for i, m in enumerate(trace.modules["module"].astype(str))}
    keys = sorted(table.index, key=lambda n: (order.get(n.split(" [")[0], len(order)), n))
    return table.loc[keys].sort_index(axis=1)


ONE_RUN_ONLY = -np.inf
"""A cell of :func:`diff_table` where a record is in one run only (or changed its shape or
dtype): nothing to compare it with."""


def diff_table(
    run_a: Run,
    run_b: Run,
    *,
    steps: StepsSpec = None,
    modules: str | None = None,
    **options: Any,
) -> tuple[pd.DataFrame, Any]:
    """Per module and step: the largest ``rel_diff`` of :func:`hooktrace.diff` over the
    module's records (0 where all are equal), inf where a record's values are non-finite in
    one run and not alike in the other, :data:`ONE_RUN_ONLY` (-inf) where a record is in one
    run only or changed its shape or dtype (a non-finite record in the same cell wins), NaN
    where neither run recorded anything; and the :class:`DiffResult`. ``options`` go to
    :func:`hooktrace.diff` (rtol, atol, kinds, ...)."""
    from hooktrace.analyze.diff.diff import diff

    parts: list[pd.DataFrame] = []

    def collect(chunk: pd.DataFrame) -> None:
        status = chunk["status"].astype(str)
        one_run = status.isin(["only_a", "only_b", "changed"]).to_numpy()
        rel = chunk["rel_diff"].where(status != "equal", 0.0).to_numpy(dtype=np.float64)
        # paired records compare to inf only where a value is NaN or Inf in one run
        nonfinite = ~one_run & np.isinf(rel)
        frame = pd.DataFrame(
            {
                "module": chunk["module"].astype(str).to_numpy(),
                "step": chunk["step"].to_numpy(),
                "rel": np.where(one_run | nonfinite, np.nan, rel),
                "one_run": one_run,
                "nonfinite": nonfinite,
            }
        )
        parts.append(
            frame.groupby(["module", "step"]).agg(
                rel=("rel", "max"), one_run=("one_run", "any"), nonfinite=("nonfinite", "any")
            )
        )

    result = diff(
        run_a,
        run_b,
        steps=step_filter(steps),
        modules=_regex(modules).pattern if modules is not None else None,
        rows="all",
        sink=collect,
        **options,
    )
    if not parts:
        return pd.DataFrame(), result
    cells = (
        pd.concat(parts)
        .groupby(level=[0, 1])
        .agg({"rel": "max", "one_run": "any", "nonfinite": "any"})
    )
    value = cells["rel"].where(~cells["one_run"], ONE_RUN_ONLY).where(~cells["nonfinite"], np.inf)
    return _ordered(trace_of(run_a), value.unstack("step")), result


def histogram_table(frame: pd.DataFrame) -> pd.DataFrame:
    """For one record of :func:`hooktrace.hist`'s ``frame``: per exponent ``e`` of ``|x|``
    (rows, ascending) and step (columns), the share of the step's values in
    ``[2^e, 2^(e+1))``, both signs together; 0 where none. The rows run from the lowest
    exponent occupied to the highest, and over float16's subnormal range (2^-24 to 2^-14)
    whatever the values, so that a picture always shows where float16 stops."""
    from hooktrace.analyze.histograms.histograms import exponent_bins
    from hooktrace.analyze.histograms.precision import FP16

    bins = exponent_bins(frame)
    steps = sorted(set(frame["step"].tolist()))
    if bins.empty:
        lowest, highest = FP16.smallest_subnormal, FP16.smallest_normal - 1
    else:
        lowest = min(int(bins["exponent"].min()), FP16.smallest_subnormal)
        highest = max(int(bins["exponent"].max()), FP16.smallest_normal - 1)
    table = bins.pivot_table(
        index="exponent", columns="step", values="fraction", aggfunc="sum", fill_value=0.0
    )
    table = table.reindex(index=range(lowest, highest + 1), columns=steps, fill_value=0.0)
    table.index.name, table.columns.name = "exponent", "step"
    return table.astype("float64")


def trace_of(run: Run) -> Trace:
    return run if isinstance(run, Trace) else load(run)


def _matching(rows: pd.DataFrame, modules: str | None) -> pd.DataFrame:
    if modules is None:
        return rows
    pattern = _regex(modules)
    names = rows["module"].astype(str)
    return rows[names.map(lambda n: pattern.search(n) is not None).to_numpy(dtype=bool)]


def _regex(modules: str) -> re.Pattern[str]:
    try:
        return re.compile(modules)
    except re.error as exc:
        raise ConfigError(f"bad modules regex {modules!r}: {exc}") from None


def _ordered(trace: Trace, table: pd.DataFrame) -> pd.DataFrame:
    """Rows in the model's order (the modules table), other names after; steps ascending."""
    if table.empty:
        return table
    order = {m: i for i, m in enumerate(trace.modules["module"].astype(str))}
    index = sorted(table.index.astype(str), key=lambda n: (order.get(n, len(order)), n))
    table.index = table.index.astype(str)
    return table.loc[index].sort_index(axis=1)


def layer_name(module: str, call: int, calls: int) -> str:
    return module if calls <= 1 else f"{module} [call {call}]"
