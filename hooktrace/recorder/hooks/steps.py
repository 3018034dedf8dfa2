"""Step boundaries: the optimizer's step ends a step, whose records go to the writer whole.

An optimizer step of an optimizer holding a recorded model's parameters ends a step; one
that holds none is counted, and the trace says so when nothing was recorded. Before the
update, while captures are armed, the gradients are recorded at once: their NaN and Inf
counts say whether a parameter's gradient is non-finite while the parameters are still the
ones the backward used. At the step's end its records are handed to the writer whole (a
signal may have landed between a hook's two appends) and the next step's state is set.

:class:`Steps` is a base class of :class:`~hooktrace.recorder.recording.recorder.Recorder`, over the
hooks' (:mod:`~hooktrace.recorder.hooks.hooks`), for the hooks' reasons: it reads and writes the
recorder's per-step state throughout, and ``hooktrace record``'s ScriptRecorder extends
``_end_step`` and the optimizer hooks by overriding them.
"""

from __future__ import annotations

import time
import weakref
from typing import Any

import numpy as np
import torch

from hooktrace.errors import RecordingError
from hooktrace.recorder.hooks.hooks import Hooks
from hooktrace.recorder.hooks.select import Sampling
from hooktrace.recorder.nonfinite import finite
from hooktrace.recorder.records.layout import Layouts
from hooktrace.recorder.records.pending import PendingStep
from hooktrace.recorder.records.staging import Staged, Staging, StagingPool
from hooktrace.trace.histograms import WIDTH as HISTOGRAM_WIDTH
from hooktrace.trace.writer import TraceWriter


