"""What :func:`hooktrace.diff` answers, and how the answer is gathered chunk by chunk.

:class:`DiffResult` holds the verdict, the first :class:`Divergence`, the :class:`Structure`
differences, the table of differing records and a per-module summary. :class:`Accumulator`
builds it from the chunks of aligned records that ``diff`` feeds it; what it keeps across
chunks grows with the number of modules, never with the number of steps.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from hooktrace.analyze.diff.compare import TENSOR_METRICS
from hooktrace.trace import schema


@dataclass(frozen=True)
class Divergence:
    """One record that differs: where it sits, and the values that are out of tolerance
    (``values``: name -> (run A, run B); ``errors``: full-tensor metrics, when both saved it)."""

    step: int
    micro_step: int
    seq: int
    phase: str
    module: str
    call: int
    kind: str
    slot: str
    rank: int
    status: str
    values: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    errors: dict[str, float] = field(default_factory=dict)
    pooled: bool = False
    """A logical record of a run of several ranks (``rank`` the lowest pooled into it): which
    rank's part differs is for a comparison ``per_rank`` to say, where both runs have the
    same ranks (the comparison's note says so)."""

    @property
    def pass_name(self) -> str:
        """``forward`` or ``backward`` (``param`` records are read at the step's first forward)."""
        return "backward" if self.kind in schema.GRAD_KINDS else "forward"

    def describe(self) -> str:
        what = {"only_a": " (only in run A)", "only_b": " (only in run B)"}.get(self.status, "")
        return (
            f"step {self.step}, {self.pass_name} pass: {self.kind} of {self.module!r} "
            f"(slot {self.slot}, call {self.call}, micro-step {self.micro_step}, {self.phase}, "
            f"{'the ranks pooled' if self.pooled else f'rank {self.rank}'}, seq {self.seq}){what}"
        )


@dataclass
class Structure:
    """What only one run has, and records whose shape or dtype changed (``changed``: the first
    step of each (module, kind, slot))."""

    modules_only_a: list[str] = field(default_factory=list)
    modules_only_b: list[str] = field(default_factory=list)
    kinds_only_a: list[str] = field(default_factory=list)
    kinds_only_b: list[str] = field(default_factory=list)
    slots_only_a: list[tuple[str, str, str]] = field(default_factory=list)
    slots_only_b: list[tuple[str, str, str]] = field(default_factory=list)
    steps_only_a: list[int] = field(default_factory=list)
    steps_only_b: list[int] = field(default_factory=list)
    changed: pd.DataFrame = field(default_factory=pd.DataFrame)
    records_only_a: int = 0
    records_only_b: int = 0

    @property
    def differs(self) -> bool:
        """True when the runs' records do not pair up (steps recorded by one only do not count)."""
        return bool(self.records_only_a or self.records_only_b or len(self.changed))

    def lines(self) -> list[str]:
        out = []
        for side, mods, kinds, slots, recs in (
            ("A", self.modules_only_a, self.kinds_only_a, self.slots_only_a, self.records_only_a),
            ("B", self.modules_only_b, self.kinds_only_b, self.slots_only_b, self.records_only_b),
        ):
            if mods:
                out.append(f"modules only in run {side} ({len(mods)}): {_some(mods)}")
            if kinds:
                out.append(f"kinds only in run {side}: {', '.join(kinds)}")
            if slots:
                out.append(
                    f"slots only in run {side} ({len(slots)}): {_some(['/'.join(s) for s in slots])}"
                )
            if recs:
                out.append(f"{recs:,} records only in run {side}")
        for row in self.changed.head(10).to_dict("records"):
            what = [
                f"{c} {row[c + '_a']} -> {row[c + '_b']}"
                for c in ("shape", "dtype")
                if row[c + "_a"] != row[c + "_b"]
            ]
            out.append(
                f"changed: {row['kind']} of {row['module']!r} slot {row['slot']} from step {row['step']}: {', '.join(what)}"
            )
        if len(self.changed) > 10:
            out.append(
                f"... and {len(self.changed) - 10} more changed records (see .structure.changed)"
            )
        return out


@dataclass(repr=False)
class DiffResult:
    """The answer of :func:`diff`. ``match`` is True when no aligned record differs."""

    run_a: Path
    run_b: Path
    rtol: float
    atol: float
    first: Divergence | None
    table: pd.DataFrame
    structure: Structure
    modules: pd.DataFrame
    """Per module: first divergent step, records differing, and at ``last_step`` the records
    differing and the largest ``rel_diff`` and ``max_abs_error``; those that differ most first."""
    steps_a: tuple[int, int]
    steps_b: tuple[int, int]
    steps: int
    """How many steps were compared (those both runs recorded, after the filters)."""
    first_step: int
    last_step: int
    records: int
    differing: int
    complete: bool = True
    """False when ``stop_at_first`` stopped after the first divergence."""
    ranks: tuple[int | None, int | None] = (None, None)
    notes: list[str] = field(default_factory=list)

    @property
    def match(self) -> bool:
        return self.differing == 0

    def __repr__(self) -> str:
        ranks = (
            f", rank {self.ranks[0]} vs rank {self.ranks[1]}" if self.ranks[1] is not None else ""
        )
        verdict = (
            "match" if self.match else f"differ: {self.differing:,} of {self.records:,} records"
        )
        lines = [
            f"DiffResult('{self.run_a}' vs '{self.run_b}'{ranks}, rtol={self.rtol:g}, atol={self.atol:g})",
            f"  {verdict} over steps {self.first_step}–{self.last_step} ({self.steps} steps)",
        ]
        if self.first is not None:
            lines.append(f"  first: {self.first.describe()}")
        lines += [f"  {line}" for line in self.structure.lines()[:5]]
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


class Accumulator:
    """What is kept across chunks: bounded by the number of modules, never by steps."""

    def __init__(self, *, last_step: int) -> None:
        self.last_step = last_step
        self.first: Divergence | None = None
        self.stopped_at: int | None = None
        self.records = self.differing = 0
        self.only = {"only_a": 0, "only_b": 0}
        self.seen = {"A": _Slots(), "B": _Slots()}
        self.paired = _Slots()  # what both runs hold, of chunks that pair row by row
        self.changed: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.first_step: dict[str, int] = {}
        self.count: dict[str, int] = {}
        self.last: list[pd.DataFrame] = []  # per module at last_step: the same rows, the others

    def add_same(self, table: pa.Table, same: np.ndarray) -> None:
        """A chunk whose records pair row by row (``table``: run A's), ``same`` where both
        runs hold them bit for bit: those are equal, and are counted without a comparison.
        The others go to :meth:`add`."""
        self.records += int(np.count_nonzero(same))
        self.paired.add_table(table)  # both runs hold every key of a chunk that pairs row by row
        at_last = same & (table.column("step").to_numpy() == self.last_step)
        if at_last.any():
            module = table.column("module").combine_chunks()
            at = np.unique(module.indices.to_numpy()[at_last])
            modules = module.dictionary.take(pa.array(at)).to_pylist()
            self.last.append(
                pd.DataFrame(
                    {"last_differing": 0, "last_rel_diff": 0.0, "last_max_abs_error": np.nan},
                    index=pd.Index(modules, name="module"),
                )
            )

    def add(self, part: pd.DataFrame, merged: pd.DataFrame) -> None:
        status = part["status"]
        self.records += len(part)
        different = part[status != "equal"]
        self.differing += len(different)
        for side, absent in (("A", "only_b"), ("B", "only_a")):
            self.seen[side].add_rows(part, (status != absent).to_numpy())
        for key in self.only:
            self.only[key] += int((status == key).sum())
        changed = part[status == "changed"].sort_values("step", kind="stable")
        for row in changed.drop_duplicates(["module", "kind", "slot"]).to_dict("records"):
            where = (str(row["module"]), str(row["kind"]), str(row["slot"]))
            self.changed.setdefault(where, {str(k): v for k, v in row.items()})
        if len(different):
            by_module = different.groupby("module", observed=True)["step"].agg(["min", "size"])
            modules = [str(m) for m in by_module.index]
            for module, step, size in zip(
                modules, by_module["min"].tolist(), by_module["size"].tolist(), strict=True
            ):
                self.first_step.setdefault(module, int(step))
                self.count[module] = self.count.get(module, 0) + int(size)
            if self.first is None:
                order = different.sort_values(["step", "seq", "rank"], kind="stable")
                self.first = _divergence(order.iloc[0], merged.loc[order.index[0]])
        at_last = part[part["step"] == self.last_step]
        if len(at_last):
            self.last.append(
                at_last.assign(
                    differing=at_last["status"] != "equal", module=at_last["module"].astype(str)
                )
                .groupby("module")
                .agg(
                    last_differing=("differing", "sum"),
                    last_rel_diff=("rel_diff", "max"),
                    last_max_abs_error=("max_abs_error", "max"),
                )
            )

    def module_table(self) -> pd.DataFrame:
        table = pd.DataFrame(
            {
                "first_step": pd.Series(self.first_step, dtype="int64"),
                "differing": pd.Series(self.count, dtype="int64"),
            }
        )
        if self.last:
            last = (
                pd.concat(self.last)
                .groupby(level=0)
                .agg({"last_differing": "sum", "last_rel_diff": "max", "last_max_abs_error": "max"})
            )
            table = table.join(last, how="outer")
        for col in ("last_differing", "last_rel_diff", "last_max_abs_error"):
            if col not in table.columns:
                table[col] = float("nan")
        table = table[(table["differing"].fillna(0) > 0) | (table["last_differing"].fillna(0) > 0)]
        table = table.rename_axis("module").reset_index()
        return table.sort_values(
            ["last_rel_diff", "last_max_abs_error", "first_step"],
            ascending=[False, False, True],
            na_position="last",
        ).reset_index(drop=True)

    def structure(
        self, steps_a: Iterable[int], steps_b: Iterable[int], common: list[int]
    ) -> Structure:
        paired = self.paired.found()
        a, b = self.seen["A"].found() | paired, self.seen["B"].found() | paired
        mods_a, mods_b = {m for m, _, _ in a}, {m for m, _, _ in b}
        kinds_a, kinds_b = {k for _, k, _ in a}, {k for _, k, _ in b}
        changed = pd.DataFrame(list(self.changed.values()))
        if not changed.empty:
            columns = ["module", "kind", "slot", "step", "shape_a", "shape_b", "dtype_a", "dtype_b"]
            changed = changed.sort_values(["step", "seq"], kind="stable")[columns]
        return Structure(
            modules_only_a=sorted(mods_a - mods_b), modules_only_b=sorted(mods_b - mods_a),
            kinds_only_a=sorted(kinds_a - kinds_b), kinds_only_b=sorted(kinds_b - kinds_a),
            slots_only_a=sorted(s for s in a - b if s[0] in mods_b and s[1] in kinds_b),
            slots_only_b=sorted(s for s in b - a if s[0] in mods_a and s[1] in kinds_a),
            steps_only_a=sorted(set(map(int, steps_a)) - set(common)),
            steps_only_b=sorted(set(map(int, steps_b)) - set(common)),
            changed=changed.reset_index(drop=True),
            records_only_a=self.only["only_a"], records_only_b=self.only["only_b"],
        )  # fmt: skip


class _Slots:
    """The distinct (module, kind, slot) of chunks. Marked by code into the chunk's names,
    and named only when a chunk's names differ from the last one's, or at the end: chunk
    after chunk holds the same few thousand, and naming them each time was most of a diff."""

    MAX_MARKS = 1 << 24
    """Past this many combinations of names (16 MB of marks), each chunk's are named."""

    def __init__(self) -> None:
        self.names: list[pa.Array] = []
        self.marks = np.zeros(0, dtype=bool)
        self._found: set[tuple[str, str, str]] = set()

    def add_table(self, table: pa.Table) -> None:
        """Every row of a pyarrow table (dictionary columns)."""
        columns = [table.column(c).combine_chunks() for c in ("module", "kind", "slot")]
        self.add([c.indices.to_numpy() for c in columns], [c.dictionary for c in columns])

    def add_rows(self, frame: pd.DataFrame, rows: np.ndarray) -> None:
        """The ``rows`` (a mask) of a DataFrame (categorical columns)."""
        columns = [frame[c].astype("category").cat for c in ("module", "kind", "slot")]
        names = [pa.array(c.categories.to_numpy(dtype=object), pa.string()) for c in columns]
        self.add([c.codes.to_numpy()[rows] for c in columns], names)

    def add(self, codes: list[np.ndarray], names: list[pa.Array]) -> None:
        """Rows given as codes into ``names``, one array of each per column."""
        if not len(codes[0]):
            return
        code = np.zeros(len(codes[0]), dtype=np.int64)
        for column, dictionary in zip(codes, names, strict=True):
            code = code * len(dictionary) + column
        size = int(np.prod([len(n) for n in names]))
        if size > self.MAX_MARKS:
            self._found.update(_named(np.unique(code), names))
            return
        if len(names) != len(self.names) or not all(
            new.equals(old) for new, old in zip(names, self.names, strict=True)
        ):
            self._found.update(_named(np.flatnonzero(self.marks), self.names))
            self.names = names
            self.marks = np.zeros(size, dtype=bool)
        self.marks[code] = True

    def found(self) -> set[tuple[str, str, str]]:
        self._found.update(_named(np.flatnonzero(self.marks), self.names))
        self.marks[:] = False
        return self._found


def _named(code: np.ndarray, names: list[pa.Array]) -> set[tuple[str, str, str]]:
    """(module, kind, slot) of each combined code (``module * kinds * slots + ...``)."""
    if code.size == 0:
        return set()
    parts = []
    for dictionary in reversed(names):
        code, at = np.divmod(code, len(dictionary))
        parts.append(np.asarray(dictionary.to_pylist(), dtype=object)[at].tolist())
    module, kind, slot = reversed(parts)
    return {(str(m), str(k), str(s)) for m, k, s in zip(module, kind, slot, strict=True)}


def _divergence(row: pd.Series, merged: pd.Series) -> Divergence:
    values: dict[str, tuple[Any, Any]] = {}
    for name in str(row["exceeded"]).split(","):
        if name and name != "tensor":
            values[name] = (_plain(merged.get(f"{name}_a")), _plain(merged.get(f"{name}_b")))
    errors = {m: float(row[m]) for m in TENSOR_METRICS if pd.notna(row[m])}
    return Divergence(
        step=int(row["step"]), micro_step=int(row["micro_step"]), seq=int(row["seq"]),
        phase=str(row["phase"]), module=str(row["module"]), call=int(row["call"]),
        kind=str(row["kind"]), slot=str(row["slot"]), rank=int(row["rank"]),
        status=str(row["status"]), values=values, errors=errors,
    )  # fmt: skip


def _plain(value: Any) -> Any:
    return value.item() if hasattr(value, "item") else (None if value is None else value)


def _some(names: list[str], limit: int = 8) -> str:
    return ", ".join(names[:limit]) + (
        f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    )
