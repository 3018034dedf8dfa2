"""``hooktrace.diff``: where and when two runs first diverge, and how far apart they are.

Never imports torch. Records align on (rank, step, micro_step, phase, module, call, kind,
slot); ``hooktrace.analyze.diff.compare`` says what "equal within tolerance" means. "First" is
execution order: the smallest (step, seq) of run A (seq of run B for records only B has).

Memory stays bounded: both runs are read a few steps at a time (about ``chunk_rows`` records
of each, the next chunk read while this one is compared), and only what differs is kept.
Records both runs hold bit for bit (``hooktrace.analyze.diff.same``) are counted as equal
without being aligned or compared. ``DiffResult.table`` holds the records that differ
(``rows="differing"``, the default) or every aligned record (``rows="all"``, as large as the
runs, each compared); give a ``sink`` to receive each chunk's rows instead of keeping them,
as the CLI does.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pandas as pd

from hooktrace.analyze.diff.compare import (
    KEYS,
    TABLE_DTYPES,
    TensorPair,
    align,
    compare,
)
from hooktrace.analyze.diff.read import (
    in_chunks,
    logical_chunk,
    read_ahead,
    read_chunk,
    set_aside_partials,
    stream_of,
)
from hooktrace.analyze.diff.result import Accumulator, DiffResult, Divergence, Structure
from hooktrace.analyze.diff.same import others, same_rows
from hooktrace.analyze.findings import module_pattern
from hooktrace.errors import ConfigError, HooktraceError, TraceError
from hooktrace.trace import schema
from hooktrace.trace.counts import records_per_step
from hooktrace.trace.filters import STEP_MAX, in_order, step_pair
from hooktrace.trace.reader import Trace, load, records_frame

__all__ = [
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "DiffResult",
    "Divergence",
    "NothingToCompare",
    "Structure",
    "diff",
]

DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-8
"""numpy.isclose's defaults; see diff_compare for what they are relative to."""

Run = str | os.PathLike[str] | Trace
StepFilter = str | tuple[int, int] | Iterable[int] | None
"""``"0-10,20"``, an inclusive ``(first, last)`` pair, or step numbers."""


MAX_ROWS = 1_000_000
"""How many records :func:`diff` keeps in ``DiffResult.table`` at most, by default: some
0.8 GB at the most, within the 2 GB the analyzer keeps to."""


class NothingToCompare(HooktraceError):
    """The two runs (after the filters) share no step: there is nothing to compare."""


