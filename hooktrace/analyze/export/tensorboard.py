"""A trace in TensorBoard: :func:`export_tensorboard`. Never imports torch.

What ``LOGDIR`` holds after an export, one TensorBoard run per directory:

- ``rank=R/``: the train phase of rank R: a scalar per statistic of each recorded tensor,
  tagged ``MODULE/KIND/SLOT/STAT`` (``blocks.0.fc/grad_param/weight/norm``), at each step;
  the histogram of each histogrammed record, tagged ``MODULE/KIND/SLOT/histogram``; and the
  run's command, versions, status and recording options as text (tags ``hooktrace/...``);
- ``rank=R/eval/``: the eval phase (forward passes under ``no_grad`` or in eval mode), the
  same tags, so that TensorBoard draws train and eval in one chart;
- for a run of several ranks, unless ``per_rank`` or ``ranks``: ``logical/`` and
  ``logical/eval/`` instead, the logical tensors of every rank's records
  (:mod:`hooktrace.trace.logical`; partial sums, each rank's own, left out) with the tags a
  one-process run gives them, and their histograms summed over the parts;
- ``hooktrace-export.json``: which run was exported, when, and with which options.

A series has one value a step: a module called several times in a micro-step (a shared
module, an RNN cell in a loop, a batch of an evaluation loop) is shown at its first call,
unless ``calls="all"``, which gives the calls after the first series of their own, under
``MODULE [call N]``; with gradient accumulation, the step's last micro-step is shown (the
one whose parameter gradients the optimizer uses). Each event's wall time is its step's end
time in the trace. Records with no statistics (a tensor hooktrace could not summarise, a
parameter that had no gradient) have no values.

The records are read a chunk of whole steps at a time, in step order (as ``anomalies``
reads them), and written as they are read: memory is bounded by ``chunk_rows`` whatever the
trace's size. The events go to a hidden directory beside ``LOGDIR``, which takes its place
only once every event is written, so ``LOGDIR`` never holds half an export, nor two.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hooktrace.analyze.export import directory as export_dir
from hooktrace.analyze.export import events as tb
from hooktrace.analyze.export.writer import EventWriter
from hooktrace.analyze.findings import StepsSpec, module_pattern, step_chunks, step_filter, strings
from hooktrace.errors import ConfigError, HooktraceError
from hooktrace.trace import schema
from hooktrace.trace.reader import Trace, load

Run = str | os.PathLike[str] | Trace
Progress = Callable[[int, int, str], None]

STATS = ("mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count")
"""The statistics a record's scalars can show (docs/FORMAT.md, records), all by default."""
CALLS = ("first", "all")
MARKER = export_dir.MARKER
HISTOGRAM_CHUNK_ROWS = 25_000
"""Records a chunk holds at most where histograms are read too: a histogram is 558 counts
(4.5 kB), so a chunk's are some 110 MB at most (every record histogrammed)."""

TensorBoardUnavailable = tb.TensorBoardUnavailable


class NothingToExport(HooktraceError):
    """No record of the run matches the filters."""


@dataclass
class TensorBoardExport:
    """What :func:`export_tensorboard` wrote."""

    logdir: Path
    run: Path
    runs: list[str]
    """The TensorBoard runs written, as directories under ``logdir`` (``rank=0``, ``rank=0/eval``)."""
    steps: int
    first_step: int | None
    last_step: int | None
    scalars: int
    """Scalar values written."""
    series: int
    """Series of records shown (module, kind, slot and call, per TensorBoard run): each has
    a scalar tag per statistic."""
    charts: int
    """Scalar charts TensorBoard shows: a tag per series and statistic, one chart for a tag
    whatever the runs that hold it (train and eval are drawn together)."""
    histograms: int
    """Histograms written."""
    nonfinite_histograms: int
    """Histograms not written, as every value they counted was NaN or Inf (TensorBoard has no
    bucket for those: the ``nan_count`` and ``inf_count`` scalars count them)."""
    has_histograms: bool
    """Whether the trace holds histograms at all."""
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["logdir"], out["run"] = str(self.logdir), str(self.run)
        return out


