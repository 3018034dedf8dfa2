"""Distributions over steps, from the fixed exponent bins the recorder keeps: :func:`hist`.
Never imports torch.

A histogram counts a tensor's values by the binary exponent of ``|x|`` (one bin per power of
two over float32's whole range, by sign), and apart the zeros, NaNs and infinities
(docs/FORMAT.md, "histograms"). The bins are the same for every tensor, step and run, so a
distribution reads the same way everywhere, and some numerics questions have exact answers:
how much of a gradient float16 would flush to zero (below ``2^-24``), keep with fewer bits
(below ``2^-14``), or overflow (``2^16`` and above).

:func:`hist` answers in a tidy table (one row per non-empty bin per record and step) that
pandas plots or pivots directly; the work is done by DuckDB over the trace's Parquet parts,
reading only the rows asked for, so that a large trace is never loaded whole.
"""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import StepsSpec, step_filter
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace import schema
from hooktrace.trace.histograms import EXPONENT_MIN, MAGNITUDE_BINS
from hooktrace.trace.reader import Trace, load

Run = str | os.PathLike[str] | Trace

FP16_SUBNORMAL: Final = -24
"""float16's smallest subnormal is 2^-24: a value of smaller magnitude is lost (0, or 2^-24
at best)."""
FP16_NORMAL: Final = -14
"""float16's smallest normal is 2^-14: below it, a value keeps fewer bits of precision."""
FP16_OVERFLOW: Final = 16
"""float16's largest finite value is 65504: from 2^16 up, a value overflows to infinity."""

BINS: Final = ("zero", "nan", "pos_inf", "neg_inf", "neg", "pos")
"""The ``bin`` column's values: the format's count columns; ``neg`` and ``pos`` rows carry an
``exponent``."""

COLUMNS: Final = (
    "rank",
    "step",
    "module",
    "kind",
    "slot",
    "numel",
    "bin",
    "exponent",
    "count",
    "fraction",
)

ModulesSpec = str | Sequence[str] | None
"""A regex searched in module names, or a list of exact module names."""


def hist(
    run: Run,
    *,
    modules: ModulesSpec = None,
    kinds: Sequence[str] | str | None = None,
    steps: StepsSpec = None,
    ranks: Sequence[int] | None = None,
    max_steps: int | None = None,
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
    numbers) and ``ranks`` filter; ``max_steps`` keeps at most that many of the steps
    histogrammed, evenly spaced with the first and the last. ``frame.attrs["steps"]`` holds
    how many steps matched before that.

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
    where = _Where(trace, modules=modules, kinds=_kinds(kinds), steps=steps, ranks=ranks)
    matched = where.steps()
    if not matched:
        raise ConfigError(f"no histograms match {where.asked()}: {describe(trace)}")
    chosen = sample_steps(matched, max_steps)
    frame = _bins(trace, where, None if len(chosen) == len(matched) else chosen)
    frame.attrs["steps"] = len(matched)
    return frame