def diff(
    run_a: Run,
    run_b: Run | None = None,
    *,
    rtol: float = DEFAULT_RTOL,
    atol: float = DEFAULT_ATOL,
    steps: StepFilter = None,
    modules: str | Iterable[str] | None = None,
    kinds: Iterable[str] | None = None,
    ranks: Iterable[int] | None = None,
    rank: int | None = None,
    against_rank: int | None = None,
    per_rank: bool = False,
    rows: Literal["differing", "all"] = "differing",
    sink: Callable[[pd.DataFrame], None] | None = None,
    stop_at_first: bool = False,
    chunk_rows: int = 250_000,
    max_rows: int | None = MAX_ROWS,
) -> DiffResult:
    """Compare two runs record by record, in execution order.

    ``modules`` is a regex searched in module names, or a list of exact names. ``rank`` with
    ``against_rank`` compares one rank against another (of ``run_b``, or of ``run_a`` itself
    when ``run_b`` is None): data-parallel ranks must hold equal parameters after every step.
    ``stop_at_first`` stops reading after the chunk holding the first divergence (and the
    next, read meanwhile).

    Where a run has several ranks, its logical tensors are compared
    (:mod:`hooktrace.trace.logical`: shards pooled, replicas counted once, the data-parallel
    ranks' activations pooled into the global batch's, their gradients divided by the
    data-parallel degree), so that runs of different layouts (one process, DDP, FSDP2, another
    world size) compare with no option. ``per_rank`` compares rank with rank instead, as do
    ``ranks`` and ``rank``/``against_rank``.

    ``table`` holds the records that differ (``rows="all"``: every record), at most
    ``max_rows`` of them (None: no bound): past it, the first ``max_rows``, and a note says
    how many it left out. ``sink``, where given, is handed them all instead, chunk by chunk,
    and ``table`` is empty: memory then stays bounded however many there are.

    Raises :class:`NothingToCompare` when the runs share no step, ``ConfigError`` on bad options
    and ``TraceError`` when a run cannot be read.
    """
    tolerances = (rtol, atol)
    if any(isinstance(t, bool) or not isinstance(t, numbers.Real) for t in tolerances) or not (
        rtol >= 0 and atol >= 0
    ):
        raise ConfigError(
            f"rtol and atol are numbers, 0 or more (got rtol={rtol!r}, atol={atol!r})"
        )
    if rank is not None and against_rank is None:  # (it would be left unused)
        raise ConfigError("rank goes with against_rank: give both, or ranks=[...] to filter")
    if rows not in ("differing", "all"):
        raise ConfigError(f"rows must be 'differing' or 'all' (got {rows!r})")
    if max_rows is not None and max_rows < 0:
        raise ConfigError(f"max_rows must be 0 or more, or None for no bound (got {max_rows})")
    if against_rank is not None and ranks is not None:
        raise ConfigError("give either ranks or rank/against_rank, not both")
    if run_b is None and against_rank is None:
        raise ConfigError(
            "give a second run to compare with, or against_rank to compare two ranks of one run"
        )
    kinds = _kinds(kinds)
    trace_a = run_a if isinstance(run_a, Trace) else load(run_a)
    trace_b = trace_a if run_b is None else (run_b if isinstance(run_b, Trace) else load(run_b))
    if modules is not None and not isinstance(modules, str):
        modules = [str(m) for m in modules]
    pair = against_rank is not None
    ranks_a = [rank or 0] if pair else (None if ranks is None else [int(r) for r in ranks])
    ranks_b = ranks_a if against_rank is None else [int(against_rank)]
    in_range = _step_predicate(steps)
    logical = not (per_rank or pair or ranks_a is not None) and (
        len(trace_a.ranks) > 1 or len(trace_b.ranks) > 1
    )

    plan_a = _plan(trace_a, "A", ranks_a, kinds, modules, in_range)
    plan_b = _plan(trace_b, "B", ranks_b, kinds, modules, in_range)
    names = sorted(set(plan_a.names) | set(plan_b.names)) if modules is not None else None
    common = sorted(set(plan_a.counts.index) & set(plan_b.counts.index))
    span_a, span_b = _span(plan_a.counts), _span(plan_b.counts)
    if not common:
        raise NothingToCompare(
            f"the runs share no recorded step (run A: steps {span_a[0]}–{span_a[1]}, run B: steps "
            f"{span_b[0]}–{span_b[1]}): nothing to compare; give runs that overlap, or other --steps"
        )
    size = plan_a.counts.reindex(common).to_numpy() + plan_b.counts.reindex(common).to_numpy()
    # a logical record's rank is the lowest behind it, which layouts need not share
    keys = [k for k in KEYS if k != "rank"] if pair or logical else list(KEYS)
    acc = Accumulator(last_step=common[-1])
    kept: list[pd.DataFrame] = []
    room = max_rows  # rows table may still take
    left_out = 0
    tensors = TensorPair(trace_a.path, trace_b.path)
    empty = pd.DataFrame({c: pd.Series(dtype=t) for c, t in TABLE_DTYPES.items()})
    span = (common[0], common[-1])
    streams = [
        stream_of(t, r, names, kinds, span, logical=logical)
        for t, r in ((trace_a, ranks_a), (trace_b, ranks_b))
    ]
    budget = max(1, chunk_rows) * 2
    chunks = in_chunks(common, size, budget, first=max(1, budget // 8))
    # the next chunk is read while this one is compared (a stop at the first divergence has
    # read one chunk past the one that holds it)
    reading: list[Callable[[list[int]], Any]] = [
        functools.partial(read_chunk, s, drop_rank=pair) for s in streams
    ]
    if logical:  # decided for each run, not each chunk: a chunk may hold one rank's steps
        reading = [
            _then(read, functools.partial(logical_chunk, layout=t.layout, ranks=len(t.ranks)))
            for read, t in zip(reading, (trace_a, trace_b), strict=True)
        ]
    reads = read_ahead(chunks, reading)
    partial = 0  # records set aside: partial sums are no logical tensor
    try:
        for chunk, tables in reads:
            if logical:
                tables, aside = set_aside_partials(tables)
                tables = [table.drop_columns(["rank"]) for table in tables]
                partial += aside
            # rows both runs hold bit for bit are equal: counted here, never compared
            same = same_rows(tables[0], tables[1], keys) if rows == "differing" else None
            if same is not None:
                acc.add_same(tables[0], same)
                tables = [others(table, same) for table in tables]
                if tables[0].num_rows == 0:
                    if sink is not None:
                        sink(empty.copy())
                    continue
            frames = [records_frame(table) for table in tables]
            del tables
            merged = align(frames[0], frames[1], keys)
            del frames
            if pair or logical:
                merged.insert(0, "rank", rank or 0)
            part = compare(merged, rtol=rtol, atol=atol, tensors=tensors)
            acc.add(part, merged)
            del merged
            keep = part if rows == "all" else part[part["status"] != "equal"]
            if not in_order(keep, ["step", "seq", "rank"]):
                keep = keep.sort_values(["step", "seq", "rank"], kind="stable")
            if sink is not None:
                sink(keep.reset_index(drop=True))
            elif room is None or len(keep) <= room:
                kept.append(keep)
                room = None if room is None else room - len(keep)
            else:
                kept.append(keep.iloc[:room])
                left_out += len(keep) - room
                room = 0
            if stop_at_first and acc.first is not None:
                acc.stopped_at = int(chunk[-1])
                break
    finally:
        reads.close()
        tensors.close()

    notes = _notes(trace_a, trace_b, span_a, span_b, common, plan_a, plan_b, acc.stopped_at)
    if logical:
        notes.insert(0, _logical_note(trace_a, trace_b))
    if partial:
        notes.insert(
            1,
            f"{partial} record(s) were not compared: a run holds their tensor as partial sums "
            "(a P(...) placement: a tensor-parallel layer's output before its reduction, which "
            "the next module receives reduced); `hooktrace diff --per-rank` shows them",
        )
    if tensors.unreadable:
        notes.append(
            f"{len(tensors.unreadable)} full tensor(s) could not be read (first: "
            f"{tensors.unreadable[0]}): their records were compared on statistics only; "
            "`hooktrace check` says what is damaged"
        )
    if left_out:
        shown, listed = max_rows or 0, "records" if rows == "all" else "differing records"
        command = "--all --format parquet" if rows == "all" else "--format parquet"
        notes.append(
            f"the table holds the first {shown:,} of {shown + left_out:,} {listed}"
            f"{' read' if acc.stopped_at is not None else ''} (max_rows): pass sink= to have "
            f"them all chunk by chunk, or max_rows=None (`hooktrace diff {command} -o FILE` "
            "writes them all)"
        )
    table = pd.concat([empty, *kept], ignore_index=True).astype(TABLE_DTYPES)
    first = acc.first
    if first is not None and logical:  # its rank is the lowest of those pooled into it
        first = dataclasses.replace(first, pooled=True)
    return DiffResult(
        run_a=trace_a.path, run_b=trace_b.path, rtol=rtol, atol=atol, first=first,
        table=table, structure=acc.structure(plan_a.counts.index, plan_b.counts.index, common),
        modules=acc.module_table(), steps_a=span_a, steps_b=span_b, steps=len(common),
        first_step=common[0], last_step=common[-1], records=acc.records, differing=acc.differing,
        complete=acc.stopped_at is None, ranks=(rank or 0, against_rank) if pair else (None, None),
        notes=notes,
    )  # fmt: skip


def _then(first: Callable[[Any], Any], second: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda chunk: second(first(chunk))


def _logical_note(a: Trace, b: Trace) -> str:
    """What a comparison of logical tensors did, in one line."""
    layouts = " and ".join(
        f"run {side} {len(t.ranks)} ranks" if len(t.ranks) > 1 else f"run {side} one rank"
        for side, t in (("A", a), ("B", b))
    )
    return (
        f"compared logical tensors ({layouts}): shards pooled, replicas counted once, the "
        "data-parallel ranks' activations pooled into the global batch's and their gradients "
        "divided by the data-parallel degree; --per-rank compares rank with rank"
    )


@dataclass
class _Plan:
    counts: pd.Series  # records per step, indexed by step
    names: list[str]  # modules matching the module filter


def _plan(
    trace: Trace,
    side: str,
    ranks: list[int] | None,
    kinds: list[str] | None,
    modules: str | Iterable[str] | None,
    in_range: _StepRanges,
) -> _Plan:
    """Count the records per step (and find the modules) that the filters select, without
    holding a column of the trace: one DuckDB query, which reads only the row groups of the
    steps asked for."""
    names: list[str] | None = None
    if isinstance(modules, str):
        pattern = module_pattern(modules)
        found = _distinct_modules(trace, kinds, ranks)
        names = [m for m in found if pattern.search(m)]
    elif modules is not None:
        names = [str(m) for m in modules]
    if ranks is not None and not set(ranks) & set(trace.ranks):
        raise NothingToCompare(
            f"run {side} ({trace.path}) has no rank {', '.join(map(str, ranks))}: its ranks are "
            f"{', '.join(map(str, trace.ranks))}"
        )
    counts = _step_counts(trace, names, kinds, ranks, in_range)
    if counts.empty:
        filtered = modules is not None or kinds is not None or ranks is not None
        filtered = filtered or in_range.ranges is not None
        if trace.skipped:
            raise NothingToCompare(
                f"run {side} ({trace.path}) has no readable records"
                + (" that match the filters" if filtered else "")
                + f": {len(trace.skipped)} damaged part(s) were left out; "
                f"`hooktrace check {trace.path}` says what was lost"
            )
        raise NothingToCompare(
            f"run {side} ({trace.path}) has no records that match the filters (modules, kinds, "
            "ranks, steps): loosen them"
            if filtered
            else f"run {side} ({trace.path}) holds no records"
        )
    return _Plan(counts, names or [])


def _where(
    names: list[str] | None,
    kinds: list[str] | None,
    ranks: list[int] | None,
    in_range: _StepRanges | None,
) -> tuple[str, list[Any]]:
    """A WHERE clause for the filters, and its parameters."""
    clauses: list[str] = []
    values: list[Any] = []
    for column, chosen in (("module", names), ("kind", kinds), ("rank", ranks)):
        if chosen is not None:
            clauses.append(f"{column} IN (SELECT unnest(?))")
            values.append(list(chosen))
    if in_range is not None and in_range.ranges is not None:
        spans = []
        for lo, hi in in_range.ranges:
            spans.append("step >= ?" if hi == float("inf") else "step BETWEEN ? AND ?")
            values += [int(lo)] if hi == float("inf") else [int(lo), int(hi)]
        clauses.append("(" + " OR ".join(spans or ["false"]) + ")")
    return (" WHERE " + " AND ".join(clauses)) if clauses else "", values


def _step_counts(
    trace: Trace,
    names: list[str] | None,
    kinds: list[str] | None,
    ranks: list[int] | None,
    in_range: _StepRanges,
) -> pd.Series:
    """Records per step, indexed by step, in step order. Without a module or kind filter,
    from the steps table where the parts' footers agree with it; else a window of a few
    parts is read by hooktrace's reader (the step column of those parts); more, by one
    DuckDB query, or where DuckDB cannot decode a part, by the reader a part at a time."""
    if names is None and kinds is None:
        counted = records_per_step(trace)
        if counted is not None:
            if ranks is not None:
                counted = counted[counted["rank"].isin(ranks)]
            per_step = counted.groupby("step")["records"].sum().sort_index()
            return per_step[in_range(per_step.index.to_series()).to_numpy()].astype("int64")
    span: tuple[int, int] | None = None
    if in_range.ranges:
        lo, hi = min(r[0] for r in in_range.ranges), max(r[1] for r in in_range.ranges)
        span = (int(lo), int(min(hi, 2**62)))
    if span is None or len(trace._parts_holding(*span)) > _FEW_PARTS:
        where, values = _where(names, kinds, ranks, in_range)
        try:
            counts = trace.sql(
                f"SELECT step, count(*) AS n FROM rank_records{where} GROUP BY step", values
            )
            return counts.set_index("step")["n"].astype("int64").sort_index()
        except TraceError as exc:
            if not _engine_failed(exc):
                raise
        # a part DuckDB cannot decode: hooktrace's reader leaves it out, with a warning
    return _counted_by_reader(trace, names, kinds, ranks, span, in_range)


def _counted_by_reader(
    trace: Trace,
    names: list[str] | None,
    kinds: list[str] | None,
    ranks: list[int] | None,
    span: tuple[int, int] | None,
    in_range: _StepRanges,
) -> pd.Series:
    """:func:`_step_counts` by hooktrace's reader, which leaves a damaged part out with a
    warning: the step column streamed a part's steps at a time (a part a rank), counted as
    it comes, so that a trace of 10^8 records is never held (its step column alone is 800
    MB). Where a part is found damaged on the way, after some of its row groups were
    counted, the count starts again without it: the comparison reads none of it."""
    while True:
        parts = len(trace._parts[schema.RECORDS_DIR])
        stream = trace.stream(columns=["step"], steps=span, modules=names, kinds=kinds, ranks=ranks)
        ends = trace.part_spans()["last"]
        counted: list[pd.Series] = []
        for last in [*sorted({int(e) for e in ends if e >= 0}), STEP_MAX]:
            steps = stream.through(last).column("step").to_numpy()
            if len(steps):
                found, n = np.unique(steps, return_counts=True)
                counted.append(pd.Series(n, index=pd.Index(found, name="step")))
        if len(trace._parts[schema.RECORDS_DIR]) == parts:
            break
    if not counted:
        return pd.Series(dtype="int64", index=pd.Index([], dtype="int64", name="step"))
    per_step = pd.concat(counted).groupby(level=0).sum()  # a step across two parts' windows
    return per_step[in_range(per_step.index.to_series()).to_numpy()].astype("int64")


_FEW_PARTS = 4


def _distinct_modules(trace: Trace, kinds: list[str] | None, ranks: list[int] | None) -> list[str]:
    where, values = _where(None, kinds, ranks, None)
    try:
        found = trace.sql(f"SELECT DISTINCT module FROM rank_records{where}", values)["module"]
    except TraceError as exc:
        if not _engine_failed(exc):
            raise
        found = trace.query(columns=["module"], kinds=kinds, ranks=ranks, logical=False)["module"]
    return [str(m) for m in found.astype("str").unique()]


def _engine_failed(exc: TraceError) -> bool:
    import duckdb

    return isinstance(exc.__cause__, duckdb.Error)


def _kinds(kinds: Iterable[str] | None) -> list[str] | None:
    if kinds is None:
        return None
    chosen = [str(k) for k in kinds]
    unknown = sorted(set(chosen) - set(schema.KINDS))
    if unknown:
        raise ConfigError(
            f"unknown kind(s) {', '.join(unknown)}: choose from {', '.join(schema.KINDS)}"
        )
    return chosen


class _StepRanges:
    """The steps a ``steps`` filter selects: inclusive ranges (``ranges`` None: every step);
    called on a Series of steps, the mask of those selected."""

    def __init__(self, ranges: list[tuple[float, float]] | None) -> None:
        self.ranges = ranges

    def __call__(self, steps: pd.Series) -> pd.Series:
        if self.ranges is None:
            return steps == steps
        mask = steps != steps
        for lo, hi in self.ranges:
            mask |= (steps >= lo) & (steps <= hi)
        return mask


def _step_predicate(spec: StepFilter) -> _StepRanges:
    if spec is None:
        return _StepRanges(None)
    ranges: list[tuple[float, float]] = []
    pair = step_pair(spec)
    if pair is not None:
        ranges.append(pair)
    elif isinstance(spec, str):
        for part in filter(None, (p.strip() for p in spec.split(","))):
            first, dash, last = part.partition("-")
            try:
                lo = int(first)
                hi = (float("inf") if not last.strip() else int(last)) if dash else lo
            except ValueError:
                raise ConfigError(
                    f"bad step range {part!r}: write steps as '5', '0-10' or '100-'"
                ) from None
            ranges.append((lo, hi))
    else:
        ranges.extend((int(s), int(s)) for s in spec)
    beyond = [v for pair in ranges for v in pair if not 0 <= v <= STEP_MAX and v != float("inf")]
    if beyond:
        raise ConfigError(
            f"bad step {beyond[0]}: steps count from 0 and go up to {STEP_MAX:,} (int64)"
        )
    return _StepRanges(ranges)


def _span(counts: pd.Series) -> tuple[int, int]:
    return int(counts.index.min()), int(counts.index.max())


def _notes(
    a: Trace, b: Trace, span_a: tuple[int, int], span_b: tuple[int, int], common: list[int],
    plan_a: _Plan, plan_b: _Plan, stopped_at: int | None,
) -> list[str]:  # fmt: skip
    notes = []
    for side, trace in (("A", a), ("B", b)):
        if trace.status != schema.STATUS_COMPLETE:
            notes.append(
                f"run {side} is {trace.status}: compared what it holds (`hooktrace check {trace.path}`)"
            )
        if trace.skipped:
            notes.append(f"run {side} has {len(trace.skipped)} unreadable file(s), left out")
        if b is a:
            break
    if span_a != span_b:
        notes.append(
            f"compared the overlap, steps {common[0]}–{common[-1]}: run A has steps {span_a[0]}–{span_a[1]}, "
            f"run B {span_b[0]}–{span_b[1]}"
        )
    inside = [
        s for s in (*plan_a.counts.index, *plan_b.counts.index) if common[0] <= s <= common[-1]
    ]
    only = len(inside) - 2 * len(common)
    if only:
        notes.append(
            f"{only} step(s) recorded by one run only were not compared (see .structure.steps_only_a/_b)"
        )
    if stopped_at is not None:
        notes.append(
            f"stopped at the first divergence: table and modules cover steps up to {stopped_at} only"
        )
    return notes
