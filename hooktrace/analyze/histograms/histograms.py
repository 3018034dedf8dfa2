"""Distributions over steps, from the fixed exponent bins the recorder keeps: :func:`hist`.
Never imports torch.

A histogram counts a tensor's values by the binary exponent of ``|x|`` (one bin per power of
two over float32's whole range, by sign), and apart the zeros, NaNs and infinities
(docs/FORMAT.md, "histograms"). The bins are the same for every tensor, step and run, so a
distribution reads the same way everywhere, and some numerics questions have exact answers:
how much of a gradient float16 would flush to zero (below ``2^-24``), keep with fewer bits
(below ``2^-14``), or overflow (``2^16`` and above).

:func:`hist` answers in a tidy table (one row per non-empty bin per record and step) that
pandas plots or pivots directly. DuckDB reads the histograms as stored (each sign's occupied
span of bins), only the rows asked for and a few steps at a time, and numpy sums and unfolds
them (:mod:`hooktrace.analyze.histograms.rows`), so that a large trace is never loaded whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import StepsSpec
from hooktrace.analyze.histograms.precision import FP16
from hooktrace.analyze.histograms.rows import BINS as BINS  # the tidy rows' bins and columns,
from hooktrace.analyze.histograms.rows import COLUMNS as COLUMNS  # imported from here too
from hooktrace.analyze.histograms.rows import (
    ModulesSpec,
    Where,
    chunks,
    empty,
    kinds_given,
    read,
    tidy,
)
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace import schema
from hooktrace.trace.reader import Trace, load

Run = str | os.PathLike[str] | Trace


def hist(
    run: Run,
    *,
    modules: ModulesSpec = None,
    kinds: Sequence[str] | str | None = None,
    steps: StepsSpec = None,
    ranks: Sequence[int] | None = None,
    max_steps: int | None = None,
    sink: Callable[[pd.DataFrame], None] | None = None,
    per_rank: bool = False,
) -> pd.DataFrame:
    """The distribution of each histogrammed record (module, kind, slot) at each step.

    One row per non-empty bin of a record at a step, in (rank, step, execution) order:
    ``rank``, ``step``, ``module``, ``kind``, ``slot``; ``numel``, the values counted; ``bin``,
    one of :data:`BINS`; ``exponent``, for ``pos`` and ``neg`` only, the ``e`` with
    ``2^e <= |x| < 2^(e+1)`` (-150 holds everything below ``2^-149``, 128 everything from
    ``2^128``, which only float64 values reach); ``count``; and ``fraction``, ``count / numel``.
    A record histogrammed several times in a step (an output, once per call and micro-step) is
    summed over the step; a parameter recorded twice (evaluation, then training) counts once,
    as the training saw it.

    ``modules`` is a regex searched in module names, or a list of exact names; ``kinds``
    (``param``, ``grad_param``, ...), ``steps`` (``"0-100"``, ``(first, last)`` or step
    numbers) and ``ranks`` filter. A run of several ranks is answered as its logical tensors
    (:mod:`hooktrace.trace.logical`): a tensor's histogram is the sum of its parts' (shards,
    data-parallel ranks' parts of the batch; a replica once), under the lowest rank behind
    it; its values as the ranks computed them (an activation gradient is not divided by the
    data-parallel degree). ``ranks`` or ``per_rank=True``: each rank's own. ``max_steps`` keeps at most that many of the steps
    histogrammed, evenly spaced with the first and the last. ``frame.attrs["steps"]`` holds
    how many steps matched before that. The trace is read a few steps at a time (about
    :data:`CHUNK_RECORDS` histograms); with ``sink``, each chunk's rows are handed to it as
    they are made, whole steps in order, and the frame returned is empty: memory stays
    bounded however long the run.

    Raises :class:`TraceError` when the trace holds no histograms (recorded without them, or
    before format 1.3), and :class:`ConfigError` on bad options or when nothing matches them.

    Example::

        frame = hooktrace.hist("runs/a", modules="fc1", kinds=["grad_param"])
        frame.pivot_table(index="exponent", columns="step", values="fraction", aggfunc="sum")
    """
    trace = run if isinstance(run, Trace) else load(run)
    require_histograms(trace)
    if max_steps is not None and max_steps < 1:
        raise ConfigError(f"max_steps must be 1 or more (got {max_steps})")
    where = Where(
        trace, modules=modules, kinds=kinds_given(kinds), steps=steps, ranks=ranks,
        per_rank=per_rank,
    )  # fmt: skip
    per_step_rows = where.rows_per_step()
    if per_step_rows.empty:
        raise ConfigError(f"no histograms match {where.asked()}: {describe(trace)}")
    matched = [int(s) for s in per_step_rows.index]
    chosen = sample_steps(matched, max_steps)
    parts = []
    found = 0
    for chunk in chunks(per_step_rows.loc[chosen], CHUNK_RECORDS):
        frame = tidy(read(trace, where, chunk, sampled=len(chosen) < len(matched)))
        found += len(frame)
        if sink is not None:
            sink(frame)
        else:
            parts.append(frame)
    if not found and trace.skipped:  # the footers promised histograms; their pages are damaged
        raise TraceError(
            f"no histogram of {trace.path} could be read: the parts holding them are damaged "
            f"(left out: {', '.join(trace.skipped)}); `hooktrace check {trace.path}` says what"
        )
    out = pd.concat(parts, ignore_index=True) if len(parts) > 1 else (parts or [empty()])[0]
    attrs = {"steps": len(matched), "logical": where.logical}
    out.attrs.update(attrs)
    return out if sink is None else empty(attrs=attrs)


CHUNK_RECORDS: Final = 20_000
"""Histograms (a few dozen counts each, as stored) that :func:`hist` reads at a time."""


def histogrammed(
    run: Run,
    *,
    modules: ModulesSpec = None,
    kinds: Sequence[str] | str | None = None,
    steps: StepsSpec = None,
    ranks: Sequence[int] | None = None,
    per_rank: bool = False,
) -> pd.DataFrame:
    """The records that have histograms, filtered as :func:`hist` filters (no bins read):
    one row per (rank, module, kind, slot), in :func:`in_order`'s order, with ``steps``
    (how many were histogrammed), ``first_step`` and ``last_step``; the logical tensors of
    a run of several ranks as :func:`hist` has them, unless ``ranks`` or ``per_rank``."""
    trace = run if isinstance(run, Trace) else load(run)
    require_histograms(trace)
    where = Where(
        trace, modules=modules, kinds=kinds_given(kinds), steps=steps, ranks=ranks,
        per_rank=per_rank,
    )  # fmt: skip
    found = trace.sql(
        "SELECT rank, module, kind, slot, count(DISTINCT step) AS steps, min(step) AS "
        f"first_step, max(step) AS last_step, min(seq) AS seq FROM {where.source()} "
        "GROUP BY rank, module, kind, slot ORDER BY rank, seq",
        where.values,
    )
    for name in ("module", "kind", "slot"):
        found[name] = found[name].astype(str)
    return in_order(found).drop(columns="seq").reset_index(drop=True)


def in_order(frame: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``frame`` (with rank, module, kind, slot) by rank, then module as first
    met, then kind (parameters before their gradients) and slot as first met: a module's
    records together."""
    first: dict[Any, int] = {}
    for i, module in enumerate(frame["module"]):
        first.setdefault(module, i)
    kind_order = {k: i for i, k in enumerate(schema.KINDS)}
    order = pd.DataFrame(
        {
            "rank": frame["rank"].to_numpy(),
            "module": frame["module"].map(first).to_numpy(),
            "kind": frame["kind"].map(kind_order).fillna(len(kind_order)).to_numpy(),
            "at": np.arange(len(frame)),
        }
    )
    return frame.iloc[order.sort_values(["rank", "module", "kind", "at"]).index.to_numpy()]


def require_histograms(trace: Trace) -> None:
    """TraceError, saying why and how to record them, unless ``trace`` holds histograms."""
    if not trace.has_histograms:
        raise TraceError(f"{trace.path} holds no histograms: {trace.no_histograms_because}")


def describe(trace: Trace) -> str:
    """What histograms ``trace`` holds, in a sentence: kinds, modules and steps."""
    held = trace.sql(
        "SELECT kind, count(DISTINCT module) AS modules, count(DISTINCT step) AS steps, "
        "min(step) AS first, max(step) AS last FROM rank_histogram_spans GROUP BY kind ORDER BY kind"
    )
    if held.empty:
        return "the trace holds no histograms"
    parts = [
        f"{row['kind']} of {row['modules']} module{'s' if row['modules'] != 1 else ''} at "
        f"{row['steps']} step{'s' if row['steps'] != 1 else ''} "
        f"({_span(int(row['first']), int(row['last']))})"
        for row in held.to_dict("records")
    ]
    every = trace.manifest.get("config", {}).get("histogram_every")
    tail = (
        f", every {every} steps (histogram_every)" if isinstance(every, int) and every > 1 else ""
    )
    return "the trace holds histograms of " + "; ".join(parts) + tail


def sample_steps(steps: Sequence[int], max_steps: int | None) -> list[int]:
    """At most ``max_steps`` of ``steps`` (sorted), evenly spaced, the first and last kept."""
    if max_steps is None or len(steps) <= max_steps:
        return list(steps)
    if max_steps == 1:
        return [steps[-1]]
    at = np.unique(np.round(np.linspace(0, len(steps) - 1, max_steps)).astype(np.int64))
    return [int(steps[i]) for i in at]


def exponent_bins(frame: pd.DataFrame) -> pd.DataFrame:
    """The magnitude bins of :func:`hist`'s ``frame``, both signs together: one row per
    (rank, step, module, kind, slot, exponent) with ``count`` and ``fraction``."""
    signed = frame[frame["bin"].isin(["pos", "neg"])]
    keys = ["rank", "step", "module", "kind", "slot", "exponent"]
    out = signed.groupby(keys, sort=False, observed=True)[["count", "fraction"]].sum()
    return out.reset_index()


RECORD: Final = ["rank", "module", "kind", "slot"]
"""What names a histogrammed record across steps."""


def per_step(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per record and step of :func:`hist`'s ``frame``, in its order: ``numel``; the
    ``zero``, ``nan`` and ``inf`` counts; ``nonzero``, the nonzero finite values; ``lowest``
    and ``highest``, the exponents of the smallest and largest of them (<NA> where there is
    none); and as fractions of them, as :func:`hooktrace.precision` has them: ``neg`` (below
    zero), and what float16 would make of them: ``fp16_underflow`` (below 2^-24: zero, or
    2^-24 at best), ``fp16_subnormal`` (from 2^-24 to below 2^-14: fewer bits) and
    ``fp16_overflow`` (2^16 and up: Inf); NaN where there is no nonzero finite value."""
    key = ["rank", "step", "module", "kind", "slot"]
    e = frame["exponent"]
    magnitude = frame["bin"].isin(["pos", "neg"]).to_numpy()
    low, normal, high = FP16.smallest_subnormal, FP16.smallest_normal, FP16.overflow
    parts = pd.DataFrame(
        {
            **{k: frame[k] for k in key},
            "numel": frame["numel"],
            "zero": _where(frame["bin"] == "zero", frame["count"]),
            "nan": _where(frame["bin"] == "nan", frame["count"]),
            "inf": _where(frame["bin"].isin(["pos_inf", "neg_inf"]), frame["count"]),
            "nonzero": _where(magnitude, frame["count"]),
            "lowest": e.where(magnitude),
            "highest": e.where(magnitude),
            "neg": _where(frame["bin"] == "neg", frame["count"]),
            "fp16_underflow": _where(magnitude & (e < low), frame["count"]),
            "fp16_subnormal": _where(magnitude & (e >= low) & (e < normal), frame["count"]),
            "fp16_overflow": _where(magnitude & (e >= high), frame["count"]),
        }
    )
    shares = ["neg", "fp16_underflow", "fp16_subnormal", "fp16_overflow"]
    out = (
        parts.groupby(key, sort=False)
        .agg(
            numel=("numel", "first"),
            **{c: (c, "sum") for c in ("zero", "nan", "inf", "nonzero")},
            lowest=("lowest", "min"),
            highest=("highest", "max"),
            **{c: (c, "sum") for c in shares},
        )
        .reset_index()
    )
    nonzero = out["nonzero"].where(out["nonzero"] > 0).astype("float64")
    for name in shares:
        out[name] = out[name] / nonzero
    for name in ("lowest", "highest"):
        out[name] = out[name].astype("Int64")
    return out


def _where(mask: Any, counts: pd.Series) -> np.ndarray:
    return np.where(np.asarray(mask, dtype=bool), counts.to_numpy(), 0)


def _span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}–{last}"
