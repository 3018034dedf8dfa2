"""What a trace holds, at a glance: :func:`summary`. Never imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from hooktrace.errors import TraceError
from hooktrace.trace import schema
from hooktrace.trace.counts import records_per_step
from hooktrace.trace.reader import Trace, load
from hooktrace.trace.schema import NOTE_SKIPPED


@dataclass
class Summary:
    path: Path
    status: str
    format_version: str
    versions: dict[str, str]
    command: list[str]
    duration_s: float | None
    ranks: list[int]
    data_parallel: int | None
    """The data-parallel degree where the recording told each rank's place (DDP, FSDP2)."""
    logical_records: int | None
    """In a run of several ranks, its records merged into logical tensors
    (:mod:`hooktrace.trace.logical`): what ``diff`` compares; None in a run of one rank."""
    steps: int
    """Steps that trained (a backward pass ran); every step, in a run that never trained."""
    first_step: int | None
    last_step: int | None
    evaluation_only: list[int]
    """Steps recorded that never trained in a run that did: an evaluation after the last
    optimizer step, or before the first."""
    ended_in_training: int | None
    """The run's last step, where its training forward ran and the run ended (an exception,
    a signal) before its backward: neither trained nor an evaluation."""
    micro_steps: int
    written_steps: int  # steps the steps table holds, readable records or not
    skipped_steps: int
    modules: int
    roots: list[str]
    evaluated_roots: list[str]  # roots that only ran evaluation passes, where others trained
    records: int
    kinds: dict[str, int]
    phases: dict[str, int]
    full_tensors: int
    histograms: int
    """Histogram rows: one per histogrammed record."""
    histogram_kinds: list[str] | None
    """The kinds recorded with histograms (None: written before format 1.3)."""
    histogram_every: int
    bytes_on_disk: dict[str, int]
    error: str | None
    notes: dict[int, list[str]]
    """What each rank's recording could not record and why (its status's ``notes``), by rank:
    graphs it could not look into, outputs it left out."""
    largest: pd.DataFrame = field(repr=False)
    """The modules with the most records, for a first look."""
    not_summarised: pd.DataFrame = field(repr=False, default_factory=pd.DataFrame)
    """Records of tensors hooktrace could not summarise: module, kind, reason, records."""
    damaged_parts: int = 0
    """Parts of the trace the reader left out (each named in a warning)."""
    config: dict[str, Any] = field(default_factory=dict)
    """The recording's options, as its manifest holds them."""

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("largest", "not_summarised")}
        out["path"] = str(self.path)
        out["not_summarised"] = self.not_summarised.to_dict(orient="records")
        return out


def summary(run: str | os.PathLike[str] | Trace) -> Summary:
    """Summarise a run: steps, modules, kinds, sizes and status.

    One DuckDB query counts the records by module, and by kind and phase (reading three
    dictionary columns, and the notes and tensor keys, which are nearly all empty); the steps,
    modules and statuses come from their own small tables. Memory stays bounded whatever the
    trace's size.
    """
    trace = run if isinstance(run, Trace) else load(run)
    counts, groups, recorded, skipped, trained = _counted(trace)
    steps_table = trace.steps
    manifest = trace.manifest
    start, end = manifest.get("start_time"), manifest.get("end_time")
    errors = [s.get("error") for s in manifest["ranks"].values() if s.get("error")]
    counted, evaluation_only = steps_that_trained(steps_table, recorded)
    unfinished = ended_in_training(trace, evaluation_only, trace.status)
    if unfinished is not None:
        evaluation_only = evaluation_only[:-1]
    # most records first, ties by name: the same order on every machine and pandas version
    counts = counts.sort_values(["records", "module"], ascending=[False, True], kind="stable")
    return Summary(
        path=trace.path,
        status=trace.status,
        format_version=trace.format_version,
        versions={
            key.removesuffix("_version"): str(manifest.get(key, "?"))
            for key in ("hooktrace_version", "torch_version", "python_version")
        },
        command=list(manifest.get("command") or []),
        duration_s=(end - start) if start and end else None,
        ranks=trace.ranks,
        data_parallel=None if trace.layout is None else max(trace.layout.values()) + 1,
        logical_records=_logical_count(trace),
        steps=len(counted),
        first_step=min(counted) if counted else None,
        last_step=max(counted) if counted else None,
        evaluation_only=evaluation_only,
        ended_in_training=unfinished,
        # each rank writes its own row for a step: a step counts once, whatever the ranks
        micro_steps=int(steps_table.groupby("step")["micro_steps"].max().sum()),
        written_steps=int(steps_table["step"].nunique()) if not steps_table.empty else 0,
        skipped_steps=int(steps_table.groupby("step")["skipped"].any().sum()),
        modules=int(trace.modules["module"].nunique()) if not trace.modules.empty else len(counts),
        roots=_roots(trace),
        evaluated_roots=_evaluated_roots(trace, trained),
        records=int(groups["records"].sum()),
        kinds=_counts(groups, "kind", schema.KINDS),
        phases=_counts(groups, "phase", schema.PHASES),
        full_tensors=int(groups["full_tensors"].sum()),
        histograms=trace.histogram_count,
        histogram_kinds=manifest.get("config", {}).get("histograms"),
        histogram_every=int(manifest.get("config", {}).get("histogram_every") or 1),
        bytes_on_disk={
            name: _size(trace.path / name)
            for name in ("records", "steps", "modules", "tensors", "histograms")
            if name != "histograms" or (trace.path / name).exists()
        },
        error=errors[0] if errors else None,
        notes={
            int(rank): list(status["notes"])
            for rank, status in sorted(manifest["ranks"].items(), key=lambda kv: int(kv[0]))
            if status.get("notes")
        },
        largest=counts.head(10).reset_index(drop=True),
        not_summarised=skipped,
        damaged_parts=len(trace.skipped),
        config=dict(manifest.get("config") or {}),
    )


