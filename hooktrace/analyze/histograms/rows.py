"""How :func:`~hooktrace.analyze.histograms.histograms.hist` reads: its options as one DuckDB WHERE
clause, the steps in chunks of whole steps, and each chunk's histograms, as stored (each
sign's occupied span of bins), unfolded into the tidy rows (:data:`COLUMNS`). Never imports
torch.

Apart from :mod:`hooktrace.analyze.histograms.histograms` because this is the reading and the
unfolding, with numpy over DuckDB's rows; that module holds the questions asked of them
(``hist``, ``histogrammed``, ``per_step``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import StepsSpec, step_filter
from hooktrace.errors import ConfigError, TraceError
from hooktrace.trace import schema
from hooktrace.trace.histograms import EXPONENT_MIN, MAGNITUDE_BINS
from hooktrace.trace.reader import Trace
from hooktrace.trace.sql import logical_spans

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


def kinds_given(kinds: Sequence[str] | str | None) -> list[str] | None:
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


class Where:
    """The WHERE clause of the options, and its parameters; module regexes resolved to names
    (Python's regex rules, as the other commands; DuckDB's differ). ``logical``: whether the
    histograms are read as the logical tensors' (a run of several ranks, no rank chosen, not
    ``per_rank``): each under its logical record's rank and seq, a replica once."""

    def __init__(
        self,
        trace: Trace,
        *,
        modules: ModulesSpec,
        kinds: list[str] | None,
        steps: StepsSpec,
        ranks: Sequence[int] | None,
        per_rank: bool = False,
    ) -> None:
        self.trace = trace
        self.modules, self.kinds, self.ranks = modules, kinds, ranks
        self.logical = not per_rank and trace.logical_by_default(ranks)
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
        found = self.trace.sql("SELECT DISTINCT module FROM rank_histogram_spans")["module"]
        return sorted(str(m) for m in found if pattern.search(str(m)))

    def sql(self, *extra: str) -> str:
        clauses = [*self.clauses, *extra]
        return (" WHERE " + " AND ".join(clauses)) if clauses else ""

    def source(self, *extra: str) -> str:
        """The histograms these options keep, as a relation to select from (``extra``:
        clauses besides, their values after :attr:`values`): ``rank_histogram_spans``, or where
        :attr:`logical`, the parts of the logical tensors (:func:`sql.logical_spans`)."""
        if not self.logical:
            return f"rank_histogram_spans{self.sql(*extra)}"
        return f"{logical_spans(self.sql(*extra), self.trace.layout)} AS logical_spans_"

    def rows_per_step(self) -> pd.Series:
        """Histograms per step, indexed by step, in step order (no bins read)."""
        found = self.trace.sql(
            f"SELECT step, count(*) AS n FROM rank_histogram_spans{self.sql()} GROUP BY step "
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


def chunks(per_step: pd.Series, rows: int) -> list[list[int]]:
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
    "pos_start, pos, neg_start, neg FROM {source} ORDER BY rank, step, seq"
)


def read(trace: Trace, where: Where, steps: list[int], *, sampled: bool) -> pd.DataFrame:
    """The histograms of ``steps`` that ``where`` matches, as stored (each sign's occupied
    span of bins and where it starts); by DuckDB (the step range lets it skip the row groups
    outside), or where DuckDB fails on a part, by hooktrace's reader (whole rows), which
    leaves a damaged part out with a warning (rank by rank only: :attr:`Where.logical` raises
    instead)."""
    extra = ["step BETWEEN ? AND ?"]
    values = [*where.values, steps[0], steps[-1]]
    if sampled:
        extra.append("list_contains(?, step)")
        values.append(steps)
    try:
        return trace.sql(_RAW.format(source=where.source(*extra)), values)
    except TraceError as exc:
        if not _engine_failed(exc):
            raise
        if where.logical:  # the reader's way round a damaged part reads rank by rank
            raise TraceError(
                f"{exc}: read the ranks' histograms apart (--per-rank) to leave a damaged part out"
            ) from exc
    return trace.histograms(
        steps=steps, modules=where.names, kinds=where.kinds, ranks=where.ranks, logical=False
    )


def tidy(raw: pd.DataFrame) -> pd.DataFrame:
    """``hist``'s rows of ``raw`` histograms (in rank, step, seq order; spans with their
    starts, or whole rows): a parameter or buffer recorded twice in a step (an evaluation's
    forward, then training's) keeps its last record, the records of a step are summed, and
    each non-empty bin is a row."""
    if raw.empty:
        return empty()
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


def empty(attrs: dict[str, Any] | None = None) -> pd.DataFrame:
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
