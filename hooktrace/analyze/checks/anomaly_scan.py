"""The one pass over the records that :func:`hooktrace.anomalies` needs, as DuckDB queries.
Never imports torch.

Each reduction is one SQL query over a relation of records: the trace's ``rank_records`` view
(DuckDB reads only the columns it needs, on every core, spilling past its memory limit), or,
where DuckDB cannot decode a part (it does not check page checksums but fails on what it
cannot decode), each chunk of whole steps that hooktrace's reader gives, which leaves the
damaged parts out with a warning. Either way the same queries answer. Over the view, the
norms are made when the series checks read them: the squares of the records' norms summed
by numpy into a grid of step by (rank, module), where it holds at most
:data:`DENSE_BYTES`; past that, grouped and sorted by module in DuckDB (no table of one value
per module per step is made). Over chunks, they go into a
:class:`~hooktrace.analyze.checks.series_store.SeriesStore` table. Only the small tallies, the
tanh/sigmoid outputs and the steps that hold a NaN or an Inf come back to Python; those
steps are then read in full by the reader for the non-finite origins.

Sums are those of :mod:`hooktrace.analyze.checks.grouped` to the bit: Kahan's, in seq order. A group
of one or two values sums alike in any order (DuckDB's plain sum, numpy's in the grid); a
larger one is summed again in seq order (``_EXACT``), only where there is one.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pandas as pd
import pyarrow as pa

from hooktrace.analyze.checks import series_store
from hooktrace.analyze.checks.nonfinite import NonFinite
from hooktrace.analyze.checks.series_store import SeriesStore
from hooktrace.analyze.findings import modules_of_type, step_chunks
from hooktrace.trace import sql
from hooktrace.trace.counts import records_per_step
from hooktrace.trace.logical import NEEDED
from hooktrace.trace.logical_arrays import logical_table
from hooktrace.trace.reader import Trace, records_frame

TANH_RANGE = ("Tanh", "Hardtanh", "Softsign")
SIGMOID_RANGE = ("Sigmoid", "Hardsigmoid")
COLUMNS = ["rank", "step", "micro_step", "phase", "seq", "module", "kind", "slot", "dtype",
           "numel", "mean", "std", "norm", "nan_count", "inf_count"]  # fmt: skip
"""What the non-finite search reads of a step; the queries read fewer."""

_LOGICAL_COLUMNS = dict.fromkeys([*COLUMNS, *NEEDED])
"""What a chunk of logical records is made of."""

# the records of a relation ({records}) that the queries read, string columns as VARCHAR (a
# chunk's are categoricals), steps as selected ({where})
_ROWS = """
    SELECT rank, step, seq, module::VARCHAR AS module, kind::VARCHAR AS kind,
           slot::VARCHAR AS slot, dtype::VARCHAR AS dtype, phase::VARCHAR AS phase, {more}
    FROM {records} WHERE {where}"""

# the squares of the norms of the records that make a series ({which}): a missing norm is NaN
_SQUARES = """(SELECT *, x * x AS square FROM (
    SELECT *, coalesce(norm, 'NaN'::DOUBLE) AS x FROM ({rows}) WHERE {which}))"""

# the norm of a group's records: the root of their summed squares (or of their mean: {per}),
# NaN if any norm is (DuckDB's sum is NaN then, as squares are never negative); NULL where
# the group holds more than two (see _EXACT); with the first seq where {seq} says so (the
# rank_records view's series leave it out, and take it from their squares or _FIRST_SEQ: see
# _Queried)
_NORMS = """
    SELECT g.rank, i.id AS module, g.step, g.value, g.seq FROM (
        SELECT rank, module, step, {seq} AS seq,
               CASE WHEN count(*) <= 2 THEN sqrt(sum(square){per}) END AS value
        FROM {squares} GROUP BY ALL
    ) g JOIN {ids} i USING (module)"""

# the norms that _NORMS left NULL: NaN if any norm is, else their squares summed one after
# the other in seq order. Not bool_or(isnan(square)): DuckDB 2.0 folds that to false, trusting
# the Parquet statistics of norm (which leave NaN out) through the square; NaN sorts above
# every number, so max() finds it
_EXACT = """
    SELECT g.rank, i.id AS module, g.step, g.value FROM (
        SELECT rank, module, step, CASE WHEN isnan(max(square)) THEN 'NaN'::DOUBLE
                                        ELSE sqrt({kahan}{per}) END AS value
        FROM {squares} GROUP BY ALL HAVING count(*) > 2
    ) g JOIN {ids} i USING (module)"""

# the first seq of each module's records of a series ({which}), by rank
_FIRST_SEQ = """
    SELECT r.rank, i.id AS module, min(r.seq) AS seq FROM ({rows}) r JOIN {ids} i USING (module)
    WHERE {which} GROUP BY ALL"""

# Kahan's sum, NaN left out, a compensation that turns NaN starting again from zero:
# grouped.Groups.sum, step for step
_KAHAN_SUM = """list_reduce(list(square ORDER BY seq), lambda acc, v: CASE WHEN isnan(v) THEN acc
    ELSE {'s': acc.s + (v - acc.c),
          'c': CASE WHEN isnan(((acc.s + (v - acc.c)) - acc.s) - (v - acc.c)) THEN 0.0
                    ELSE ((acc.s + (v - acc.c)) - acc.s) - (v - acc.c) END}
    END, {'s': 0.0::DOUBLE, 'c': 0.0::DOUBLE}).s"""

_GRADS = "kind = 'grad_param' AND dtype <> 'None'"
_OUTPUTS = "kind = 'output' AND phase = 'train'"


class Scan:
    """What one pass over the records keeps: non-finite origins, one norm per module per step
    (in :attr:`norms`), and per-module tallies. Modules are integer ids into ``names``, in the
    order they first show (by step, rank, seq)."""

    def __init__(self, trace: Trace, saturation: float) -> None:
        modules = trace.modules.drop_duplicates("module")
        names = modules["module"].astype(str)
        self.trace = trace
        self.nonfinite = NonFinite(
            dict(zip(names, modules["parent"].astype(str), strict=True)),
            dict(zip(names, modules["root"].astype(str), strict=True)),
        )
        self.ranges = {
            **dict.fromkeys(modules_of_type(trace.modules, TANH_RANGE), "tanh"),
            **dict.fromkeys(modules_of_type(trace.modules, SIGMOID_RANGE), "sigmoid"),
        }
        self.saturation = saturation
        self.names: list[str] = []
        self._ids: dict[str, int] = {}
        self._steps: set[int] = set()  # read, of any rank: a step of 2 ranks is one step
        self._con: Any = None  # the trace's (its rank_records view), or one of the scan's own
        self._owned = False
        self._relations = f"hooktrace_{id(self):x}"  # ids, and a chunk of records
        # grads, outputs: rank, module, step, value, seq; queries over the rank_records view, or a
        # table filled chunk by chunk
        self.norms: SeriesStore | _Queried | None = None  # made by read() or read_chunks()
        self.per_slot: list[pd.DataFrame] = []  # rank, module, slot: steps, none, first, last
        self.zero: list[pd.DataFrame] = []  # rank, module: steps, first, last, slots
        self.saturated: list[pd.DataFrame] = []  # rank, module: steps, hit, first, last, value

    @property
    def steps(self) -> int:
        """The steps read: one for all ranks' records of a step."""
        return len(self._steps)

    def read(self, steps: tuple[int, int] | list[int] | None, chunk_rows: int) -> None:
        """Every record of ``steps``, through the rank_records view: the steps that hold a NaN or
        an Inf are then read in full by hooktrace's reader, ``chunk_rows`` at a time."""
        self._con = self.trace._duckdb()
        where, parameters = _where(steps)
        recorded = self._recorded(steps, where, parameters)
        found, queries = self._reduce(sql.RANK_RECORDS, where, parameters, recorded)
        read = self.nonfinite.recorded  # the steps of each rank read
        grid = (
            np.array(sorted(read), dtype=np.int64),
            np.unique(np.concatenate([np.asarray(s, dtype=np.int64) for s in read.values()])),
        ) if read else None  # fmt: skip
        self.norms = _Queried(self._con, queries, parameters, self._relations, grid)
        if found:
            for chunk in step_chunks(self.trace, found, chunk_rows):
                self.nonfinite.search(self.trace.query(columns=COLUMNS, steps=chunk, logical=False))

    def read_chunks(
        self, steps: tuple[int, int] | list[int] | None, chunk_rows: int, *, logical: bool = False
    ) -> None:
        """Every record of ``steps``, through hooktrace's reader, ``chunk_rows`` at a time.
        ``logical``: the series, tallies and tanh/sigmoid outputs of the logical records
        (:mod:`hooktrace.trace.logical`, each under the lowest rank behind it); the
        non-finite origins of each rank's own records, as they came (which rank, and its
        capture)."""
        rare = {"micro_step"} | (set() if self.ranges else {"numel", "mean", "std"})
        columns = [c for c in COLUMNS if c not in rare]
        self._con, self._owned = sql.open_connection(), True  # the rank_records view is not needed
        self.norms = store = SeriesStore(self._con)
        layout = self.trace.layout
        for chunk in step_chunks(self.trace, steps, chunk_rows):
            if logical:
                table = self.trace.query_table(columns=[*_LOGICAL_COLUMNS], steps=chunk)
                frame = records_frame(logical_table(table, layout).select(columns))
                frame = frame.sort_values(["rank", "step", "seq"], kind="stable")
                self.nonfinite.add(records_frame(table.select(COLUMNS)))  # steps, origins
            else:
                frame = self.trace.query(columns=columns, steps=chunk, logical=False)
            if frame.empty:
                continue
            chunk_name = f"{self._relations}_records"
            self._con.register(chunk_name, frame)
            try:
                found, queries = self._reduce(chunk_name, "true", [], steps_told=logical)
                for series, (norms, exact, *_) in queries.items():
                    store.insert(series, norms)
                    table_name = store.table(series)
                    self._con.execute(
                        f"UPDATE {table_name} AS s SET value = k.value FROM ({exact}) k WHERE "
                        "s.value IS NULL AND s.rank = k.rank AND s.module = k.module AND s.step = k.step"
                    )
            finally:
                self._con.unregister(chunk_name)
            if found and not logical:  # the origins need every column: the same rows, in order
                more = self.trace.query(
                    columns=["rank", "step", "seq", *rare], steps=chunk, logical=False
                )
                self.nonfinite.search(frame.assign(**{c: more[c].to_numpy() for c in rare}))

    def series(self, name: str) -> Iterator[pd.DataFrame]:
        """The norms of series ``name`` (``grads``, ``outputs``) a few whole modules at a
        time, once :meth:`read` or :meth:`read_chunks` made them."""
        if self.norms is None:
            raise RuntimeError("the records were not read: call read() or read_chunks() first")
        return self.norms.tables(name, self.names)

    def close(self) -> None:
        if self.norms is not None:
            self.norms.close()
        if self._owned:
            self._con.close()
        elif self._con is not None:
            self._con.execute(f"DROP TABLE IF EXISTS {self._relations}_ids")
            self._con.execute(f"DROP TYPE IF EXISTS {self._relations}_modules")

    def _recorded(
        self, steps: tuple[int, int] | list[int] | None, where: str, parameters: list[Any]
    ) -> dict[str, np.ndarray] | None:
        """``rank``, ``step`` and ``bad`` (it holds a NaN or an Inf) of each (rank, step) of
        the rank_records view that ``steps`` selects, in order: the steps from the steps table,
        where the parts' footers agree with it (else None), the bad ones from the records
        that count a NaN or an Inf, which the row groups' statistics rule out for nearly
        every group (100M records: 0.08 s, against 0.5 s to group them all by step)."""
        counted = records_per_step(self.trace)
        if counted is None:
            return None
        if isinstance(steps, tuple):
            counted = counted[counted["step"].between(steps[0], steps[1])]
        elif steps is not None:
            counted = counted[counted["step"].isin(steps)]
        counted = counted.sort_values(["rank", "step"])
        bad = self._con.execute(
            f"SELECT DISTINCT rank, step FROM {sql.RANK_RECORDS} WHERE ({where}) "
            "AND (nan_count > 0 OR inf_count > 0)",
            parameters,
        ).df()
        rank, step = counted["rank"].to_numpy(np.int64), counted["step"].to_numpy(np.int64)
        marked = pd.MultiIndex.from_arrays([rank, step]).isin(
            pd.MultiIndex.from_arrays([bad["rank"].astype(np.int64), bad["step"]])
        )
        return {"rank": rank, "step": step, "bad": np.asarray(marked)}

    def _reduce(
        self,
        records: str,
        where: str,
        parameters: list[Any],
        recorded: dict[str, np.ndarray] | None = None,
        *,
        steps_told: bool = False,
    ) -> tuple[list[int], dict[str, _Series]]:
        """Add the tallies of the records of the relation ``records`` (of whole steps,
        ``where``; ``recorded``: its steps, where :meth:`_recorded` knows them); the steps
        with a NaN or an Inf, in order, and the queries of the series (``grads``,
        ``outputs``): the norms (:data:`_NORMS`) and the exact ones that they leave NULL
        (:data:`_EXACT`). ``steps_told``: the non-finite search was told the steps read
        already (of other records than these)."""

        def run(query: str, *, extra: list[Any] | None = None) -> Any:
            return self._con.execute(query, [*parameters, *(extra or [])])

        if recorded is None:
            recorded = run(
                f"SELECT rank, step, coalesce(bool_or(nan_count > 0 OR inf_count > 0), false) "
                f"AS bad FROM {records} WHERE {where} GROUP BY ALL ORDER BY rank, step"
            ).fetchnumpy()
        if not len(recorded["step"]):
            return [], {}
        self._steps.update(np.unique(recorded["step"]).tolist())
        if not steps_told:  # (the logical records' ranks are not those of the origins)
            self.nonfinite.add_steps(recorded["rank"].astype(np.int64), recorded["step"])
        ids = self._module_ids(run(_FIRST_SHOWN.format(records=records, where=where)))
        more = "norm, nan_count, inf_count" + (", numel, mean, std" if self.ranges else "")
        rows = _ROWS.format(records=records, where=where, more=more)
        queries = {}
        # the seq orders modules by execution for the output norms only: the gradient checks
        # do not look at it (0, and a narrower sort)
        for series, which, per, seq in (
            ("grads", _GRADS, "", "0"),
            ("outputs", _OUTPUTS, " / count(*)", "min(seq)"),
        ):
            squares = _SQUARES.format(rows=rows, which=which)
            ordered = seq != "0"
            queries[series] = _Series(
                _NORMS.format(squares=squares, per=per, ids=ids, seq=seq),
                _EXACT.format(kahan=_KAHAN_SUM, squares=squares, per=per, ids=ids),
                f"SELECT rank, module::{self._relations}_modules AS module, step, square"
                f"{', seq' if ordered else ''} FROM {squares}",
                mean=bool(per),
                first_seq=_FIRST_SEQ.format(rows=rows, ids=ids, which=which) if ordered else None,
            )
        self._tally_params(run, rows, ids, np.unique(recorded["step"]))
        if self.ranges:
            self._tally_saturation(
                run(
                    f"SELECT r.rank, i.id AS module, r.step, r.mean, r.std, r.numel "
                    f"FROM ({rows}) r JOIN {ids} i USING (module) "
                    f"WHERE {_OUTPUTS} AND list_contains(?, r.module) ORDER BY r.rank, r.step, r.seq",
                    extra=[list(self.ranges)],
                ).df()
            )
        bad = recorded["bad"].astype(bool)
        return sorted({int(s) for s in recorded["step"][bad].tolist()}), queries

    def _module_ids(self, first_shown: Any) -> str:
        """Ids for the modules of ``first_shown`` (names, in order) not seen before; the name
        of the DuckDB table of them all (module, id)."""
        new = [
            name for name in first_shown.fetchnumpy()["module"].tolist() if name not in self._ids
        ]
        for name in new:
            self._ids[name] = len(self.names)
            self.names.append(name)
        ids = f"{self._relations}_ids"
        self._con.execute(f"CREATE TEMP TABLE IF NOT EXISTS {ids} (module VARCHAR, id INTEGER)")
        # the names as an ENUM too, in id order: a cast to it gives the ids in the records'
        # order, where a join with the table would not keep it
        self._con.execute(
            f"CREATE OR REPLACE TYPE {self._relations}_modules AS ENUM "
            "(SELECT unnest(?::VARCHAR[]))",
            [self.names],
        )
        if new:
            added = pd.DataFrame({"module": new, "id": [self._ids[n] for n in new]})
            self._con.register(f"{ids}_new", added)
            self._con.execute(f"INSERT INTO {ids} SELECT * FROM {ids}_new")
            self._con.unregister(f"{ids}_new")
        return ids

    def _tally_params(self, run: Any, rows: str, ids: str, steps: np.ndarray) -> None:
        """Per (rank, module, slot) of the grad_param records: steps, steps with .grad None,
        first and last step; and per (rank, module), the steps whose gradient was exactly
        zero. ``steps``: the distinct steps recorded, in order."""
        for steps_sql, extra in _distinct_steps(steps):
            per_slot = run(
                f"SELECT rank, i.id AS module, slot, {steps_sql} AS steps, "
                "count(*) FILTER (WHERE dtype = 'None') AS none, min(step) AS first, "
                f"max(step) AS last FROM ({rows}) JOIN {ids} i USING (module) "
                "WHERE kind = 'grad_param' AND step BETWEEN ? AND ? GROUP BY ALL",
                extra=extra,
            ).df()
            if not per_slot.empty:
                self.per_slot.append(per_slot.set_index(["rank", "module", "slot"]))
        if not self.per_slot:
            return
        zero = run(
            f"SELECT rank, i.id AS module, count(DISTINCT step) AS steps, min(step) AS first, "
            f"max(step) AS last, list(DISTINCT slot) AS slots FROM ({rows}) "
            f"JOIN {ids} i USING (module) WHERE {_GRADS} AND norm = 0 GROUP BY ALL"
        ).df()
        if not zero.empty:
            zero["slots"] = [set(s) for s in zero["slots"]]
            self.zero.append(zero.set_index(["rank", "module"]))

    def _tally_saturation(self, rows: pd.DataFrame) -> None:
        """Per step, the numel-weighted mean square of the output mapped onto [-1, 1]."""
        if rows.empty:
            return
        sigmoid = {
            self._ids[m] for m, r in self.ranges.items() if r == "sigmoid" and m in self._ids
        }
        mean, square = (
            rows["mean"].to_numpy(),
            rows["std"].to_numpy() ** 2 + rows["mean"].to_numpy() ** 2,
        )
        scaled = np.where(
            rows["module"].isin(sigmoid).to_numpy(), 4 * square - 4 * mean + 1, square
        )
        numel = rows["numel"].to_numpy()
        per_step = (
            pd.DataFrame({"rank": rows["rank"].to_numpy(), "module": rows["module"].to_numpy(),
                          "step": rows["step"].to_numpy(), "w": scaled * numel, "n": numel})
            .groupby(["rank", "module", "step"]).sum()
        )  # fmt: skip
        value = (per_step["w"] / per_step["n"]).rename("value").reset_index()
        value["hit"] = value["value"] >= self.saturation
        hits = value[value["hit"]]
        tally = value.groupby(["rank", "module"]).agg(steps=("step", "size"), hit=("hit", "sum"))
        found = hits.groupby(["rank", "module"]).agg(
            first=("step", "min"), last=("step", "max"), value=("value", "max")
        )
        self.saturated.append(tally.join(found, how="left"))


