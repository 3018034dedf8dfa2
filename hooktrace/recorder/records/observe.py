"""The hot path: a tensor that a hook sees becomes a record queued in the step.

:meth:`Observer.observe` runs for every recorded tensor of every module call: it queues the
tensor's statistics (summarised now where that is cheap, or staged for the writer), its
per-unit activity, its histogram where its kind takes one this step, and a copy of it on a
full step. It never writes and never waits for a device; the step's records go to the writer
at the step's end (:mod:`hooktrace.recorder.recording.recorder`).

Apart from the recorder so that the path a tensor takes reads in one screen, with the state
only it keeps: the latest tensors summarised (a container's output is its last child's, and
one gradient may reach several hooks: each tensor is summarised once), the shapes of
channels-first outputs, and the scratch buffer of the eager route.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hooktrace.recorder.records.layout import Meta
from hooktrace.recorder.records.pending import PendingStep
from hooktrace.recorder.records.shards import (
    Shard,
    collected,
    dtensor,
    local_shard,
    pending_collective,
)
from hooktrace.recorder.records.staging import Staged, StagedUnits
from hooktrace.recorder.stats import numba_kernels
from hooktrace.recorder.stats.histogram import histogram as histogram_of
from hooktrace.recorder.stats.histogram import histogram_many
from hooktrace.recorder.stats.stats import (
    PLAIN,
    STAGED_MAX_VALUES,
    nested_values,
    plain,
    python_subclass,
    route,
    shape_of,
    stageable,
    summarize_with_activity,
    unit_dim,
    unsupported,
    usual,
)
from hooktrace.trace import schema

_SHAPES: dict[tuple[int, ...], tuple[int, ...]] = {}
"""One tuple of each shape met, which the records hold: the collector stops tracking a
record's tuple at a young collection only where its shape's is untracked already, and a
new one's is not (``layout.MetaRow``)."""


def _kept(shape: tuple[int, ...]) -> tuple[int, ...]:
    kept = _SHAPES.get(shape)
    if kept is None:
        if len(_SHAPES) >= 65536:  # shapes that change every step: start again
            _SHAPES.clear()
        kept = _SHAPES.setdefault(shape, shape)
    return kept


_RECENT = 4
"""Tensors whose statistics a hook remembers, the latest ones: a container's output is its
last child's, and one gradient may reach several hooks in a row."""


@dataclass
class Reads:
    """What a kind's records keep from step to step while they hold: where their values lie,
    for the statistics (``staged_kernels.TensorsInPlace``) and the histograms
    (``histogram_kernel.TensorsInPlace``) read in place, made once the kernels are loaded;
    the histograms' places taken from the statistics' (``params._histogram_places``: the
    positions the statistics read and the entries histogrammed, the statistics' rows of
    those, the places, or None where they cannot be, and the statistics' places they were
    taken from); the groups on a device that ran out of memory batched
    (``params._batched``); whether this step's values were found as the last step's, bar
    where they lie (``params.RecordsCache``: the same type, dtype, shape, strides, device
    and negation bit each)."""

    stats: Any = None
    histograms: Any = None
    histogram_places: (
        tuple[list[int], tuple[int, ...], np.ndarray, np.ndarray | None, np.ndarray] | None
    ) = None
    unbatched: set[int] = field(default_factory=set)
    unchanged: bool = False