class Steps(Hooks):
    """The recorder's step boundaries."""

    # the recorder's state that the step boundaries read and write, besides the hooks'
    _active: bool
    _closed: bool
    _grads_recorded: bool  # the gradients' records made before the optimizer's update
    _unrecorded: int  # optimizer steps of parameters no recorded model holds
    _submitted: int  # steps handed to the writer
    _sampling: Sampling
    _owners: Optimizers
    _writer: TraceWriter
    _staging_pool: StagingPool
    _counts_pool: StagingPool
    _layouts: Layouts

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the update, while capture is armed: the gradients' records now (the step's
        end keeps them), whose NaN and Inf counts say, for free, whether a parameter's
        gradient is non-finite while the parameters are still those the backward used."""
        captures = self._captures
        owned = self._owners.owned
        if not (captures.armed and self._recording and self.params and owned(optimizer)):
            return
        with self._lock:
            if self._grads_recorded:
                return
            first = len(self._pending.meta)
            try:
                self._record_params("grad_param")
            except Exception as exc:
                self._fault(exc, f"the gradients at step {self.current_step}")
                return
            self._grads_recorded = True
            where = self._where_now("train", 0)
            where["micro_step"] = max(self.micro_step - 1, 0)  # the last backward's
            try:
                if nonfinite_rows(self._pending, first, device_checks=captures.device_checks):
                    captures.after_gradients(where)
            except Exception as exc:  # a capture's failure is its own
                captures.failure(exc, "the parameters' gradients", where)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owned = self._owners.owned(optimizer)
        if owned:
            with self._lock:
                self._outside_forwards()
                self._end_step()
        else:
            self._unrecorded += 1

    def _end_step(self, *, skipped: bool = False) -> None:
        if self._closed:
            raise RecordingError("step() after close(): the recording has ended")
        if self._recording:
            try:
                if self.params and not self._grads_recorded:
                    self._record_params("grad_param")
                self._pending.skipped = skipped
                self._submit()
            except Exception as exc:
                self._fault(exc, f"the end of step {self.current_step}")
        if self._writer.error is not None and self._active:
            self._fault(self._writer.error, "the trace writer")
        self.current_step += 1
        self.micro_step = 0
        self._reset_step_state()

    def _outside_forwards(self) -> None:
        """At an optimizer step no forward runs: a root's forward that a BaseException ended
        (a KeyboardInterrupt the script caught) skipped the hook that leaves it."""
        self._root_depth = 0

    def _submit(self) -> None:
        pending = self._pending
        seal(pending, micro_steps=self.micro_step)
        self._pending = self._new_pending()
        self._observer.recent.clear()
        self._writer.submit(pending)
        self._submitted += 1
        self._table.drop_dead_replicas()
        self._calls.prune()

    def _new_pending(self) -> PendingStep:
        return PendingStep(
            self.current_step,
            time.time(),
            staging=Staging(self._staging_pool),
            counts_pool=self._counts_pool,
            layouts=self._layouts,
        )

    def _reset_step_state(self) -> None:
        step, sampling = self.current_step, self._sampling
        self._recording = self._active and sampling.recorded(step)
        self._full_step = self._recording and sampling.full(step)
        self._observer.new_step(sampling.histograms(step) if self._recording else frozenset())
        self._pending = self._new_pending()
        self._calls.new_step()
        self._params_phase = None
        self._grads_recorded = False
        self._captures.new_step(device_checks=self._writer.nonfinite_seen)


class Optimizers:
    """Which optimizers hold a parameter of a recorded model. ``param_ids``: the ids of the
    recorded models' parameters, kept up to date by the recorder's naming.

    A yes is remembered for the optimizer's life. A no only while the recorded parameters
    stay as many as when it was given: under ``hooktrace record`` an optimizer may step
    before its model's first forward has made it known (LBFGS's closure runs inside the
    step), and a model may gain parameters mid-run."""

    def __init__(self, param_ids: set[int]) -> None:
        self._param_ids = param_ids
        # optimizer -> the number of recorded parameters when it was asked (-1: it holds one)
        self._asked: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = (
            weakref.WeakKeyDictionary()
        )

    def owned(self, optimizer: torch.optim.Optimizer) -> bool:
        try:
            asked = self._asked.get(optimizer)
        except TypeError:  # unhashable (an __eq__ without __hash__): asked every time
            return self._holds(optimizer)
        if asked == -1:
            return True
        known = len(self._param_ids)
        if asked == known:
            return False
        owned = self._holds(optimizer)
        self._asked[optimizer] = -1 if owned else known
        return owned

    def _holds(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(
            id(p) in self._param_ids for group in optimizer.param_groups for p in group["params"]
        )


def seal(pending: PendingStep, *, micro_steps: int) -> None:
    """Make a step's records ready for the writer: whole records only, and its size."""
    # a signal can land between a hook's two appends: keep only whole records
    whole = min(len(pending.meta), len(pending.stats))
    if whole < max(len(pending.meta), len(pending.stats)):
        del pending.meta[whole:], pending.stats[whole:]
        pending.activity = [(row, counts) for row, counts in pending.activity if row < whole]
        pending.tensors = [item for item in pending.tensors if item[0] < whole]
        pending.specs = {row: spec for row, spec in pending.specs.items() if row < whole}
        pending.histograms = [item for item in pending.histograms if item[0] < whole]
        pending.histogram_blocks = [
            (rows[rows < whole], counts[rows < whole]) for rows, counts in pending.histogram_blocks
        ]
    pending.micro_steps = micro_steps
    pending.end_time = time.time()
    pending.nbytes += 96 * len(pending.meta) + pending.staging.nbytes
    histograms = len(pending.histograms) + sum(len(rows) for rows, _ in pending.histogram_blocks)
    pending.nbytes += HISTOGRAM_WIDTH * 8 * histograms  # held until the writer has them


def nonfinite_rows(pending: PendingStep, first: int, *, device_checks: bool) -> bool:
    """Whether a record of the step from row ``first`` on holds a NaN or Inf: from its
    row where that is on the host (the kernel summarised it in place), else from its
    staged copy (no numba, or a half precision value)."""
    bounds = values = None
    rows = pending.stats[first:]
    on_host = [stats for stats in rows if type(stats) is np.ndarray]  # most of them: at once
    if on_host and np.concatenate(on_host).reshape(len(on_host), -1)[:, 6:8].any():
        return True  # (columns 6 and 7: the NaN and Inf counts)
    for stats in rows:
        if stats is None or type(stats) is np.ndarray:
            continue
        if isinstance(stats, Staged):
            if bounds is None:
                bounds, values = pending.staging.bounds(), pending.staging.values()
            lo, hi = bounds[stats.position], bounds[stats.position + 1]
            if not np.isfinite(values[lo:hi]).all():  # type: ignore[index]
                return True
        elif finite.nonfinite(stats, on_device=device_checks):
            return True
    return False
