"""Reading traces into pandas: :func:`load` and :class:`Trace`. Never imports torch.

Filters are pushed down to pyarrow, so a question reads only the columns and row groups it
needs. Part files that cannot be read are skipped and listed in ``Trace.skipped``; they never
make the rest of a trace unreadable.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import ml_dtypes
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from hooktrace.errors import FormatVersionError, TensorNotRecorded, TraceError, TraceNotFound
from hooktrace.trace import schema

_NUMPY_DTYPES = {"bfloat16": ml_dtypes.bfloat16}


def load(path: str | os.PathLike[str]) -> Trace:
    """Open the run directory at ``path``.

    Raises :class:`TraceNotFound` when there is no run there and :class:`TraceError` when the
    manifest cannot be read or was written by a newer format.
    """
    return Trace(path)


class Trace:
    """One recorded run (all ranks), read lazily.

    ``records``, ``steps`` and ``modules`` are DataFrames (read on first use and kept);
    :meth:`query` reads a filtered subset without loading everything; :meth:`tensor` returns a
    saved full tensor as a numpy array.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.exists():
            raise TraceNotFound(f"no run at {self.path}: give the directory a recording wrote")
        if not self.path.is_dir():
            raise TraceNotFound(f"{self.path} is a file, not a run: give the run directory")
        manifest_path = self.path / schema.MANIFEST
        self.skipped: list[str] = []
        """Files that could not be read and were left out, each with the reason."""
        self._manifest = _read_manifest(manifest_path)
        self._status = _read_statuses(self.path / schema.STATUS_DIR, self.skipped)
        self._parts = {
            name: self._discover(name)
            for name in (schema.RECORDS_DIR, schema.STEPS_DIR, schema.MODULES_DIR)
        }

    # -- what the run is ---------------------------------------------------------------------

    @property
    def manifest(self) -> dict[str, Any]:
        """manifest.json, with ``status``, ``end_time`` and ``ranks`` folded in from status/."""
        merged = dict(self._manifest)
        merged["status"] = self.status
        ends = [s.get("end_time") for s in self._status.values()]
        finished = [float(e) for e in ends if e is not None]
        merged["end_time"] = max(finished) if finished and len(finished) == len(ends) else None
        merged["ranks"] = {str(r): s for r, s in sorted(self._status.items())}
        return merged

    @property
    def status(self) -> str:
        """The worst status over ranks: failed, incomplete, recording, then complete."""
        statuses = {s.get("status", schema.STATUS_INCOMPLETE) for s in self._status.values()}
        world = int(self._manifest.get("world_size", 1) or 1)
        if len(self._status) < world:
            statuses.add(schema.STATUS_INCOMPLETE)
        for status in (schema.STATUS_FAILED, schema.STATUS_INCOMPLETE, schema.STATUS_RECORDING):
            if status in statuses:
                return status
        return schema.STATUS_COMPLETE if statuses else schema.STATUS_INCOMPLETE

    @property
    def format_version(self) -> str:
        return str(self._manifest["format_version"])

    @property
    def ranks(self) -> list[int]:
        found = {_rank_of(p) for parts in self._parts.values() for p in parts}
        return sorted(found | set(self._status))

    # -- tables ------------------------------------------------------------------------------

    @cached_property
    def records(self) -> pd.DataFrame:
        """Every record: one row per recorded tensor per call per step (see docs/FORMAT.md)."""
        return self.query()

    @cached_property
    def steps(self) -> pd.DataFrame:
        """One row per recorded step and rank: micro-steps, skipped, counts, wall times."""
        table = self._read(schema.STEPS_DIR, schema.STEP_SCHEMA)
        frame = table.to_pandas()
        return frame.sort_values(["rank", "step"], kind="stable").reset_index(drop=True)

    @cached_property
    def modules(self) -> pd.DataFrame:
        """One row per module and rank: type, root, parent, depth, parameter count."""
        table = self._read(schema.MODULES_DIR, schema.MODULE_SCHEMA)
        frame = table.to_pandas()
        frame = frame.drop_duplicates(["rank", "module"], keep="first")
        return frame.reset_index(drop=True)

    def query(
        self,
        *,
        columns: Sequence[str] | None = None,
        steps: Iterable[int] | tuple[int, int] | None = None,
        modules: Iterable[str] | None = None,
        kinds: Iterable[str] | None = None,
        ranks: Iterable[int] | None = None,
        phases: Iterable[str] | None = None,
    ) -> pd.DataFrame:
        """Records matching every filter given, reading only what is needed.

        ``steps`` is either an iterable of step numbers or an inclusive ``(first, last)``
        range given as a tuple of two ints. Rows come in (rank, step, seq) order.
        """
        expr = None

        def both(e: Any) -> None:
            nonlocal expr
            expr = e if expr is None else expr & e

        if isinstance(steps, tuple) and len(steps) == 2:
            both((pc.field("step") >= steps[0]) & (pc.field("step") <= steps[1]))
        elif steps is not None:
            both(pc.field("step").isin(list(steps)))
        for name, values in (("module", modules), ("kind", kinds), ("phase", phases)):
            if values is not None:
                both(pc.field(name).cast(pa.string()).isin([str(v) for v in values]))
        if ranks is not None:
            both(pc.field("rank").isin([int(r) for r in ranks]))
        wanted = None
        if columns is not None:
            wanted = list(dict.fromkeys([*columns]))
            unknown = set(wanted) - set(schema.RECORD_SCHEMA.names) - {"rank"}
            if unknown:
                raise TraceError(
                    f"unknown record column(s) {sorted(unknown)}: choose from "
                    f"{', '.join(['rank', *schema.RECORD_SCHEMA.names])}"
                )
        table = self._read(schema.RECORDS_DIR, schema.RECORD_SCHEMA, columns=wanted, filter=expr)
        frame = table.to_pandas()
        order = [c for c in ("rank", "step", "seq") if c in frame.columns]
        if order:
            frame = frame.sort_values(order, kind="stable").reset_index(drop=True)
        return frame

    def timeline(self, step: int, *, micro_step: int | None = None, rank: int = 0) -> pd.DataFrame:
        """The events of ``step`` in execution order, with nesting depth and parent call:
        see :func:`hooktrace.analyze.timeline.timeline`."""
        from hooktrace.analyze.timeline import timeline

        return timeline(self, step, micro_step=micro_step, rank=rank)

    # -- tensors -----------------------------------------------------------------------------

    def record(
        self,
        module: str,
        kind: str,
        *,
        step: int,
        slot: str = "0",
        call: int = 0,
        rank: int = 0,
        micro_step: int | None = None,
        phase: str | None = None,
    ) -> pd.Series:
        """The single record that matches; raises TensorNotRecorded, saying what exists."""
        rows = self.query(steps=[step], modules=[module], kinds=[kind], ranks=[rank])
        match = rows[(rows["slot"].astype(str) == slot) & (rows["call"] == call)]
        if micro_step is not None:
            match = match[match["micro_step"] == micro_step]
        if phase is not None:
            match = match[match["phase"].astype(str) == phase]
        if match.empty:
            raise TensorNotRecorded(
                f"no {kind} record of {module!r} (slot {slot}, call {call}, rank {rank}) at step "
                f"{step}: {self._what_exists(module, kind, rank)}"
            )
        return match.iloc[0]

    def tensor(
        self,
        module: str,
        kind: str,
        *,
        step: int,
        slot: str = "0",
        call: int = 0,
        rank: int = 0,
        micro_step: int | None = None,
        phase: str | None = None,
    ) -> np.ndarray:
        """A saved full tensor, dtype kept exactly (bfloat16 as ``ml_dtypes.bfloat16``)."""
        row = self.record(
            module,
            kind,
            step=step,
            slot=slot,
            call=call,
            rank=rank,
            micro_step=micro_step,
            phase=phase,
        )
        if not row["tensor_key"]:
            raise TensorNotRecorded(
                f"the {kind} of {module!r} at step {step} has statistics only; record with "
                f"full tensors for it (full_steps=[{step}] or full_every=1, and full_modules "
                f"matching {module!r}) to save it"
            )
        with h5py.File(self._segment_path(row["segment"]), "r") as f:
            dataset = f[row["tensor_key"]]
            data = dataset[()]
            dtype = str(dataset.attrs.get("dtype", data.dtype.name))
        if dtype in _NUMPY_DTYPES:
            data = np.asarray(data).view(_NUMPY_DTYPES[dtype])
        return np.asarray(data)

    def activity(
        self,
        module: str,
        kind: str = "output",
        *,
        step: int,
        slot: str = "0",
        call: int = 0,
        rank: int = 0,
    ) -> np.ndarray:
        """Per-unit positive counts of one record (each out of ``unit_size`` values)."""
        row = self.record(module, kind, step=step, slot=slot, call=call, rank=rank)
        if int(row["units"]) == 0:
            raise TensorNotRecorded(
                f"no per-unit activity was recorded for the {kind} of {module!r}"
            )
        return self.read_activity(row["segment"], [int(row["activity_offset"])], int(row["units"]))[
            0
        ]

    def read_activity(self, segment: str, offsets: Sequence[int], units: int) -> list[np.ndarray]:
        """Slices of one segment's activity array: for analyses that read many at once."""
        with h5py.File(self._segment_path(segment), "r") as f:
            merged = f["activity"][()]
        return [merged[o : o + units] for o in offsets]

    # -- presentation ------------------------------------------------------------------------

    def __repr__(self) -> str:
        steps = self.query(columns=["step"])["step"]
        n_steps = steps.nunique()
        span = f"steps {steps.min()}–{steps.max()} ({n_steps})" if n_steps else "no steps"
        kinds = self.query(columns=["kind"])["kind"].astype(str).value_counts()
        lines = [
            f"Trace('{self.path}')",
            f"  status {self.status}, format {self.format_version}, ranks {self.ranks}",
            f"  {span}, {len(self.modules)} modules, {len(steps):,} records",
            "  kinds: " + ", ".join(f"{k} {v:,}" for k, v in kinds.items()),
        ]
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} unreadable file(s): see .skipped")
        return "\n".join(lines)

    # -- internals ---------------------------------------------------------------------------

    def _discover(self, kind_dir: str) -> list[Path]:
        base = self.path / kind_dir
        if not base.is_dir():
            return []
        good: list[Path] = []
        for part in sorted(base.glob("rank=*/part-*.parquet")):
            try:
                _rank_of(part)
                pq.read_metadata(part)
            except (OSError, ValueError, pa.ArrowException) as exc:
                self.skipped.append(f"{part.relative_to(self.path)}: {_one_line(exc)}")
                continue
            good.append(part)
        return good

    def _read(
        self,
        kind_dir: str,
        file_schema: pa.Schema,
        *,
        columns: list[str] | None = None,
        filter: Any = None,
    ) -> pa.Table:
        full_schema = file_schema.append(schema.PARTITIONING.field("rank"))
        parts = self._parts[kind_dir]
        if not parts:
            empty = full_schema.empty_table()
            return empty.select(columns) if columns else empty
        dataset = ds.dataset(
            [str(p) for p in parts],
            schema=full_schema,
            format="parquet",
            partitioning=ds.partitioning(schema.PARTITIONING, flavor="hive"),
            partition_base_dir=str(self.path / kind_dir),
        )
        try:
            return dataset.to_table(columns=columns, filter=filter)
        except (OSError, pa.ArrowException) as exc:
            raise TraceError(
                f"cannot read {kind_dir} of {self.path}: {_one_line(exc)}; run `hooktrace check "
                f"{self.path}` to see which files are damaged"
            ) from exc

    def _segment_path(self, segment: str) -> Path:
        path = (self.path / segment).resolve()
        if not path.is_relative_to(self.path.resolve()):
            raise TraceError(f"refusing to read {segment!r}: it points outside the run directory")
        if not path.exists():
            raise TraceError(
                f"segment {segment} is missing from {self.path}: run `hooktrace check`"
            )
        return path

    def _what_exists(self, module: str, kind: str, rank: int) -> str:
        rows = self.query(
            columns=["step", "module", "kind", "slot"], modules=[module], ranks=[rank]
        )
        if rows.empty:
            names = self.query(columns=["module"], ranks=[rank])["module"].astype(str).unique()[:8]
            return f"the trace has no module {module!r} (modules include: {', '.join(names)})"
        of_kind = rows[rows["kind"].astype(str) == kind]
        if of_kind.empty:
            kinds = sorted(rows["kind"].astype(str).unique())
            return f"{module!r} has kinds {', '.join(kinds)}"
        steps = of_kind["step"]
        slots = sorted(of_kind["slot"].astype(str).unique())
        return f"it has steps {steps.min()}–{steps.max()} and slots {', '.join(slots)}"