class Histograms:
    """Histograms made in a hook. One that cannot be made costs itself, not the record nor
    the recording: a warning says so, once a run, and the status counts ``failed``."""

    def __init__(self, warn: Callable[[str], None]) -> None:
        self.failed = 0  # histograms not made, in the hooks (the writer counts its own)
        self._warn = warn

    def one(self, tensor: torch.Tensor) -> Any:
        return self._made(histogram_of, tensor)

    def many(
        self,
        values: Sequence[torch.Tensor | None],
        reads: Reads | None = None,
        places: np.ndarray | None = None,
        buffer: Callable[[int], np.ndarray] | None = None,
    ) -> Any:
        """The histograms of CPU ``values``: rows of ``WIDTH``, or, where the kernel reads
        them in place, cut to their spans (``histograms.Spans``). ``reads``: where the
        same values' places are kept from step to step (:class:`Reads`); ``places``: where
        the caller found them (``histogram_kernel.histograms_at``), if it did;
        ``buffer(k)``: ``k`` int64 values where the kernel puts the spans
        (``PendingStep.counts``), if the caller has them."""
        kernels = numba_kernels.histograms() if reads is not None else None
        if reads is None or kernels is None:
            return self._made(histogram_many, values)
        if places is not None:
            return self._made(kernels.histograms_at, places, buffer)
        if reads.histograms is None:
            reads.histograms = kernels.TensorsInPlace()
        return self._made(reads.histograms.histograms, values, buffer)

    def _made(
        self,
        make: Callable[..., Any],
        values: Any,
        buffer: Callable[[int], np.ndarray] | None = None,
    ) -> Any:
        """``make(values)`` (``make(values, buffer)`` given ``buffer``), or None where it
        fails."""
        try:
            return make(values) if buffer is None else make(values, buffer)
        except Exception as exc:
            self.failed += 1
            if self.failed == 1:
                self._warn(
                    f"hooktrace: a histogram could not be made ({type(exc).__name__}: {exc}); "
                    "the records go on without it (the status counts histograms_failed)"
                )
            return None


