"""Writing an export's records as TensorBoard events: :class:`EventWriter`, a TensorBoard
run per (rank, phase), made on first use, with the run's text; a scalar per statistic of
each record, its histogram where it has one, at its step's end time. Never imports torch.

Apart from :mod:`hooktrace.analyze.export.tensorboard` because this is the writing, chunk by chunk,
of records already chosen and folded; that module chooses and folds them, and says what was
exported. The event files themselves are :mod:`hooktrace.analyze.export.events`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hooktrace.analyze.export import events as tb
from hooktrace.analyze.export import text
from hooktrace.analyze.findings import strings
from hooktrace.trace.logical import GRADIENT_KINDS
from hooktrace.trace.reader import Trace

LOGICAL_RUN = "logical"
"""The run that holds the logical records of a run of several ranks."""
TEXT_STEP = 0  # the step the run's text (command, versions, options) is written at


class EventWriter:
    """The event files of one export, a TensorBoard run per (rank, phase), made on first use."""

    def __init__(
        self, trace: Trace, root: Path, stats: Sequence[str], *, calls: str, logical: bool = False
    ) -> None:
        self.trace = trace
        self.root = root
        self.logical = logical  # one run (per phase), "logical", for the records of every rank
        self.stats = list(stats)
        self.calls = calls
        self.runs: dict[tuple[int, str], tb.EventRun] = {}
        self.series: set[tuple[int, str, str]] = set()
        self.steps: set[int] = set()
        self.scalars = 0
        self.histograms = 0
        self.nonfinite_histograms = 0
        # each step's end time, looked up by rank << 40 | step (16 bytes a step and rank)
        steps = trace.steps.dropna(subset=["end_time"])
        keys = _step_keys(steps["rank"].to_numpy(), steps["step"].to_numpy())
        order = np.argsort(keys, kind="stable")
        self._step_keys = keys[order]
        self._end_times = steps["end_time"].to_numpy(dtype=np.float64)[order]
        self.start_time = float(trace.manifest.get("start_time") or time.time())

    def add(self, frame: pd.DataFrame, found: pd.DataFrame | None) -> None:
        """Write the folded records of a chunk, and their histograms (from ``found``)."""
        if frame.empty:
            return
        prefix = _prefixes(frame)
        values = frame[self.stats].to_numpy(dtype=np.float64)
        histograms = _Histograms(frame, found)
        ranks = frame["rank"].to_numpy()
        phases = strings(frame["phase"])
        step_of = frame["step"].to_numpy()
        change = np.flatnonzero(
            (ranks[1:] != ranks[:-1]) | (phases[1:] != phases[:-1]) | (step_of[1:] != step_of[:-1])
        )
        for start, end in zip([0, *(change + 1)], [*(change + 1), len(frame)], strict=True):
            rank, phase, step = int(ranks[start]), str(phases[start]), int(step_of[start])
            events = self._run(rank, phase)
            step_tags = [f"{p}/{stat}" for p in prefix[start:end] for stat in self.stats]
            self.scalars += len(step_tags)
            out = []
            for row, proto in histograms.protos(start, end):
                if proto is None:  # every value NaN or Inf: nothing to place
                    self.nonfinite_histograms += 1
                    continue
                tag = f"{prefix[row]}/histogram"
                out.append(tb.histogram_value(tag, proto, describe=tag not in events.described))
                events.described.add(tag)
                self.histograms += 1
            self.series.update((rank, phase, p) for p in prefix[start:end])
            self.steps.add(step)
            wall_time = self._wall_time(rank, step)
            events.write(step, wall_time, step_tags, values[start:end].ravel().tolist(), out)

    def _wall_time(self, rank: int, step: int) -> float:
        """When ``step`` ended on ``rank``; when recording began, for a step the steps table
        lacks."""
        key = _step_keys(np.array([rank]), np.array([step]))[0]
        at = int(np.searchsorted(self._step_keys, key))
        if at < len(self._step_keys) and self._step_keys[at] == key:
            return float(self._end_times[at])
        return self.start_time

    def _run(self, rank: int, phase: str) -> tb.EventRun:
        if self.logical:
            rank = min(self.trace.ranks)  # the logical records' run: their lowest rank's text
        events = self.runs.get((rank, phase))
        if events is not None:
            return events
        name = LOGICAL_RUN if self.logical else f"rank={rank}"
        if (rank, "train") not in self.runs:  # the rank's run, with the text
            train = self.runs[(rank, "train")] = tb.EventRun(self.root / name)
            made = text.texts(
                self.trace, rank, stats=self.stats, calls=self.calls, logical=self.logical
            )
            texts = [tb.text_value(tag, markdown) for tag, markdown in made]
            train.write(TEXT_STEP, self.start_time, values=texts)
        if phase == "train":
            return self.runs[(rank, "train")]
        events = self.runs[(rank, phase)] = tb.EventRun(self.root / name / phase)
        return events

    def close(self) -> None:
        for events in self.runs.values():
            events.close()


class _Histograms:
    """The histograms of a chunk's folded records, joined to them on (rank, step, seq), with
    the statistics TensorBoard wants beside the counts: least and greatest value, sum and sum
    of squares (``mean * numel`` and ``norm ** 2``, unknown where a value is NaN or Inf)."""

    def __init__(self, frame: pd.DataFrame, found: pd.DataFrame | None) -> None:
        self.at = np.full(len(frame), -1, dtype=np.int64)
        if found is None or found.empty:
            return
        have = pd.MultiIndex.from_arrays(
            [found["rank"].astype("int64"), found["step"], found["seq"]]
        )
        want = pd.MultiIndex.from_arrays(
            [frame["rank"].astype("int64"), frame["step"], frame["seq"]]
        )
        self.at = have.get_indexer(want)  # the row of found for each record, -1 where none
        self.zero = found["zero"].to_numpy(dtype=np.int64)
        self.pos = found["pos"].to_numpy()  # views into one block per part: no copy
        self.neg = found["neg"].to_numpy()
        # a logical record of an activation gradient pooled over data-parallel ranks holds
        # statistics divided by their number; its histogram counts the values as computed
        scale = undivided(frame)
        self.low = frame["min"].to_numpy(dtype=np.float64) * scale
        self.high = frame["max"].to_numpy(dtype=np.float64) * scale
        finite = (frame["nan_count"] + frame["inf_count"] == 0).to_numpy()
        numel = frame["numel"].to_numpy(dtype=np.float64)
        mean = frame["mean"].to_numpy(dtype=np.float64) * scale
        self.total = np.where(finite, mean * numel, np.nan)
        self.squares = np.where(
            finite, (frame["norm"].to_numpy(dtype=np.float64) * scale) ** 2, np.nan
        )

    def protos(self, start: int, end: int) -> Iterator[tuple[int, Any]]:
        """(row, ``HistogramProto`` or None where every value was NaN or Inf) for the rows in
        ``start:end`` that have a histogram (a step's: their display counts made at once)."""
        rows = np.flatnonzero(self.at[start:end] >= 0) + start
        if len(rows) == 0:
            return
        at = self.at[rows]
        counts = tb.display_counts(
            self.zero[at], np.stack(self.pos[at].tolist()), np.stack(self.neg[at].tolist())
        )
        for row, row_counts in zip(rows.tolist(), counts, strict=True):
            yield (
                row,
                tb.histogram_proto(
                    row_counts,
                    low=float(self.low[row]),
                    high=float(self.high[row]),
                    total=float(self.total[row]),
                    squares=float(self.squares[row]),
                ),
            )


def _step_keys(ranks: np.ndarray, steps: np.ndarray) -> np.ndarray:
    return (ranks.astype(np.int64) << 40) | steps.astype(np.int64)


def _prefixes(frame: pd.DataFrame) -> np.ndarray:
    """``MODULE/KIND/SLOT`` of each record (``MODULE [call N]`` for a call after the first)."""
    module = strings(frame["module"])
    calls = frame["call"].to_numpy()
    later = np.flatnonzero(calls > 0)
    if len(later):
        module = module.copy()
        module[later] = [
            f"{m} [call {c}]" for m, c in zip(module[later], calls[later], strict=True)
        ]
    return module + "/" + strings(frame["kind"]) + "/" + strings(frame["slot"])


def undivided(frame: pd.DataFrame) -> np.ndarray:
    """What each record's statistics are multiplied by to be those of the values its
    histogram counts: the data-parallel degree for a logical record of an activation
    gradient pooled over several data-parallel ranks (divided by it,
    :mod:`hooktrace.trace.logical`), else 1."""
    if "dp" not in frame.columns:
        return np.ones(len(frame))
    gradient = strings(frame["kind"]).astype(object)
    divided = np.isin(gradient, GRADIENT_KINDS) & (frame["dp"].to_numpy() > 1)
    divided &= frame["shape"].astype(str).to_numpy() != ""  # a 0-d one is the ranks' mean
    return np.where(divided, frame["dp"].to_numpy(dtype=np.float64), 1.0)