# the modules in the order they first show: by step, then rank and seq at that step
_FIRST_SHOWN = """
    WITH firsts AS (SELECT module, min(step) AS step FROM {records} WHERE {where} GROUP BY 1)
    SELECT f.module::VARCHAR AS module FROM {records} r JOIN firsts f USING (module, step)
    GROUP BY f.module, f.step ORDER BY f.step, min({{'r': r.rank, 'q': r.seq}})"""

STEP_BITS = 1 << 16
"""Steps a window of :func:`_distinct_steps` spans at most: a bit each, per parameter."""


def _distinct_steps(steps: np.ndarray) -> list[tuple[str, list[int]]]:
    """How to count the distinct steps of a group whose records lie in ``steps`` (distinct,
    in order): SQL, and the window of steps (first, last) it counts in, for each window.
    A bit per step where a few windows of :data:`STEP_BITS` cover them (far cheaper than
    DuckDB's count(DISTINCT)), else count(DISTINCT) over them all."""
    windows: list[tuple[int, int]] = []
    for step in steps.tolist():
        if windows and step - windows[-1][0] < STEP_BITS:
            windows[-1] = (windows[-1][0], step)
        else:
            windows.append((step, step))
    if len(windows) > 4:
        return [("count(DISTINCT step)", [int(steps[0]), int(steps[-1])])]
    return [(f"bit_count(bitstring_agg(step, {lo}, {hi}))", [lo, hi]) for lo, hi in windows]