def export_tensorboard(
    run: Run,
    logdir: str | os.PathLike[str],
    *,
    steps: StepsSpec = None,
    modules: str | Iterable[str] | None = None,
    kinds: Iterable[str] | None = None,
    ranks: Iterable[int] | None = None,
    stats: Iterable[str] = STATS,
    calls: str = "first",
    histograms: bool = True,
    overwrite: bool = False,
    chunk_rows: int = 100_000,
    progress: Progress | None = None,
    per_rank: bool = False,
) -> TensorBoardExport:
    """Write ``run`` into ``logdir`` as TensorBoard event files (see the module docstring).

    ``steps`` (``"0-100"``, ``(first, last)`` or step numbers), ``modules`` (a regex searched
    in the name, or a list of names), ``kinds`` and ``ranks`` choose the records; ``stats``
    the statistics shown as scalars (of :data:`STATS`); ``calls`` ``"first"`` or ``"all"``;
    ``histograms=False`` leaves the histograms out. ``logdir`` must be new or empty, or hold
    an earlier export and ``overwrite`` be true. ``chunk_rows`` bounds the records held at
    once (:data:`HISTOGRAM_CHUNK_ROWS` where histograms are read). ``progress(done, total,
    what)`` is called before each chunk. A run of several ranks is written as its logical
    tensors, one run ``logical`` (and ``logical/eval``; partial sums left out), unless
    ``ranks`` or ``per_rank=True``: a run per rank.

    Raises :class:`TensorBoardUnavailable` without the ``tensorboard`` package,
    ``ConfigError`` on bad options or ``logdir``, :class:`NothingToExport` when no record
    matches, and the reader's ``TraceError`` for a run it cannot read."""
    tb.require()
    chosen_stats = _chosen(stats, STATS, "statistic")
    chosen_kinds = None if kinds is None else _chosen(kinds, schema.KINDS, "kind")
    if calls not in CALLS:
        raise ConfigError(f"calls must be one of {', '.join(CALLS)} (got {calls!r})")
    if chunk_rows < 1:
        raise ConfigError(f"chunk_rows must be 1 or more (got {chunk_rows})")
    selection = step_filter(steps)
    names = _module_filter(modules)
    trace = run if isinstance(run, Trace) else load(run)
    target = Path(logdir)
    export_dir.check(target, trace.path, overwrite=overwrite)
    chosen_ranks = None if ranks is None else sorted({int(r) for r in ranks})
    if chosen_ranks is not None and not set(chosen_ranks) & set(trace.ranks):
        raise ConfigError(
            f"{trace.path} has no rank {', '.join(map(str, chosen_ranks))}: its ranks are "
            f"{', '.join(map(str, trace.ranks)) or 'none'}"
        )

    logical = not per_rank and trace.logical_by_default(chosen_ranks)
    partials = 0

    staging = export_dir.Staging(target)
    writer: EventWriter | None = None
    try:
        writer = EventWriter(trace, staging.path, chosen_stats, calls=calls, logical=logical)
        has_histograms = trace.has_histograms
        if histograms and has_histograms:
            chunk_rows = min(chunk_rows, HISTOGRAM_CHUNK_ROWS)
        plan = list(step_chunks(trace, selection, chunk_rows))
        for done, chunk in enumerate(plan):
            if progress is not None:
                progress(done, len(plan), _describe(chunk))
            frame = trace.query(
                columns=_columns(chosen_stats), steps=chunk, kinds=chosen_kinds,
                ranks=chosen_ranks, logical=logical,
            )  # fmt: skip
            if logical:  # a partial sum is no logical tensor: each rank holds its own
                partial = (frame["merged"] == "partial").to_numpy()
                partials += int(partial.sum())
                frame = frame[~partial]
            frame = _fold(frame, names, calls, logical=logical)
            found = None
            if histograms and has_histograms and not frame.empty:
                found = trace.histograms(
                    steps=chunk, kinds=chosen_kinds, ranks=chosen_ranks, logical=logical
                )
            writer.add(frame, found)
        writer.close()
        if writer.scalars == 0 and writer.histograms == 0:
            raise NothingToExport(
                f"no record of {trace.path} matches the filters (steps, modules, kinds, ranks): "
                "loosen them"
            )
        options = {
            "steps": steps if steps is None or isinstance(steps, str | tuple) else list(steps),
            "modules": modules if modules is None or isinstance(modules, str) else list(modules),
            "kinds": chosen_kinds, "ranks": chosen_ranks, "stats": list(chosen_stats),
            "calls": calls, "histograms": histograms,
        }  # fmt: skip
        result = _result(writer, target, has_histograms)
        staging.publish(
            trace.path, options=options, runs=result.runs, steps=result.steps,
            scalars=result.scalars, histograms=result.histograms,
        )  # fmt: skip
    except BaseException:
        if writer is not None:
            writer.close()
        staging.discard()
        raise
    if partials:
        result.notes.append(
            f"{partials} partial-sum record(s) (a tensor each rank holds a summand of, not yet "
            "reduced) are no logical tensors: left out (per_rank=True writes them)"
        )
    if histograms and not has_histograms:
        why = trace.no_histograms_because
        result.notes.append(
            f"{trace.path} holds no histograms ({why}): exported its scalars and text"
        )
    return result


