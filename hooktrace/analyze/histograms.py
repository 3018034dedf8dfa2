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
them, so that a large trace is never loaded whole.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import StepsSpec, step_filter
from hooktrace.analyze.precision import FP16
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace import schema
from hooktrace.trace.histograms import EXPONENT_MIN, MAGNITUDE_BINS
from hooktrace.trace.reader import Trace, load

Run = str | os.PathLike[str] | Trace

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
    sink: Callable[[pd.DataFrame], None] | None = None,
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
    where = _Where(trace, modules=modules, kinds=_kinds(kinds), steps=steps, ranks=ranks)
    per_step_rows = where.rows_per_step()
    if per_step_rows.empty:
        raise ConfigError(f"no histograms match {where.asked()}: {describe(trace)}")
    matched = [int(s) for s in per_step_rows.index]
    chosen = sample_steps(matched, max_steps)
    parts = []
    for chunk in _chunks(per_step_rows.loc[chosen], CHUNK_RECORDS):
        frame = _tidy(_read(trace, where, chunk, sampled=len(chosen) < len(matched)))
        if sink is not None:
            sink(frame)
        else:
            parts.append(frame)
    out = pd.concat(parts, ignore_index=True) if len(parts) > 1 else (parts or [_empty()])[0]
    out.attrs["steps"] = len(matched)
    return out if sink is None else _empty(attrs={"steps": len(matched)})


CHUNK_RECORDS: Final = 20_000
"""Histograms (a few dozen counts each, as stored) that :func:`hist` reads at a time."""


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
        f"first_step, max(step) AS last_step, min(seq) AS seq FROM histogram_spans{where.sql()} "
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
        "min(step) AS first, max(step) AS last FROM histogram_spans GROUP BY kind ORDER BY kind"
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
        found = self.trace.sql("SELECT DISTINCT module FROM histogram_spans")["module"]
        return sorted(str(m) for m in found if pattern.search(str(m)))

    def sql(self, *extra: str) -> str:
        clauses = [*self.clauses, *extra]
        return (" WHERE " + " AND ".join(clauses)) if clauses else ""

    def rows_per_step(self) -> pd.Series:
        """Histograms per step, indexed by step, in step order (no bins read)."""
        found = self.trace.sql(
            f"SELECT step, count(*) AS n FROM histogram_spans{self.sql()} GROUP BY step "
            "ORDER BY step",
            self.values,
        )
        return found.set_index("step")["n"].astype("int64")

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


def _chunks(per_step: pd.Series, rows: int) -> list[list[int]]:
    """The steps of ``per_step`` (histograms per step) in runs of about ``rows`` histograms,
    whole steps each."""
    chunks: list[list[int]] = [[]]
    total = 0
    for step, n in zip(per_step.index.tolist(), per_step.tolist(), strict=True):
        if chunks[-1] and total + int(n) > rows:
            chunks.append([])
            total = 0
        chunks[-1].append(int(step))
        total += int(n)
    return chunks


_RAW = (
    "SELECT rank, step, seq, module, kind, slot, numel, zero, nan, pos_inf, neg_inf, "
    "pos_start, pos, neg_start, neg FROM histogram_spans{where} ORDER BY rank, step, seq"
)


def _read(trace: Trace, where: _Where, steps: list[int], *, sampled: bool) -> pd.DataFrame:
    """The histograms of ``steps`` that ``where`` matches, as stored (each sign's occupied
    span of bins and where it starts); by DuckDB (the step range lets it skip the row groups
    outside), or where DuckDB fails on a part, by hooktrace's reader (whole rows), which
    leaves a damaged part out with a warning."""
    extra = ["step BETWEEN ? AND ?"]
    values = [*where.values, steps[0], steps[-1]]
    if sampled:
        extra.append("list_contains(?, step)")
        values.append(steps)
    try:
        return trace.sql(_RAW.format(where=where.sql(*extra)), values)
    except TraceError as exc:
        if not _engine_failed(exc):
            raise
    return trace.histograms(steps=steps, modules=where.names, kinds=where.kinds, ranks=where.ranks)