def _codes(module: pa.Array) -> np.ndarray:
    """Module ids, from an ENUM's codes or from ids, as int64."""
    if pa.types.is_dictionary(module.type):
        module = module.indices
    return module.to_numpy().astype(np.int64)


def _add(sums: np.ndarray, counts: np.ndarray, at: np.ndarray, values: np.ndarray) -> None:
    """Add ``values`` to ``sums`` at ``at`` (places may repeat), and count them in
    ``counts``: by a histogram of the places where they lie close together, as a few steps'
    records do in a grid of steps (far faster than ``np.add.at``); added one by one, in
    order, either way."""
    if not len(at):
        return
    low, high = int(at.min()), int(at.max())
    if high - low > 4 * len(at) + (1 << 16):
        np.add.at(sums, at, values)
        np.add.at(counts, at, 1)
        return
    where = at - low
    sums[low : high + 1] += np.bincount(where, weights=values, minlength=high - low + 1)
    counts[low : high + 1] += np.bincount(where, minlength=high - low + 1).astype(counts.dtype)


def _places(steps: np.ndarray) -> Any:
    """A function from step numbers to their places in ``steps`` (distinct, in order): a
    table where they span few more numbers than they hold, else a binary search."""
    first = int(steps[0])
    if int(steps[-1]) - first >= 4 * len(steps) + 1024:
        return lambda found: np.searchsorted(steps, found)
    table = np.zeros(int(steps[-1]) - first + 1, dtype=np.int64)
    table[steps - first] = np.arange(len(steps))
    return lambda found: table[found - first]