def _result(writer: EventWriter, logdir: Path, has_histograms: bool) -> TensorBoardExport:
    steps = sorted(writer.steps)
    return TensorBoardExport(
        logdir=logdir, run=writer.trace.path,
        runs=sorted(str(e.directory.relative_to(writer.root)) for e in writer.runs.values()),
        steps=len(steps), first_step=steps[0] if steps else None,
        last_step=steps[-1] if steps else None, scalars=writer.scalars,
        series=len(writer.series), histograms=writer.histograms,
        charts=len({prefix for *_, prefix in writer.series}) * len(writer.stats),
        nonfinite_histograms=writer.nonfinite_histograms, has_histograms=has_histograms,
    )  # fmt: skip


# -- reading -----------------------------------------------------------------------------------

_KEY = ["rank", "phase", "step", "module", "kind", "slot", "call"]


def _columns(stats: Sequence[str]) -> list[str]:
    needed = ["rank", "step", "micro_step", "phase", "seq", "module", "call", "kind", "slot"]
    needed += ["shape", "numel", "note", "mean", "norm", "min", "max", "nan_count", "inf_count"]
    return list(dict.fromkeys([*needed, *stats]))


def _fold(
    frame: pd.DataFrame, names: Callable[[str], bool] | None, calls: str, *, logical: bool = False
) -> pd.DataFrame:
    """The records shown: those of the modules chosen that have statistics; per series and
    step, the last micro-step's (and the first call's, unless ``calls == "all"``); in rank,
    phase and step order (``logical``: phase and step, the ranks of one run together)."""
    keep = (frame["numel"] > 0).to_numpy().copy()
    keep &= ~pd.Series(strings(frame["note"])).str.startswith(schema.NOTE_SKIPPED).to_numpy()
    if calls == "first":
        keep &= (frame["call"] == 0).to_numpy()
    if names is not None:
        module = frame["module"]
        if isinstance(module.dtype, pd.CategoricalDtype):
            chosen = np.array([names(str(c)) for c in module.cat.categories] + [False])
            keep &= chosen[module.cat.codes.to_numpy()]
        else:
            keep &= np.array([names(str(m)) for m in module], dtype=bool)
    frame = frame[keep]
    order = [*_KEY, "micro_step", "seq"]
    if logical:
        order.remove("rank")
        order.insert(2, "rank")
    frame = frame.sort_values(order, kind="stable").drop_duplicates(_KEY, keep="last")
    return frame.reset_index(drop=True)


# -- options and the log directory ------------------------------------------------------------


def _chosen(values: Iterable[str], known: Sequence[str], what: str) -> list[str]:
    chosen = list(dict.fromkeys(str(v) for v in values))
    unknown = [v for v in chosen if v not in known]
    if unknown or not chosen:
        raise ConfigError(
            f"unknown {what} {', '.join(map(repr, unknown))}: choose from {', '.join(known)}"
            if unknown
            else f"choose at least one {what} of {', '.join(known)}"
        )
    return chosen


def _module_filter(modules: str | Iterable[str] | None) -> Callable[[str], bool] | None:
    if modules is None:
        return None
    if isinstance(modules, str):
        pattern = module_pattern(modules)
        return lambda name: pattern.search(name) is not None
    names = {str(m) for m in modules}
    return lambda name: name in names


def _describe(chunk: tuple[int, int] | list[int]) -> str:
    lo, hi = (chunk[0], chunk[-1]) if isinstance(chunk, list) else chunk
    return f"step {lo}" if lo == hi else f"steps {lo}–{hi if hi < 2**62 else 'end'}"