class Observer:
    """Queues recorded tensors into a step's records. ``max_units``: a tensor with more
    units than that records no activity; ``max_tensor_bytes``: a larger tensor is not
    saved whole on a full step (the step counts it dropped)."""

    def __init__(self, *, max_units: int, max_tensor_bytes: int, histograms: Histograms) -> None:
        self.max_units = max_units
        self.max_tensor_bytes = max_tensor_bytes
        self.histograms = histograms
        self.scratch = torch.empty(0, dtype=torch.float32)
        self._in_place: Any = None  # staged_kernels.InPlace, once its kernels are loaded
        self.new_step(frozenset())

    def new_step(self, histogram_kinds: frozenset[str]) -> None:
        """A step begins; ``histogram_kinds`` take a histogram in it."""
        self.histogram_now = histogram_kinds
        self.channel_shapes: set[torch.Size] = set()  # of channels-first 3-D outputs
        self.recent: dict[int, tuple[weakref.ref[torch.Tensor], int, Any, Any]] = {}  # by id

    def observe(
        self,
        pending: PendingStep,
        micro_step: int,
        module: str,
        call: int,
        kind: str,
        slot: str,
        tensor: torch.Tensor,
        *,
        phase: str,
        full: bool,
        units: bool,
        note: str = "",
        histogram: bool = True,
        shard: Shard | None = None,
    ) -> Any:
        """Queue this tensor's statistics (and its histogram, where its kind takes one this
        step, unless ``histogram`` is False: made elsewhere) and note where they belong.
        Returns the statistics (None for a tensor not summarised): a row on the CPU, a
        tensor on a device, or where they will be made from a staged copy."""
        row = len(pending.meta)
        recent = self.recent.get(id(tensor))  # (lookup(), inline: this runs for every tensor)
        if (
            recent is not None
            and recent[0]() is tensor
            and tensor._version == recent[1]
            and (recent[3] is not None or not units)  # counts wanted now were not made then
        ):
            stats, counts = recent[2], recent[3]  # (only a usual tensor is remembered)
        else:
            summed = self._read_in_place(tensor, units)
            if summed is None:
                if not usual(tensor):
                    self._unusual(pending, micro_step, module, call, kind, slot, tensor, phase,
                                  full, units, histogram, shard)  # fmt: skip
                    return None
                summed = self._summarise(pending, tensor, units)
            stats, counts = summed
            # remembered for lookup(): the latest few tensors, forgotten all at once when
            # there are more (one met again after that is summarised again: the same
            # record, at the cost of its summary)
            try:
                version = tensor._version
            except RuntimeError:  # an inference tensor keeps no version counter
                pass
            else:
                remembered = self.recent  # (one C call each: hooks may fire in threads)
                if len(remembered) >= _RECENT:
                    remembered.clear()
                remembered[id(tensor)] = (weakref.ref(tensor), version, stats, counts)
        n_units = unit_size = 0
        if counts is not None and units:
            n_units = counts.units if isinstance(counts, StagedUnits) else counts.shape[0]
            unit_size = tensor.numel() // max(n_units, 1)
            pending.activity.append((row, counts))
        shape = tuple(tensor.shape)
        shape = _SHAPES.get(shape) or _kept(shape)
        pending.meta.append((micro_step, phase, module, call, kind, slot, tensor.dtype, shape,
                             n_units, unit_size, note, shard))  # fmt: skip
        pending.stats.append(stats)
        if histogram and kind in self.histogram_now:  # as the statistics: staged, or now
            binned = stats if type(stats) is Staged else self.histograms.one(tensor)
            if binned is not None:
                pending.histograms.append((row, binned))
        if full:
            self._snapshot(pending, row, tensor)
        return stats

    def summarised(
        self,
        pending: PendingStep,
        micro_step: int,
        module: str,
        call: int,
        kind: str,
        slot: str,
        stats: torch.Tensor,
        counts: torch.Tensor | None,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        *,
        phase: str,
        shard: Shard | None = None,
        value: torch.Tensor | None = None,
        full: bool = False,
    ) -> None:
        """Queue a record whose statistics were computed elsewhere (in a compiled graph):
        ``stats`` a row of ``STATS_WIDTH``, ``counts`` the per-unit positive counts;
        ``shard``: a DTensor's shard columns, where this is its local shard's; ``value``:
        the tensor itself, where the graph returned it: histogrammed where its kind takes a
        histogram this step, and saved whole where ``full``."""
        row = len(pending.meta)
        n_units = unit_size = 0
        if counts is not None:
            n_units = counts.shape[0]
            unit_size = math.prod(shape) // max(n_units, 1)
            pending.activity.append((row, counts))
        pending.meta.append((micro_step, phase, module, call, kind, slot, dtype, _kept(shape),
                             n_units, unit_size, "", shard))  # fmt: skip
        pending.stats.append(stats)
        if value is not None:
            if kind in self.histogram_now:
                binned = self.histograms.one(value)
                if binned is not None:
                    pending.histograms.append((row, binned))
            if full:
                self._snapshot(pending, row, value)

    def _read_in_place(
        self, tensor: torch.Tensor, units: bool
    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The route of most tensors a CPU run meets, taken in one place: a small, plain,
        contiguous CPU tensor of a dtype the kernels read (float32, float64, int64),
        summarised where it lies, with its per-unit counts, once the kernels are loaded.
        Each property is read once; None for any other tensor (:meth:`_summarise` and
        :meth:`_unusual` take it, with the same answer for these). What this asks implies
        :func:`usual`: a CPU tensor is no meta tensor, and these dtypes are neither complex
        nor quantized."""
        in_place = self._in_place
        if in_place is None or type(tensor) not in PLAIN:  # (first: a subclass's attributes
            return None  # may run its own code)
        code = in_place.codes.get(tensor.dtype)
        if (
            code is None
            or not tensor.is_cpu
            or tensor.is_nested
            or tensor.layout is not torch.strided
            or not tensor.is_contiguous()
            or tensor.is_neg()
        ):
            return None
        numel = tensor.numel()
        if not 0 < numel <= STAGED_MAX_VALUES or (code == in_place.FLOAT64 and in_place.flushes()):
            return None
        shape = tensor.shape
        outer = count = inner = 0  # the units counted: none
        if units and code != in_place.INT64 and shape:  # floating point, with units
            ndim = len(shape)
            dim = 1 if ndim >= 4 or (ndim == 3 and shape in self.channel_shapes) else ndim - 1
            if 0 < shape[dim] <= self.max_units:
                count = shape[dim]
                inner = 1 if dim == ndim - 1 else math.prod(shape[dim + 1 :])
                outer = numel // (count * inner)
        try:
            address = tensor.data_ptr()
        except RuntimeError:  # no storage to read (a functional tensor's)
            return None
        if not address:  # no memory of its own (an efficient zero tensor): staged
            return None
        return in_place.read(address, numel, code, outer, count, inner)

    def _summarise(
        self, pending: PendingStep, tensor: torch.Tensor, units: bool
    ) -> tuple[Any, Any]:
        """The statistics of ``tensor`` and its per-unit positive counts (None where it has
        no units): a small CPU tensor read in place where its kernels are ready, else staged
        for the writer; any other by :func:`summarize_with_activity`, on its own device."""
        dim = None
        if units and tensor.is_floating_point():
            channels_first = tensor.dim() == 3 and tensor.shape in self.channel_shapes
            dim = unit_dim(tensor, channels_first=channels_first)
            if dim is not None and not 0 < tensor.shape[dim] <= self.max_units:
                dim = None
        in_place = self._in_place
        if in_place is None and stageable(tensor):  # (numba loads at the first CPU tensor)
            kernels = numba_kernels.staged_loading()
            if kernels is not None:
                in_place = self._in_place = kernels.InPlace()
        if in_place is not None and tensor.numel() <= STAGED_MAX_VALUES:
            summed = in_place.summarize(tensor, dim)  # now, as the writer would from a copy
            if summed is not None:
                return summed
        if not stageable(tensor):
            return summarize_with_activity(tensor, dim, scratch=self._scratch_for(tensor))
        staged = pending.stage(tensor)  # summarised later, with the step's other small ones
        return staged, StagedUnits(
            staged.position, tuple(tensor.shape), dim
        ) if dim is not None else None

    def lookup(self, tensor: torch.Tensor) -> tuple[Any, Any] | None:
        """Statistics already queued for this very tensor (a container's output is its last
        child's output; one gradient reaches both): summarise each tensor once."""
        recent = self.recent.get(id(tensor))
        if recent is None:
            return None
        seen, version, stats, counts = recent
        if seen() is not tensor or tensor._version != version:
            return None
        return stats, counts

    def _unusual(
        self,
        pending: PendingStep,
        micro_step: int,
        module: str,
        call: int,
        kind: str,
        slot: str,
        tensor: torch.Tensor,
        phase: str,
        full: bool,
        units: bool,
        histogram: bool,
        shard: Shard | None = None,
    ) -> None:
        """A tensor that is not a plain dense one (``units`` and ``histogram`` as
        :meth:`observe` takes them). Nested tensors are summarised over their
        values, Python subclasses as plain tensors; any other costs its own record only: a
        record with no statistics, whose note says why (the recording goes on). A DTensor
        is summarised over its local shard, which its record's shard columns place (``shard``:
        a DTensor's, whose local shard this is); a collective's pending result once done."""
        if pending_collective(tensor):
            self.observe(pending, micro_step, module, call, kind, slot, collected(tensor),
                         phase=phase, full=full, units=units, histogram=histogram,
                         shard=shard)  # fmt: skip
            return
        if dtensor(tensor):
            local, shard = local_shard(tensor)
            self.observe(pending, micro_step, module, call, kind, slot, local,
                         phase=phase, full=full, units=units, histogram=histogram,
                         shard=shard)  # fmt: skip
            return
        if python_subclass(tensor):
            tensor = plain(tensor)
            if usual(tensor):
                self.observe(pending, micro_step, module, call, kind, slot, tensor,
                             phase=phase, full=full, units=units, histogram=histogram,
                             note="")  # fmt: skip
                return
        reason = unsupported(tensor)
        if reason is None:  # nested: summarised over its values
            values = nested_values(tensor)
            note = f"nested: statistics over the values of its {tensor.size(0)} components"
            self.observe(pending, micro_step, module, call, kind, slot, values,
                         phase=phase, full=False, units=False, histogram=histogram,
                         note=note)  # fmt: skip
            return
        pending.meta.append(
            Meta(micro_step, phase, module, call, kind, slot, tensor.dtype,
                 shape_of(tensor), 0, 0, schema.NOTE_SKIPPED + reason)
        )  # fmt: skip
        pending.stats.append(None)

    def _scratch_for(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """One float32 buffer, grown to the largest CPU tensor seen, for counting in place on
        the eager route (the one-pass kernel needs none)."""
        # route() last: it loads numba, which a run with no CPU tensor never needs
        if not tensor.is_cpu or tensor.numel() < 4096 or route().one_pass is not None:
            return None
        if self.scratch.numel() < tensor.numel():
            self.scratch = torch.empty(tensor.numel(), dtype=torch.float32)
        return self.scratch

    def _snapshot(self, pending: PendingStep, row: int, tensor: torch.Tensor) -> None:
        """A copy of the tensor for the writer (a full step), unless it is too large."""
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_tensor_bytes:
            pending.dropped += 1
            return
        source = tensor.detach()
        if source.layout != torch.strided:
            source = source.to_dense()
        event = None
        if source.device.type == "cuda":
            copy = source.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        elif source.device.type == "cpu":
            copy = source.clone(memory_format=torch.contiguous_format)
        else:
            copy = source.to("cpu")
        pending.tensors.append((row, copy, event))
        pending.nbytes += nbytes