_NO_SEQ = np.iinfo(np.int64).max

DENSE_BYTES = 320 << 20
"""The largest grid of norms (12 bytes a value: a sum and a count) that series are summed
into; for a larger one DuckDB groups and sorts them, spilling to disk past its memory limit."""


class _Series(NamedTuple):
    """The queries of a series: its norms (:data:`_NORMS`), the exact ones they leave NULL
    (:data:`_EXACT`), and the squares they are sums of (rank, module id, step, square, and
    seq where the series is ordered by execution); whether a norm is the root of their mean
    (else of their sum); the first seq of each module (:data:`_FIRST_SEQ`), for a series
    ordered by execution (the gradient checks do not look at it)."""

    norms: str
    exact: str
    squares: str
    mean: bool
    first_seq: str | None = None


class _Incomplete(Exception):
    """A norm left NULL: its group holds more than two records."""


class _Queried:
    """Series as queries over the rank_records view, read back a few modules at a time as
    :meth:`SeriesStore.tables` does: nothing is held between the scan and the series checks.
    Where the ``grid`` of ranks and steps read fits :data:`DENSE_BYTES`, the norms are summed
    into it (:meth:`_dense`); else DuckDB groups and sorts them, and where a norm is NULL (a
    group of more than two records), the exact ones are made once, and the modules not given
    yet are read again with them."""

    def __init__(
        self,
        con: Any,
        queries: dict[str, _Series],
        parameters: list[Any],
        prefix: str,
        grid: tuple[np.ndarray, np.ndarray] | None,
    ) -> None:
        self._con = con
        self._queries = queries
        self._parameters = parameters
        self._prefix = prefix
        self._made: list[str] = []
        self._open: pa.RecordBatchReader | None = None
        self.grid = grid  # the ranks and the steps read (None: none)

    def tables(
        self, series: str, names: list[str], *, rows: int | None = None
    ) -> Iterator[pd.DataFrame]:
        if series not in self._queries:
            return
        rows = series_store.BATCH_ROWS if rows is None else rows
        if self.grid is not None:
            ranks, steps = self.grid
            if len(ranks) * len(names) * len(steps) * 12 <= DENSE_BYTES:
                yield from self._dense(series, names, ranks, steps, rows)
                return
        norms, exact, _, _, first_seq = self._queries[series]
        firsts = (
            None
            if first_seq is None
            else _first_seqs(self._con.execute(first_seq, self._parameters).fetchnumpy())
        )
        after: list[int] = []  # the last (rank, module) given
        complete = False
        while True:
            query = norms
            if complete:
                query = (
                    f"SELECT g.rank, g.module, g.step, coalesce(g.value, k.value) AS value "
                    f"FROM ({norms}) g LEFT JOIN {self._made[-1]} k USING (rank, module, step)"
                )
            where = "WHERE rank > ? OR (rank = ? AND module > ?)" if after else ""
            # no seq: sorted, it cost as much again as the rest (at 100M, with the spilling)
            ordered = self._con.sql(
                f"SELECT rank, module, step, value FROM ({query}) {where} "
                "ORDER BY rank, module, step",
                params=[*self._parameters, *after[:1], *after],
            ).to_arrow_reader(max(1, rows))
            self._open = ordered
            try:
                for table in series_store.whole_modules(_checked(ordered, complete), names):
                    yield _with_first_seq(table, firsts)
                    after = [int(table["rank"].iloc[-1]), int(table["module"].cat.codes.iloc[-1])]
                return
            except _Incomplete:
                pass
            finally:
                ordered.close()  # DuckDB runs one query at a time on a connection
            self._made.append(f"{self._prefix}_{series}_exact")
            self._con.execute(
                f"CREATE OR REPLACE TEMP TABLE {self._made[-1]} AS {exact}", self._parameters
            )
            complete = True

    def _dense(
        self, series: str, names: list[str], ranks: np.ndarray, steps: np.ndarray, rows: int
    ) -> Iterator[pd.DataFrame]:
        """:meth:`tables` without grouping or sorting in DuckDB: the squares of the series'
        norms, as the records give them, are summed into a grid of step by (rank, module)
        (step first: the records come a step at a time), read back by (rank, module). A sum
        of one or two squares is the same whatever the order, and DuckDB's; the groups of
        more than two take :data:`_EXACT`'s values. A series ordered by execution takes each
        module's first seq from the same records (``np.minimum.at``: 0.07 s for 25M)."""
        _, exact, squares, mean, first_seq = self._queries[series]
        width, span = len(names), len(steps)
        sums = np.zeros((span, len(ranks) * width))
        counts = np.zeros(sums.shape, dtype=np.int32)
        flat_sums, flat_counts = sums.reshape(-1), counts.reshape(-1)
        earliest = None if first_seq is None else np.full(sums.shape[1], _NO_SEQ, np.int64)
        place = _places(steps)

        def column_of(batch: pa.RecordBatch) -> np.ndarray:
            """Each record's (rank, module) column of the grid."""
            at = _codes(batch.column("module"))
            if len(ranks) > 1:
                at += np.searchsorted(ranks, batch.column("rank").to_numpy()) * width
            return at

        def cell_of(batch: pa.RecordBatch, column: np.ndarray) -> np.ndarray:
            """Each record's place in the flat grid, from its column and its step."""
            return column + place(batch.column("step").to_numpy()) * len(ranks) * width

        found = self._con.sql(squares, params=self._parameters).to_arrow_reader(1 << 17)
        self._open = found
        try:
            for batch in _from_duckdb(found):
                column = column_of(batch)
                if earliest is not None:
                    np.minimum.at(earliest, column, batch.column("seq").to_numpy())
                at = cell_of(batch, column)
                _add(flat_sums, flat_counts, at, batch.column("square").to_numpy(False))
        finally:
            found.close()
        firsts = None
        if earliest is not None:
            earliest[earliest == _NO_SEQ] = -1
            firsts = {int(r): earliest[i * width : (i + 1) * width] for i, r in enumerate(ranks)}
        present = counts > 0
        values = sums  # in place: the norms
        if mean:
            np.divide(sums, counts, out=values, where=present)
        np.sqrt(values, out=values)
        if (counts > 2).any():  # a batch at a time: with micro-steps, that is every cell
            found = self._con.sql(exact, params=self._parameters).to_arrow_reader(1 << 17)
            self._open = found
            try:
                for batch in _from_duckdb(found):
                    at = cell_of(batch, column_of(batch))
                    values.reshape(-1)[at] = batch.column("value").to_numpy(False)
            finally:
                found.close()
        del sums, counts
        held = np.flatnonzero(present.any(axis=0))
        block = np.cumsum(present[:, held].sum(axis=0)) // max(1, rows)
        cuts = [0, *(np.flatnonzero(np.diff(block)) + 1).tolist(), len(held)]
        categories = pd.Index(names)
        for first, stop in itertools.pairwise(cuts):
            mine = held[first:stop]
            taken = present[:, mine].T
            if taken.all():  # every step of each: no index to make
                row, column = np.repeat(mine, span), np.tile(np.arange(span), len(mine))
                value = values[:, mine].T.reshape(-1)
            else:
                row, column = np.nonzero(taken)
                row, value = mine[row], values[:, mine].T[taken]
            table = pd.DataFrame(
                {
                    "rank": ranks[row // width],
                    "module": pd.Categorical.from_codes(row % width, categories=categories),
                    "step": steps[column],
                    "value": value,
                }
            )
            yield _with_first_seq(table, firsts)

    def close(self) -> None:
        if self._open is not None:
            self._open.close()
        for table in self._made:
            self._con.execute(f"DROP TABLE IF EXISTS {table}")


def _first_seqs(found: dict[str, np.ndarray]) -> dict[int, np.ndarray]:
    """Per rank, the first seq of each module (by id; -1 where it has none) of ``found``
    (rank, module, seq)."""
    firsts: dict[int, np.ndarray] = {}
    if not len(found["rank"]):
        return firsts
    size = int(found["module"].max()) + 1
    for rank in np.unique(found["rank"]).tolist():
        mine = found["rank"] == rank
        firsts[rank] = np.full(size, -1, dtype=np.int64)
        firsts[rank][found["module"][mine]] = found["seq"][mine]
    return firsts


def _with_first_seq(table: pd.DataFrame, firsts: dict[int, np.ndarray] | None) -> pd.DataFrame:
    """``table`` (rank, module, step, value) with the seq of each module's first record, where
    ``firsts`` has them, as a store's tables give it."""
    if firsts is None:
        return table
    rank, module = table["rank"].to_numpy(), table["module"].cat.codes.to_numpy()
    if len(firsts) == 1:  # one rank: no rank to pick
        return table.assign(seq=next(iter(firsts.values()))[module])
    seq = np.zeros(len(table), dtype=np.int64)
    for one in np.unique(rank).tolist():
        mine = rank == one
        seq[mine] = firsts[one][module[mine]]
    return table.assign(seq=seq)


def _from_duckdb(found: pa.RecordBatchReader) -> Iterator[pa.RecordBatch]:
    """The batches of a DuckDB query's reader. What DuckDB fails on as it makes them (a part
    it cannot decode) comes through Arrow as an Arrow error: it is raised as DuckDB's own
    again, which the scan answers by reading through hooktrace's reader instead."""
    import duckdb

    try:
        yield from found
    except (OSError, pa.ArrowException) as exc:
        raise duckdb.IOException(str(exc)) from exc


def _checked(ordered: pa.RecordBatchReader, complete: bool) -> Iterator[pa.RecordBatch]:
    for batch in _from_duckdb(ordered):
        if not complete and batch.column("value").null_count:
            raise _Incomplete
        yield batch


def _where(steps: tuple[int, int] | list[int] | None) -> tuple[str, list[Any]]:
    """The SQL condition of a step selection, and its parameters."""
    if steps is None:
        return "true", []
    if isinstance(steps, tuple):
        return "step BETWEEN ? AND ?", [steps[0], steps[1]]
    return "list_contains(?, step)", [sorted(set(steps))]