def _read_manifest(path: Path) -> dict[str, Any]:
    if not path.exists():
        raise TraceNotFound(
            f"{path.parent} is not a hooktrace run (no {schema.MANIFEST}): give a directory "
            "that `hooktrace record` or hooktrace.record() wrote"
        )
    try:
        manifest = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise TraceError(
            f"{path} is unreadable ({_one_line(exc)}): the trace's manifest is damaged"
        ) from exc
    if not isinstance(manifest, dict) or manifest.get("format") != schema.FORMAT_NAME:
        raise TraceError(
            f"{path} is not a hooktrace manifest: give a run directory hooktrace wrote"
        )
    try:
        major, _ = schema.parse_version(str(manifest["format_version"]))
    except (KeyError, ValueError) as exc:
        raise TraceError(f"{path} has no valid format_version: the manifest is damaged") from exc
    ours, _ = schema.parse_version(schema.FORMAT_VERSION)
    if major > ours:
        raise FormatVersionError(
            f"{path.parent} has trace format {manifest['format_version']}, newer than this "
            f"hooktrace reads ({schema.FORMAT_VERSION}): upgrade hooktrace"
        )
    if major < ours:
        raise FormatVersionError(
            f"{path.parent} has trace format {manifest['format_version']}, older than this "
            f"hooktrace reads ({schema.FORMAT_VERSION}): read it with an older hooktrace"
        )
    return manifest


def _read_statuses(directory: Path, skipped: list[str]) -> dict[int, dict[str, Any]]:
    statuses: dict[int, dict[str, Any]] = {}
    if not directory.is_dir():
        return statuses
    for path in sorted(directory.glob("rank=*.json")):
        try:
            rank = int(path.stem.partition("=")[2])
            payload = json.loads(path.read_bytes())
            if not isinstance(payload, dict):
                raise ValueError("not a JSON object")
        except (OSError, ValueError) as exc:
            skipped.append(f"{path.name}: {_one_line(exc)}")
            continue
        statuses[rank] = payload
    return statuses


def _rank_of(path: Path) -> int:
    for part in reversed(path.parts):
        if part.startswith("rank="):
            return int(part.partition("=")[2].removesuffix(".json"))
    raise ValueError(f"{path} is not under a rank=R directory")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