_RECORDED_STEPS = "SELECT DISTINCT step FROM rank_records"
_LOGICAL = """
    SELECT count(*) AS n FROM (
        SELECT DISTINCT step, micro_step, phase, module, call, kind, slot,
            CASE WHEN contains(placements, 'P(') THEN rank END
        FROM rank_records)
"""  # a logical tensor per tensor of a step, but partial sums: one per rank


def _logical_count(trace: Trace) -> int | None:
    """How many logical records the ranks' records make (None for one rank, or where DuckDB
    cannot read a part: the count is left out, not guessed)."""
    if len(trace.ranks) < 2:
        return None
    try:
        return int(trace.sql(_LOGICAL)["n"].iloc[0])
    except TraceError:
        return None


_NOT_SUMMARISED = f"""
    SELECT module, kind, substr(note, {len(NOTE_SKIPPED) + 1}) AS reason, count(*) AS records
    FROM rank_records WHERE starts_with(note, '{NOTE_SKIPPED}')
    GROUP BY ALL ORDER BY module, kind, reason
"""


def _counted(
    trace: Trace,
) -> tuple[pd.DataFrame, pd.DataFrame, pd.Series, pd.DataFrame, set[str]]:
    """Records per module (``module``, ``records``); per (kind, phase), with their full
    tensors and those not summarised; the steps recorded, the records not summarised, and
    the modules with records in the train phase.
    Where DuckDB cannot read a part (damaged inside: DuckDB does not check page checksums
    but fails on what it cannot decode), hooktrace's own reader counts instead, and leaves
    the damaged parts out with a warning."""
    import duckdb

    try:
        found = trace.sql(_groups_query(trace))
        per_module = found.pop("by_kind").to_numpy() == 0
        counts = found.loc[per_module, ["module", "records"]]
        trained = set(found.loc[per_module & (found["trained"] > 0).to_numpy(), "module"])
        groups = found.loc[~per_module].drop(columns=["module", "trained"])
        counted = records_per_step(trace)
        recorded = trace.sql(_RECORDED_STEPS)["step"] if counted is None else counted["step"]
        skipped = (
            trace.sql(_NOT_SUMMARISED)
            if groups["not_summarised"].any()
            else pd.DataFrame(columns=["module", "kind", "reason", "records"])
        )
        groups = groups.drop(columns="not_summarised")
    except TraceError as exc:
        if not isinstance(exc.__cause__, duckdb.Error):
            raise
        rows = trace.query(
            columns=["step", "module", "kind", "phase", "tensor_key", "note"], logical=False
        )
        per_name = rows["module"].astype(str).value_counts(sort=False)
        counts = per_name.rename_axis("module").rename("records").reset_index()
        ran = (rows["phase"].astype(str) == "train") & rows["kind"].astype(str).isin(_CALLS)
        trained = set(rows.loc[ran, "module"].astype(str))
        keys = [rows[c].astype(str) for c in ("kind", "phase")]
        full = (rows["tensor_key"] != "").rename("full_tensors")
        groups = full.groupby(keys).agg(["size", "sum"])
        groups = groups.set_axis(["records", "full_tensors"], axis=1).reset_index()
        recorded, skipped = rows["step"], not_summarised(rows)
    counts = counts.astype({"module": str, "records": "int64"})
    groups = groups.astype({"kind": str, "phase": str})
    skipped = skipped.astype({"module": str, "kind": str, "reason": str, "records": "int64"})
    return counts, groups, recorded, skipped.reset_index(drop=True), trained