def _tidy(raw: pd.DataFrame) -> pd.DataFrame:
    """:func:`hist`'s rows of ``raw`` histograms (in rank, step, seq order; spans with their
    starts, or whole rows): a parameter or buffer recorded twice in a step (an evaluation's
    forward, then training's) keeps its last record, the records of a step are summed, and
    each non-empty bin is a row."""
    if raw.empty:
        return _empty()
    key = ["rank", "step", "module", "kind", "slot"]
    raw = raw.assign(**{name: raw[name].astype(str) for name in ("module", "kind", "slot")})
    last = raw.groupby(key, sort=False)["seq"].transform("max")
    raw = raw[~raw["kind"].isin(["param", "buffer"]) | (raw["seq"] == last)]
    groups = raw.groupby(key, sort=False)
    group = groups.ngroup().to_numpy()  # numbered as first met: in (rank, step, seq) order
    records = groups.agg(numel=("numel", "sum")).reset_index()
    pieces = []  # (record and step, which of BINS, exponent, count) of each non-empty bin
    for i, name in enumerate(BINS):
        if name in ("neg", "pos"):
            row, k, values = _occupied(raw, name)
            counts = np.zeros((len(records), MAGNITUDE_BINS), dtype=np.int64)
            np.add.at(counts, (group[row], k), values)
            at, k = np.nonzero(counts)
            pieces.append((at, np.full(len(at), i), k + EXPONENT_MIN - 1, counts[at, k]))
        else:
            total = np.zeros(len(records), dtype=np.int64)
            np.add.at(total, group, raw[name].to_numpy(dtype=np.int64))
            at = np.flatnonzero(total)
            pieces.append((at, np.full(len(at), i), np.zeros(len(at), np.int64), total[at]))
    at, which, exponent, count = (np.concatenate(p) for p in zip(*pieces, strict=True))
    sort = np.lexsort((exponent, which, at))
    at, which, exponent, count = at[sort], which[sort], exponent[sort], count[sort]
    rows = records.iloc[at].reset_index(drop=True)
    out = pd.DataFrame(
        {
            "rank": rows["rank"].astype("int64"),
            "step": rows["step"].astype("int64"),
            "module": rows["module"],
            "kind": rows["kind"],
            "slot": rows["slot"],
            "numel": rows["numel"].astype("int64"),
            "bin": np.asarray(BINS, dtype=object)[which],
            "exponent": pd.arrays.IntegerArray(
                exponent.astype(np.int64), which < BINS.index("neg")
            ),
            "count": count.astype(np.int64),
        }
    )
    out["fraction"] = out["count"] / out["numel"]  # never 0/0: a record of no values has no bins
    return out


def _occupied(raw: pd.DataFrame, sign: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row of ``raw``, magnitude bin, count) of each nonzero count of ``sign``, from spans
    stored from ``<sign>_start`` (or whole rows, which start at bin 0)."""
    spans = raw[sign].to_numpy()
    lengths = np.fromiter((len(v) for v in spans), dtype=np.int64, count=len(spans))
    empty = np.zeros(0, dtype=np.int64)
    values = np.concatenate([np.asarray(v, dtype=np.int64) for v in spans] or [empty])
    start = f"{sign}_start"
    starts = raw[start].to_numpy(dtype=np.int64) if start in raw else np.zeros(len(spans), int)
    row = np.repeat(np.arange(len(spans)), lengths)
    within = np.arange(len(values)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    k = np.repeat(starts, lengths) + within
    kept = values != 0
    return row[kept], k[kept], values[kept].astype(np.int64)


def _empty(attrs: dict[str, Any] | None = None) -> pd.DataFrame:
    frame = pd.DataFrame(
        {
            **{c: pd.Series(dtype="int64") for c in ("rank", "step")},
            **{c: pd.Series(dtype=str) for c in ("module", "kind", "slot")},
            "numel": pd.Series(dtype="int64"),
            "bin": pd.Series(dtype=str),
            "exponent": pd.Series(dtype="Int64"),
            "count": pd.Series(dtype="int64"),
            "fraction": pd.Series(dtype="float64"),
        }
    )
    frame.attrs.update(attrs or {})
    return frame


def _engine_failed(exc: TraceError) -> bool:
    import duckdb

    return isinstance(exc.__cause__, duckdb.Error)


def _span(first: int, last: int) -> str:
    return f"{first}" if first == last else f"{first}–{last}"