def histogrammed(
    run: Run,
    *,
    modules: ModulesSpec = None,
    kinds: Sequence[str] | str | None = None,
    steps: StepsSpec = None,
    ranks: Sequence[int] | None = None,
) -> pd.DataFrame:
    """The records that have histograms, filtered as :func:`hist` filters (no bins read):
    one row per (rank, module, kind, slot), in :func:`in_order`'s order, with ``steps``
    (how many were histogrammed), ``first_step`` and ``last_step``."""
    trace = run if isinstance(run, Trace) else load(run)
    require_histograms(trace)
    where = _Where(trace, modules=modules, kinds=_kinds(kinds), steps=steps, ranks=ranks)
    found = trace.sql(
        "SELECT rank, module, kind, slot, count(DISTINCT step) AS steps, min(step) AS "
        f"first_step, max(step) AS last_step, min(seq) AS seq FROM histograms{where.sql()} "
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
    if trace.has_histograms:
        return
    config = trace.manifest.get("config", {})
    asked = config.get("histograms")
    again = "record the run again with `hooktrace record --histograms param,grad_param`"
    if asked is None:
        why = f"it was recorded before histograms were (format {trace.format_version}, before 1.3)"
        again += " (the default now)"
    elif not asked:
        why = "it was recorded with histograms off (--histograms none)"
    else:
        every = config.get("histogram_every", 1)
        why = (
            f"none were written, though {', '.join(asked)} were asked for every {every} "
            "step(s) (did a histogrammed step run?)"
        )
    raise TraceError(f"{trace.path} holds no histograms: {why}; {again}")


def describe(trace: Trace) -> str:
    """What histograms ``trace`` holds, in a sentence: kinds, modules and steps."""
    held = trace.sql(
        "SELECT kind, count(DISTINCT module) AS modules, count(DISTINCT step) AS steps, "
        "min(step) AS first, max(step) AS last FROM histograms GROUP BY kind ORDER BY kind"
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
    """One row per record and step of :func:`hist`'s ``frame``, in its order: ``numel``, the
    ``zero``, ``nan`` and ``inf`` counts, ``neg`` (the share of values below zero), ``lowest``
    and ``highest`` (the exponents of the smallest and largest nonzero finite magnitudes; <NA>
    when there is none), and what float16 would make of the values, as shares of them:
    ``fp16_lost`` (nonzero, below 2^-24), ``fp16_subnormal`` (nonzero, below 2^-14, those
    lost included) and ``fp16_overflow`` (finite, from 2^16 up)."""
    key = ["rank", "step", "module", "kind", "slot"]
    e = frame["exponent"]
    magnitude = frame["bin"].isin(["pos", "neg"]).to_numpy()
    parts = pd.DataFrame(
        {
            **{k: frame[k] for k in key},
            "zero": _where(frame["bin"] == "zero", frame["count"]),
            "nan": _where(frame["bin"] == "nan", frame["count"]),
            "inf": _where(frame["bin"].isin(["pos_inf", "neg_inf"]), frame["count"]),
            "negative": _where(frame["bin"].isin(["neg", "neg_inf"]), frame["count"]),
            "lost": _where(magnitude & (e < FP16_SUBNORMAL), frame["count"]),
            "subnormal": _where(magnitude & (e < FP16_NORMAL), frame["count"]),
            "overflow": _where(magnitude & (e >= FP16_OVERFLOW), frame["count"]),
            "lowest": e.where(magnitude),
            "highest": e.where(magnitude),
            "numel": frame["numel"],
        }
    )
    grouped = parts.groupby(key, sort=False)
    out = grouped.agg(
        numel=("numel", "first"),
        zero=("zero", "sum"),
        nan=("nan", "sum"),
        inf=("inf", "sum"),
        negative=("negative", "sum"),
        lowest=("lowest", "min"),
        highest=("highest", "max"),
        lost=("lost", "sum"),
        subnormal=("subnormal", "sum"),
        overflow=("overflow", "sum"),
    ).reset_index()
    numel = out["numel"].where(out["numel"] > 0).astype("float64")
    return pd.DataFrame(
        {
            **{k: out[k] for k in key},
            "numel": out["numel"],
            "zero": out["zero"],
            "nan": out["nan"],
            "inf": out["inf"],
            "neg": out["negative"] / numel,
            "lowest": out["lowest"].astype("Int64"),
            "highest": out["highest"].astype("Int64"),
            "fp16_lost": out["lost"] / numel,
            "fp16_subnormal": out["subnormal"] / numel,
            "fp16_overflow": out["overflow"] / numel,
        }
    )


def _where(mask: Any, counts: pd.Series) -> np.ndarray:
    return np.where(np.asarray(mask, dtype=bool), counts.to_numpy(), 0)


# --- the query ----------------------------------------------------------------------------


def _kinds(kinds: Sequence[str] | str | None) -> list[str] | None:
    if kinds is None:
        return None
    chosen = [k.strip() for k in kinds.split(",")] if isinstance(kinds, str) else list(kinds)
    unknown = [k for k in chosen if k not in schema.KINDS]
    if unknown or not chosen:
        raise ConfigError(
            f"unknown kind {', '.join(map(repr, unknown)) or '(none given)'}: "
            f"choose from {', '.join(schema.KINDS)}"
        )
    return chosen


class _Where:
    """The WHERE clause of the options, and its parameters; module regexes resolved to names
    (Python's regex rules, as the other commands; DuckDB's differ)."""

    def __init__(
        self,
        trace: Trace,
        *,
        modules: ModulesSpec,
        kinds: list[str] | None,
        steps: StepsSpec,
        ranks: Sequence[int] | None,
    ) -> None:
        self.trace = trace
        self.modules, self.kinds, self.ranks = modules, kinds, ranks
        self.step_spec = steps
        self.clauses: list[str] = []
        self.values: list[Any] = []
        span = step_filter(steps)
        if isinstance(span, tuple):
            self._add("step BETWEEN ? AND ?", int(span[0]), int(span[1]))
        elif span is not None:
            self._add("list_contains(?, step)", [int(s) for s in span])
        if kinds is not None:
            self._add("list_contains(?, kind)", kinds)
        if ranks is not None:
            self._add("list_contains(?, rank)", [int(r) for r in ranks])
        self.names = None if modules is None else self._names(modules)
        if self.names is not None:
            self._add("list_contains(?, module)", self.names)

    def _add(self, clause: str, *values: Any) -> None:
        self.clauses.append(clause)
        self.values.extend(values)

    def _names(self, modules: str | Sequence[str]) -> list[str]:
        if not isinstance(modules, str):
            return [str(m) for m in modules]
        try:
            pattern = re.compile(modules)
        except re.error as exc:
            raise ConfigError(f"bad modules regex {modules!r}: {exc}") from None
        found = self.trace.sql("SELECT DISTINCT module FROM histograms")["module"]
        return sorted(str(m) for m in found if pattern.search(str(m)))

    def sql(self, *extra: str) -> str:
        clauses = [*self.clauses, *extra]
        return (" WHERE " + " AND ".join(clauses)) if clauses else ""

    def steps(self) -> list[int]:
        found = self.trace.sql(
            f"SELECT DISTINCT step FROM histograms{self.sql()} ORDER BY step", self.values
        )
        return [int(s) for s in found["step"]]

    def asked(self) -> str:
        parts = []
        if self.modules is not None:
            parts.append(f"modules {self.modules!r}")
        if self.kinds is not None:
            parts.append(f"kinds {','.join(self.kinds)}")
        if self.step_spec is not None:
            parts.append(f"steps {self.step_spec!r}")
        if self.ranks is not None:
            parts.append(f"ranks {','.join(map(str, self.ranks))}")
        return ", ".join(parts) or "the trace"


# One row per record and step (a parameter recorded twice in a step, eval then train, keeps
# its last record); then its bins unnested, the empty ones dropped, summed over the records of
# the step. DuckDB's lists count from 1: list index i holds bin i - 1, exponent i - 1 - 150.
_QUERY = """
WITH chosen AS (
    SELECT rank, step, seq, module, kind, slot, numel, zero, nan, pos_inf, neg_inf, pos, neg
    FROM histograms{where}
    QUALIFY kind <> 'param' OR seq = max(seq) OVER (PARTITION BY rank, step, module, kind, slot)
),
per_step AS (
    SELECT rank, step, module, kind, slot, sum(numel) AS numel, min(seq) AS seq
    FROM chosen GROUP BY rank, step, module, kind, slot
),
unnested AS (
    SELECT rank, step, module, kind, slot,
           generate_subscripts(pos, 1) - 1 + {lowest} AS exponent,
           unnest(pos) AS pos, unnest(neg) AS neg
    FROM chosen
),
bins AS (
    SELECT rank, step, module, kind, slot, 'pos' AS bin, exponent, pos AS count
    FROM unnested WHERE pos > 0
    UNION ALL
    SELECT rank, step, module, kind, slot, 'neg', exponent, neg FROM unnested WHERE neg > 0
    UNION ALL
    SELECT rank, step, module, kind, slot, 'zero', NULL, zero FROM chosen WHERE zero > 0
    UNION ALL
    SELECT rank, step, module, kind, slot, 'nan', NULL, nan FROM chosen WHERE nan > 0
    UNION ALL
    SELECT rank, step, module, kind, slot, 'pos_inf', NULL, pos_inf FROM chosen WHERE pos_inf > 0
    UNION ALL
    SELECT rank, step, module, kind, slot, 'neg_inf', NULL, neg_inf FROM chosen WHERE neg_inf > 0
)
SELECT r.rank, r.step, r.module, r.kind, r.slot, r.numel, b.bin, b.exponent,
       sum(b.count)::BIGINT AS count
FROM bins b JOIN per_step r USING (rank, step, module, kind, slot)
GROUP BY r.rank, r.step, r.seq, r.module, r.kind, r.slot, r.numel, b.bin, b.exponent
ORDER BY r.rank, r.step, r.seq, r.kind, r.slot,
         list_position(['zero', 'nan', 'pos_inf', 'neg_inf', 'neg', 'pos'], b.bin), b.exponent
"""


def _bins(trace: Trace, where: _Where, chosen: list[int] | None) -> pd.DataFrame:
    extra, values = [], list(where.values)
    if chosen is not None:
        extra.append("list_contains(?, step)")
        values.append(chosen)
    query = _QUERY.format(where=where.sql(*extra), lowest=EXPONENT_MIN - 1)
    try:
        frame = trace.sql(query, values)
    except TraceError as exc:
        if not _engine_failed(exc):
            raise
        frame = _bins_by_reader(trace, where, chosen)  # a part DuckDB cannot decode
    return _typed(frame)


def _bins_by_reader(trace: Trace, where: _Where, chosen: list[int] | None) -> pd.DataFrame:
    """The same table from hooktrace's reader, which leaves a damaged part out (with a
    warning) where DuckDB fails on it."""
    span = step_filter(where.step_spec)
    steps: Any = chosen if chosen is not None else span
    frame = trace.histograms(steps=steps, modules=where.names, kinds=where.kinds, ranks=where.ranks)
    if frame.empty:
        return pd.DataFrame(columns=list(COLUMNS[:-1]))
    for name in ("module", "kind", "slot"):
        frame[name] = frame[name].astype(str)
    key = ["rank", "step", "module", "kind", "slot"]
    is_param = frame["kind"] == "param"
    last = frame.groupby(key)["seq"].transform("max")
    frame = frame[~is_param | (frame["seq"] == last)]
    records = frame.groupby(key, sort=False).agg(numel=("numel", "sum"), seq=("seq", "min"))
    pieces = []
    for name in ("zero", "nan", "pos_inf", "neg_inf"):
        pieces.append(frame[key].assign(bin=name, exponent=np.nan, count=frame[name].to_numpy()))
    for name in ("neg", "pos"):
        counts = np.stack(frame[name].to_list()) if len(frame) else np.zeros((0, MAGNITUDE_BINS))
        row, at = np.nonzero(counts)
        part = frame[key].iloc[row].reset_index(drop=True)
        pieces.append(part.assign(bin=name, exponent=at + EXPONENT_MIN - 1, count=counts[row, at]))
    bins = pd.concat(pieces, ignore_index=True)
    bins = bins[bins["count"] > 0]
    summed = bins.groupby([*key, "bin", "exponent"], dropna=False, sort=False)["count"].sum()
    out = summed.reset_index().join(records, on=key)
    out["order"] = out["bin"].map({b: i for i, b in enumerate(BINS)})
    out = out.sort_values(["rank", "step", "seq", "kind", "slot", "order", "exponent"])
    return out[list(COLUMNS[:-1])]


def _typed(frame: pd.DataFrame) -> pd.DataFrame:
    out = pd.DataFrame(
        {
            "rank": frame["rank"].astype("int64"),
            "step": frame["step"].astype("int64"),
            "module": frame["module"].astype(str),
            "kind": frame["kind"].astype(str),
            "slot": frame["slot"].astype(str),
            "numel": frame["numel"].astype("int64"),
            "bin": frame["bin"].astype(str),
            "exponent": frame["exponent"].astype("Int64"),
            "count": frame["count"].astype("int64"),
        }
    )
    with warnings.catch_warnings():  # a record of no values has no bins: never 0/0 here
        warnings.simplefilter("ignore", RuntimeWarning)
        out["fraction"] = out["count"] / out["numel"]
    return out.reset_index(drop=True)


def _engine_failed(exc: TraceError) -> bool:
    import duckdb

    return isinstance(exc.__cause__, duckdb.Error)


def _span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}–{last}"