def _groups_query(trace: Trace) -> str:
    """Records by module (``by_kind`` 0), and by kind and phase (``by_kind`` 1) with their
    full tensors and those not summarised: two groupings of one scan,
    where grouping by (module, kind) took 0.99 s at 100M records against 0.64 s. What the
    row groups' statistics already answer is not computed: a run of one phase is not grouped
    by phase, and a run without full tensors (or notes) does not test their column, so
    DuckDB reads only the columns it must."""
    phase = trace.value_span("phase")
    keys = "module, kind, phase"
    sets = "(module), (kind, phase)"
    if phase is not None and phase[0] == phase[1] and _plain(phase[0]):
        keys, sets = f"module, kind, '{phase[0]}' AS phase", "(module), (kind)"
    tensor_key = trace.value_span("tensor_key")
    full = (
        "count(*) FILTER (WHERE tensor_key <> '')"
        if tensor_key is None or tensor_key[1] != ""
        else "0"
    )
    note = trace.value_span("note")
    skipped = (
        f"count(*) FILTER (WHERE starts_with(note, '{NOTE_SKIPPED}'))"
        if note is None or (note[0] < NOTE_SKIPPED + "\U0010ffff" and note[1] >= NOTE_SKIPPED)
        else "0"
    )
    calls = ", ".join(f"'{kind}'" for kind in _CALLS)
    trained = f"count(*) FILTER (WHERE phase = 'train' AND kind IN ({calls}))"
    return (
        f"SELECT {keys}, grouping(module) AS by_kind, count(*) AS records, "
        f"{full} AS full_tensors, {skipped} AS not_summarised, {trained} AS trained "
        f"FROM rank_records GROUP BY GROUPING SETS ({sets})"
    )


_CALLS = ("input", "output", "grad_output")
"""The kinds a module's own call records: a training pass of the module, where their phase is
train (parameters are recorded with the phase of the step's first training forward, whichever
root it ran)."""


def _plain(text: object) -> bool:
    return isinstance(text, str) and text.replace("_", "").isalnum()


def steps_that_trained(steps_table: pd.DataFrame, steps: pd.Series) -> tuple[list[int], list[int]]:
    """The steps that trained (a backward pass ran in them, on any rank), and the others:
    what a script's own log counts as steps, and the evaluations outside them. A run that
    never trained (inference) counts every step."""
    recorded = sorted(int(s) for s in steps.unique())
    if steps_table.empty:
        return recorded, []
    micro = steps_table.groupby("step")["micro_steps"].max()
    recorded_set = set(recorded)
    trained = sorted(int(s) for s in micro.index[micro > 0] if s in recorded_set)
    if not trained:
        return recorded, []
    trained_set = set(trained)
    return trained, [s for s in recorded if s not in trained_set]


def ended_in_training(trace: Trace, untrained: list[int], status: str) -> int | None:
    """The last of the ``untrained`` steps (no backward pass ran in them), where it is the
    run's last step, the run did not complete, and its forward ran in training: the step an
    exception or a signal ended before its backward, not an evaluation. Reads that step's
    records' phases alone."""
    if not untrained or status == schema.STATUS_COMPLETE or trace.steps.empty:
        return None
    last = untrained[-1]
    if last != int(trace.steps["step"].max()):
        return None
    phases = trace.query(steps=[last], columns=["phase"], logical=False)["phase"]
    return last if (phases.astype(str) == "train").any() else None


def not_summarised(rows: pd.DataFrame) -> pd.DataFrame:
    """Records whose tensor was not summarised, counted by module, kind and reason."""
    notes = rows["note"].astype(str)
    skipped = rows.loc[notes.str.startswith(NOTE_SKIPPED), ["module", "kind"]].astype(str)
    skipped["reason"] = notes[skipped.index].str.removeprefix(NOTE_SKIPPED)
    counts = skipped.groupby(["module", "kind", "reason"], sort=True).size()
    return counts.rename("records").reset_index()


def _roots(trace: Trace) -> list[str]:
    modules = trace.modules
    if modules.empty:
        return list(trace.manifest.get("roots") or [])
    return list(dict.fromkeys(modules.loc[modules["depth"] == 0, "module"]))


def _evaluated_roots(trace: Trace, trained: set[str]) -> list[str]:
    """The roots none of whose modules ran a training pass (an EMA copy, a frozen teacher, a
    model loaded for evaluation), where another root did; none in a run that never trained
    (an inference run: every root is evaluated, and saying so says nothing)."""
    modules = trace.modules
    if not trained or modules.empty or "root" not in modules:
        return []
    roots = modules.groupby("root", sort=False)["module"].agg(
        lambda names: trained.isdisjoint(names)
    )
    return [str(root) for root, evaluated in roots.items() if evaluated]


def _counts(groups: pd.DataFrame, column: str, order: tuple[str, ...]) -> dict[str, int]:
    """Records per value of ``column``, most first; ties in the format's order (KINDS, PHASES)."""
    counts = groups.groupby(column)["records"].sum()
    rank = {name: i for i, name in enumerate(order)}
    ordered = sorted(
        ((str(k), int(v)) for k, v in counts.items()),
        key=lambda item: (-item[1], rank.get(item[0], len(rank)), item[0]),
    )
    return dict(ordered)


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
