"""What a trace holds, at a glance: :func:`summary`. Never imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

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
    steps: int
    """Steps that trained (a backward pass ran); every step, in a run that never trained."""
    first_step: int | None
    last_step: int | None
    evaluation_only: list[int]
    """Steps recorded that never trained in a run that did: an evaluation after the last
    optimizer step, or before the first."""
    micro_steps: int
    skipped_steps: int
    modules: int
    roots: list[str]
    records: int
    kinds: dict[str, int]
    phases: dict[str, int]
    full_tensors: int
    bytes_on_disk: dict[str, int]
    error: str | None
    largest: pd.DataFrame = field(repr=False)
    """The modules with the most records, for a first look."""
    not_summarised: pd.DataFrame = field(repr=False, default_factory=pd.DataFrame)
    """Records of tensors hooktrace could not summarise: module, kind, reason, records."""

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("largest", "not_summarised")}
        out["path"] = str(self.path)
        out["not_summarised"] = self.not_summarised.to_dict(orient="records")
        return out


def summary(run: str | os.PathLike[str] | Trace) -> Summary:
    """Summarise a run: steps, modules, kinds, sizes and status. Reads only six columns."""
    trace = run if isinstance(run, Trace) else load(run)
    rows = trace.query(columns=["step", "module", "kind", "phase", "tensor_key", "note"])
    steps_table = trace.steps
    manifest = trace.manifest
    start, end = manifest.get("start_time"), manifest.get("end_time")
    errors = [s.get("error") for s in manifest["ranks"].values() if s.get("error")]
    counts = rows.groupby(rows["module"].astype(str)).size().rename("records").reset_index()
    counted, evaluation_only = steps_that_trained(steps_table, rows["step"])
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
        steps=len(counted),
        first_step=min(counted) if counted else None,
        last_step=max(counted) if counted else None,
        evaluation_only=evaluation_only,
        # each rank writes its own row for a step: a step counts once, whatever the ranks
        micro_steps=int(steps_table.groupby("step")["micro_steps"].max().sum()),
        skipped_steps=int(steps_table.groupby("step")["skipped"].any().sum()),
        modules=int(trace.modules["module"].nunique())
        if not trace.modules.empty
        else rows["module"].nunique(),
        roots=_roots(trace),
        records=len(rows),
        kinds=_counts(rows["kind"]),
        phases=_counts(rows["phase"]),
        full_tensors=int((rows["tensor_key"] != "").sum()),
        bytes_on_disk={
            name: _size(trace.path / name) for name in ("records", "steps", "modules", "tensors")
        },
        error=errors[0] if errors else None,
        largest=counts.head(10).reset_index(drop=True),
        not_summarised=not_summarised(rows),
    )


def steps_that_trained(steps_table: pd.DataFrame, steps: pd.Series) -> tuple[list[int], list[int]]:
    """The steps that trained (a backward pass ran in them, on any rank), and the others:
    what a script's own log counts as steps, and the evaluations outside them. A run that
    never trained (inference) counts every step."""
    recorded = sorted(int(s) for s in steps.unique())
    if steps_table.empty:
        return recorded, []
    micro = steps_table.groupby("step")["micro_steps"].max()
    with_records = set(recorded)
    trained = sorted(int(s) for s in micro.index[micro > 0] if s in with_records)
    if not trained:
        return recorded, []
    done = set(trained)
    return trained, [s for s in recorded if s not in done]


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


def _counts(column: pd.Series) -> dict[str, int]:
    counts = column.astype(str).value_counts()
    return {str(k): int(v) for k, v in counts.items()}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0
