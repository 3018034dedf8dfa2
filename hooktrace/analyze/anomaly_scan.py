"""The one pass over the records that :func:`hooktrace.anomalies` needs, as DuckDB queries.
Never imports torch.

Each reduction is one SQL query over a relation of records: the trace's ``records`` view
(DuckDB reads only the columns it needs, on every core, spilling past its memory limit), or,
where DuckDB cannot decode a part (it does not check page checksums but fails on what it
cannot decode), each chunk of whole steps that hooktrace's reader gives, which leaves the
damaged parts out with a warning. Either way the same queries answer: the norms go straight
into a :class:`~hooktrace.analyze.series_store.SeriesStore` table, and only the small tallies,
the tanh/sigmoid outputs and the steps that hold a NaN or an Inf come back to Python.

Sums are those of :mod:`hooktrace.analyze.grouped` to the bit: Kahan's, in seq order. A group
of one or two values sums alike in any order (DuckDB's plain sum); a larger one is summed again
in seq order (``_KAHAN``), only where there is one.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import modules_of_type, step_chunks
from hooktrace.analyze.nonfinite import NonFinite
from hooktrace.analyze.series_store import SeriesStore
from hooktrace.trace.reader import Trace

TANH_RANGE = ("Tanh", "Hardtanh", "Softsign")
SIGMOID_RANGE = ("Sigmoid", "Hardsigmoid")
COLUMNS = ["rank", "step", "micro_step", "phase", "seq", "module", "kind", "slot", "dtype",
           "numel", "mean", "std", "norm", "nan_count", "inf_count"]  # fmt: skip
"""What the non-finite search reads of a step; the queries read fewer."""

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
# NaN if any norm is; NULL where the group holds more than two (see _KAHAN)
_NORMS = """
    SELECT g.rank, i.id AS module, g.step, g.value, g.seq FROM (
        SELECT rank, module, step, min(seq) AS seq,
               CASE WHEN bool_or(isnan(square)) THEN 'NaN'::DOUBLE
                    WHEN count(*) <= 2 THEN sqrt(sum(square){per}) END AS value
        FROM {squares} GROUP BY ALL
    ) g JOIN {ids} i USING (module)"""

# the norms that _NORMS left NULL, their squares summed one after the other in seq order
_KAHAN = """
    UPDATE {table} AS s SET value = k.value FROM (
        SELECT g.rank, i.id AS module, g.step, g.value FROM (
            SELECT rank, module, step, sqrt({kahan}{per}) AS value
            FROM {squares} GROUP BY ALL HAVING count(*) > 2
        ) g JOIN {ids} i USING (module)
    ) k WHERE s.value IS NULL AND s.rank = k.rank AND s.module = k.module AND s.step = k.step"""

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
        self.steps = 0
        self._con = trace._duckdb()  # the records view, and where the norms stay
        self._relations = f"hooktrace_{id(self):x}"  # ids, and a chunk of records
        self.norms = SeriesStore(self._con)  # grads, outputs: rank, module, step, value, seq
        self.per_slot: list[pd.DataFrame] = []  # rank, module, slot: steps, none, first, last
        self.zero: list[pd.DataFrame] = []  # rank, module: steps, first, last, slots
        self.saturated: list[pd.DataFrame] = []  # rank, module: steps, hit, first, last, value

    def read(self, steps: tuple[int, int] | list[int] | None, chunk_rows: int) -> None:
        """Every record of ``steps``, through the records view: the steps that hold a NaN or
        an Inf are then read in full by hooktrace's reader, ``chunk_rows`` at a time."""
        where, parameters = _where(steps)
        found = self._reduce("records", where, parameters)
        if found:
            for chunk in step_chunks(self.trace, found, chunk_rows):
                self.nonfinite.search(self.trace.query(columns=COLUMNS, steps=chunk))

    def read_chunks(self, steps: tuple[int, int] | list[int] | None, chunk_rows: int) -> None:
        """Every record of ``steps``, through hooktrace's reader, ``chunk_rows`` at a time."""
        rare = {"micro_step"} | (set() if self.ranges else {"numel", "mean", "std"})
        columns = [c for c in COLUMNS if c not in rare]
        for chunk in step_chunks(self.trace, steps, chunk_rows):
            frame = self.trace.query(columns=columns, steps=chunk)
            if frame.empty:
                continue
            chunk_name = f"{self._relations}_records"
            self._con.register(chunk_name, frame)
            try:
                found = self._reduce(chunk_name, "true", [])
            finally:
                self._con.unregister(chunk_name)
            if found:  # the origins need every column: the same rows, in order
                more = self.trace.query(columns=["rank", "step", "seq", *rare], steps=chunk)
                self.nonfinite.search(frame.assign(**{c: more[c].to_numpy() for c in rare}))

    def close(self) -> None:
        self.norms.close()
        with contextlib.suppress(Exception):  # never registered: no records read
            self._con.unregister(f"{self._relations}_ids")

    def _reduce(self, records: str, where: str, parameters: list[Any]) -> list[int]:
        """Add what the records of the relation ``records`` (of whole steps, ``where``)
        hold; the steps with a NaN or an Inf, in order."""

        def run(query: str, *, extra: list[Any] | None = None) -> Any:
            return self._con.execute(query, [*parameters, *(extra or [])])

        recorded = run(
            f"SELECT DISTINCT rank, step FROM {records} WHERE {where} ORDER BY rank, step"
        ).fetchnumpy()
        if not len(recorded["step"]):
            return []
        self.steps += len(recorded["step"])
        self.nonfinite.add_steps(recorded["rank"].astype(np.int64), recorded["step"])
        first = run(
            f"SELECT module::VARCHAR AS module FROM {records} WHERE {where} GROUP BY 1 "
            "ORDER BY min({'s': step, 'r': rank, 'q': seq})"
        ).fetchnumpy()["module"]
        for name in first.tolist():
            self._id(str(name))
        ids = f"{self._relations}_ids"
        self._con.register(
            ids, pd.DataFrame({"module": self.names, "id": np.arange(len(self.names))})
        )
        more = "norm, nan_count, inf_count" + (", numel, mean, std" if self.ranges else "")
        rows = _ROWS.format(records=records, where=where, more=more)
        for series, which, per in (("grads", _GRADS, ""), ("outputs", _OUTPUTS, " / count(*)")):
            squares = _SQUARES.format(rows=rows, which=which)
            self.norms.insert(series, _NORMS.format(squares=squares, per=per, ids=ids), parameters)
            table = self.norms.table(series)
            if self._con.execute(f"SELECT count(*) FROM {table} WHERE value IS NULL").fetchone()[0]:
                run(_KAHAN.format(table=table, kahan=_KAHAN_SUM, squares=squares, per=per, ids=ids))
        self._tally_params(run, rows, ids)
        if self.ranges:
            self._tally_saturation(
                run(
                    f"SELECT r.rank, i.id AS module, r.step, r.mean, r.std, r.numel "
                    f"FROM ({rows}) r JOIN {ids} i USING (module) "
                    f"WHERE {_OUTPUTS} AND list_contains(?, r.module) ORDER BY r.rank, r.step, r.seq",
                    extra=[list(self.ranges)],
                ).df()
            )
        bad = run(
            f"SELECT DISTINCT step FROM {records} WHERE {where} "
            "AND (nan_count > 0 OR inf_count > 0) ORDER BY step"
        ).fetchnumpy()["step"]
        return [int(s) for s in bad.tolist()]

    def _id(self, name: str) -> int:
        if name not in self._ids:
            self._ids[name] = len(self.names)
            self.names.append(name)
        return self._ids[name]

    def _tally_params(self, run: Any, rows: str, ids: str) -> None:
        """Per (rank, module, slot) of the grad_param records: steps, steps with .grad None,
        first and last step; and per (rank, module), the steps whose gradient was exactly
        zero."""
        per_slot = run(
            f"SELECT rank, i.id AS module, slot, count(DISTINCT step) AS steps, "
            "count(*) FILTER (WHERE dtype = 'None') AS none, min(step) AS first, "
            f"max(step) AS last FROM ({rows}) JOIN {ids} i USING (module) "
            "WHERE kind = 'grad_param' GROUP BY ALL"
        ).df()
        if per_slot.empty:
            return
        self.per_slot.append(per_slot.set_index(["rank", "module", "slot"]))
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


def _where(steps: tuple[int, int] | list[int] | None) -> tuple[str, list[Any]]:
    """The SQL condition of a step selection, and its parameters."""
    if steps is None:
        return "true", []
    if isinstance(steps, tuple):
        return "step BETWEEN ? AND ?", [steps[0], steps[1]]
    return "list_contains(?, step)", [sorted(set(steps))]
