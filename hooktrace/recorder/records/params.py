"""Parameters, buffers and parameter gradients: a record of each, every step.

Most of a model's parameters are small: they are taken together (:class:`ParamRecords`),
rather than each taking a hook's work. On the CPU, once numba is loaded, one compiled call
reads the float32, float64 and int64 ones in place; the others are staged (one copy per
dtype) for the writer. On a device, those of a dtype are summarised and histogrammed in a
few launches for all (:mod:`hooktrace.recorder.stats.device_batches`). Large ones, and those
saved whole on a full step, take the hook's route one by one.

Values are looked up by name every step (:func:`values_of`): a module may replace a buffer
or a parameter with a new tensor (``model.double()`` replaces buffers, and a forward may
assign ``self.count = self.count + 1``); the record is of the tensor there now. Where the
name is gone, the tensor found at the start is recorded: pruning
(``torch.nn.utils.prune``) moves ``weight`` to ``weight_orig``, the same parameter.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from hooktrace.recorder.records.layout import Meta
from hooktrace.recorder.records.observe import Histograms, Reads
from hooktrace.recorder.records.pending import PendingStep
from hooktrace.recorder.records.shards import dtensor, local_shard
from hooktrace.recorder.records.staging import Staged, Staging
from hooktrace.recorder.stats import device_batches, numba_kernels
from hooktrace.recorder.stats.stats import shape_of, stageable, summarize, usual


class Entry(NamedTuple):
    """A parameter or buffer, recorded under ``module`` as ``slot``: ``table[attr]``, the
    owning module's ``_parameters`` or ``_buffers`` (``slot`` and ``attr`` differ under a
    compiled root, recorded as a whole); ``first`` is the tensor found there at the start."""

    module: str
    slot: str
    table: dict[str, Any]
    attr: str
    first: torch.Tensor | None

    @classmethod
    def of(cls, module: str, slot: str, owner: nn.Module, attr: str) -> Entry:
        table = owner._parameters if attr in owner._parameters else owner._buffers
        return cls(module, slot, table, attr, table[attr])


def values_of(entries: Sequence[Entry], kind: str) -> list[torch.Tensor | None]:
    """The tensors the entries name now (parameters or buffers), or for ``grad_param`` the
    parameters' gradients (None where there is none, or where the name holds None)."""
    values = [table.get(attr, first) for _, _, table, attr, first in entries]
    if kind == "grad_param":
        return [None if p is None else p.grad for p in values]
    return values


def trainable(entries: Sequence[Entry]) -> list[Entry]:
    """The entries whose parameter requires a gradient now: those whose ``grad_param`` is
    recorded. A parameter frozen for good (a frozen backbone, an EMA copy made with
    ``requires_grad_(False)``) gets no gradient by design, and no record saying it got none;
    one frozen or unfrozen mid-run is recorded from then on."""
    kept = []
    for entry in entries:
        value = entry.table.get(entry.attr, entry.first)
        if value is None or value.requires_grad:  # None: recorded without a value, as ever
            kept.append(entry)
    return kept


@dataclass(frozen=True)
class ParamRecords:
    """The records of one kind of value (``param``, ``buffer`` or ``grad_param``), in entry
    order. ``observed`` entries are summarised one by one, as a hook's tensor would be (large
    values, and values saved whole on a full step); ``on_device`` ones in batches, by device
    and dtype; the others are staged, ``together`` by dtype, or have no value (no record
    statistics)."""

    metas: tuple[Meta, ...]
    together: tuple[tuple[int, ...], ...]
    observed: tuple[int, ...]
    on_device: tuple[tuple[int, ...], ...] = ()

    def stage(
        self,
        values: Sequence[torch.Tensor | None],
        staging: Staging,
        reads: Reads,
        device_counts: dict[int, torch.Tensor] | None = None,
    ) -> list[Any]:
        """Each record's statistics, or what stands for them until the writer computes them
        (None: none, or an observed entry's). Once the compiled kernels are ready, the values
        they read in place are summarised now, in one call, and the rest staged (copied
        aside, one copy per dtype); before, all of them are staged. Both give the same rows,
        bit for bit. ``reads``: what these records keep from step to step (where their values
        lie), for as long as the records are those of the values (:class:`RecordsCache`).
        ``device_counts``: where given, the histograms of the values batched on a device are
        made with their statistics (their values copied once for both), by entry."""
        stats: list[Any] = [None] * len(self.metas)
        kernels = numba_kernels.staged_loading() if self.together else None
        if kernels is not None:
            indices = [i for group in self.together for i in group]
            if reads.stats is None:
                reads.stats = kernels.TensorsInPlace()
            rows = reads.stats.summarize([values[i] for i in indices], reads.unchanged)
            for i, row in zip(indices, rows, strict=True):
                stats[i] = row
        for group in self.together:
            staged = [i for i in group if stats[i] is None]
            if staged:
                first = staging.add_many([values[i] for i in staged])  # type: ignore[misc]
                for k, i in enumerate(staged):
                    stats[i] = Staged(first + k)
        for g, group in enumerate(self.on_device):
            counts = None
            if device_counts is None:
                rows = _batched(device_batches.summarize, group, g, values, reads)
            else:
                made = _batched(device_batches.both, group, g, values, reads)
                rows, counts = made if made is not None else (None, None)
            for k, i in enumerate(group):  # a row each, or each one's own route
                stats[i] = rows[k] if rows is not None else summarize(_local(values[i]))
                if counts is not None and device_counts is not None:
                    device_counts[i] = counts[k]
        return stats


def _batched(
    make: Callable[[Sequence[torch.Tensor]], Any],
    group: Sequence[int],
    g: int,
    values: Sequence[torch.Tensor | None],
    reads: Reads,
) -> Any:
    """``make`` (:func:`device_batches.summarize` or ``both``) of the values of
    ``group``, the ``g``-th on a device; None where the batches do not take them (given up,
    a CUDA graph captured, or the group ran out of memory while these records hold: each
    value then takes its own route, which copies less, and no failed allocation is tried
    again every step)."""
    if g in reads.unbatched:
        return None
    tensors = [_local(values[i]) for i in group]
    try:
        if not device_batches.usable(tensors[0].device, tensors[0].dtype):
            return None
        return make(tensors)
    except torch.cuda.OutOfMemoryError:
        reads.unbatched.add(g)
        return None
    except Exception as exc:
        device_batches.give_up(exc)
        return None


def _local(value: Any) -> torch.Tensor:
    """A batched value's tensor (a group's values are never None): a DTensor's local shard
    (read as an attribute, nothing dispatched through it), or the value itself."""
    return local_shard(value)[0] if dtensor(value) else value


def param_records(
    entries: Sequence[Entry],
    values: Sequence[torch.Tensor | None],
    *,
    kind: str,
    phase: str,
    micro_step: int,
    saved_whole: Collection[str],
) -> ParamRecords:
    """The records of ``values`` (:func:`values_of` of ``entries``). ``saved_whole``: the
    modules whose values this step saves whole; their records take the hook's route, which
    saves them."""
    metas: list[Meta] = []
    together: dict[torch.dtype, list[int]] = {}
    on_device: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    observed: list[int] = []
    for i, ((module, slot, *_), value) in enumerate(zip(entries, values, strict=True)):
        if value is None:
            metas.append(Meta(micro_step, phase, module, 0, kind, slot, None, (), 0, 0))
            continue
        local, shard = local_shard(value) if dtensor(value) else (value, None)
        if module not in saved_whole and device_batches.batchable(local):
            shape = tuple(local.shape)  # a DTensor's local shard, placed by its shard columns
            meta = Meta(
                micro_step, phase, module, 0, kind, slot, local.dtype, shape, 0, 0, "", shard
            )
            metas.append(meta)
            on_device.setdefault((local.device, local.dtype), []).append(i)
            continue
        shape = shape_of(value)
        metas.append(Meta(micro_step, phase, module, 0, kind, slot, value.dtype, shape, 0, 0))
        if module in saved_whole or not stageable(value):
            observed.append(i)
        else:
            together.setdefault(value.dtype, []).append(i)
    return ParamRecords(
        tuple(metas),
        tuple(tuple(indices) for indices in together.values()),
        tuple(observed),
        tuple(tuple(indices) for indices in on_device.values()),
    )


class RecordsCache:
    """:func:`param_records`, built once per kind and reused while what they depend on
    holds: the entries, which values are None, and each value's type, dtype, shape, strides,
    device, layout and negation bit (a value may be replaced, or change shape, between
    steps). torch's own tensor guard (:func:`_guard`, the check a compiled graph makes of its
    inputs) checks the values in one C++ call; where this torch has none, a Python key of
    each value is compared instead, in about five times as long (400 parameters: 23 against
    130 us, 2026-11-30)."""

    def __init__(self) -> None:
        self._built: dict[str, tuple[_Key, ParamRecords, Reads]] = {}

    def records(
        self,
        entries: Sequence[Entry],
        values: Sequence[torch.Tensor | None],
        *,
        kind: str,
        phase: str,
        micro_step: int,
        saved_whole: Collection[str],
    ) -> tuple[ParamRecords, Reads]:
        """The records, and what they keep from step to step (:meth:`ParamRecords.stage`;
        ``Reads.unchanged`` says whether every value was found as it was, bar its address)."""
        if not saved_whole:  # a full step's records differ, and full steps are rare
            built = self._built.get(kind)
            if built is not None:
                key, records, reads = built
                if key.holds(entries, values, phase, micro_step):
                    reads.unchanged = True
                    return records, reads
        records = param_records(
            entries, values, kind=kind, phase=phase, micro_step=micro_step, saved_whole=saved_whole
        )
        reads = Reads()  # a new one whenever the records are new
        if saved_whole:
            return records, reads
        try:
            key = _Key.of(entries, values, phase, micro_step)
        except (RuntimeError, ValueError):  # a value without a shape: not kept
            return records, reads
        self._built[kind] = (key, records, reads)
        return records, reads


@dataclass(frozen=True)
class _Key:
    """What a kind's records were built for: its entries (the same objects, or the same
    names), phase and micro-step, the positions of its None values, and the others' tensor
    guard, or where there is none, a Python key of each."""

    entries: Sequence[Entry]
    names: list[tuple[str, str]]
    phase: str
    micro_step: int
    nones: list[int]
    guard: Any  # torch's TensorGuards, or None
    described: list[tuple[Any, ...]] | None  # without a guard

    @classmethod
    def of(
        cls,
        entries: Sequence[Entry],
        values: Sequence[torch.Tensor | None],
        phase: str,
        micro_step: int,
    ) -> _Key:
        present = [v for v in values if v is not None]
        guard = _guard(present)
        return cls(
            entries=list(entries),
            names=[(entry.module, entry.slot) for entry in entries],
            phase=phase,
            micro_step=micro_step,
            nones=[i for i, v in enumerate(values) if v is None],
            guard=guard,
            described=None if guard is not None else [_described(v) for v in present],
        )

    def holds(
        self,
        entries: Sequence[Entry],
        values: Sequence[torch.Tensor | None],
        phase: str,
        micro_step: int,
    ) -> bool:
        if (
            phase != self.phase
            or micro_step != self.micro_step
            or len(entries) != len(self.entries)
        ):
            return False
        if not all(map(operator.is_, entries, self.entries)) and self.names != [
            (entry.module, entry.slot) for entry in entries
        ]:
            return False
        present = [v for v in values if v is not None]
        if len(present) != len(values) - len(self.nones) or (
            self.nones and self.nones != [i for i, v in enumerate(values) if v is None]
        ):
            return False
        try:
            if self.guard is not None:
                return bool(self.guard.check(*present))
            return self.described == [_described(v) for v in present]
        except (RuntimeError, ValueError, TypeError):  # a value without a shape
            return False


def _described(value: torch.Tensor) -> tuple[Any, ...]:
    return (type(value), value.dtype, value.shape, value.stride(), value.device, value.layout,
            value.is_neg())  # fmt: skip


def _guard(tensors: Sequence[torch.Tensor]) -> Any:
    """torch's check that tensors are as ``tensors`` are now (type, dtype, device, layout,
    sizes, strides, dispatch keys, requires_grad), or None where this torch has none that
    takes them (a private class of dynamo's, its arguments those of torch 2.1 to 2.13)."""
    if not _guards_tell():
        return None
    try:
        guard = _tensor_guards(tensors)
        return guard if guard.check(*tensors) else None
    except Exception:
        return None


def _tensor_guards(tensors: Sequence[torch.Tensor]) -> Any:
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None)


@functools.cache
def _guards_tell() -> bool:
    """Whether this torch's guard tells a tensor from one laid out otherwise (another
    shape, strides, dtype, or a negated view): asked once a process, so that a torch whose
    private class means something else takes the Python key instead."""
    try:
        base = torch.arange(4.0).reshape(2, 2)
        guard = _tensor_guards([base])
        others = [base.t(), torch._neg_view(base), base.reshape(4), base.double()]
        return bool(guard.check(base)) and not any(guard.check(other) for other in others)
    except Exception:
        return False


def queue_records(
    kind: str,
    entries: Sequence[Entry],
    cache: RecordsCache,
    pending: PendingStep,
    *,
    phase: str,
    micro_step: int,
    saved_whole: Collection[str],
    histograms: Histograms | None,
    observe: Callable[..., Any],
) -> None:
    """Queue one record per entry into ``pending``, in order: the staged and the in-place
    ones together, the ``observed`` ones through ``observe`` (the hook's route, which saves
    those of ``saved_whole`` modules). ``histograms``: None where ``kind`` takes none this
    step (histograms queued after the records: an interrupt between leaves none pointing
    past them)."""
    values = values_of(entries, kind)
    records, reads = cache.records(
        entries, values, kind=kind, phase=phase, micro_step=micro_step, saved_whole=saved_whole
    )
    wanted = histograms is not None
    device_counts: dict[int, torch.Tensor] | None = {} if wanted else None
    stats = records.stage(values, pending.staging, reads, device_counts)
    first_row = len(pending.meta)
    batched = {i for i in records.observed if wanted and _plain_cpu(values[i])}
    done = 0
    for i in records.observed:
        pending.meta.extend(records.metas[done:i])
        pending.stats.extend(stats[done:i])
        module, slot, *_ = entries[i]
        full = module in saved_whole
        observe(module, 0, kind, slot, values[i], phase=phase, full=full, units=False,
                histogram=i not in batched)  # fmt: skip
        done = i + 1
    pending.meta.extend(records.metas[done:])
    pending.stats.extend(stats[done:])
    if histograms is not None:
        _queue_histograms(pending, first_row, records.together, values, stats, sorted(batched),
                          histograms, reads)  # fmt: skip
        for group in records.on_device:  # made with the statistics, or each by its route
            for i in group:
                binned = (device_counts or {}).get(i)
                if binned is None:
                    binned = histograms.one(_local(values[i]))
                if binned is not None:
                    pending.histograms.append((first_row + i, binned))


def _queue_histograms(
    pending: PendingStep,
    first_row: int,
    together: Sequence[Sequence[int]],
    values: Sequence[torch.Tensor | None],
    stats: Sequence[Any],
    batched: Sequence[int],
    histograms: Histograms,
    reads: Reads,
) -> None:
    """The histograms of a kind's values, entry ``i`` being row ``first_row + i``: those
    staged, from their copies, in the writer; those read in place and the ``batched``
    ones (plain CPU tensors observed one by one), now, in one call. The hook's route made
    the other observed ones' (on a device, or not plain tensors)."""
    now = sorted([i for i, s in enumerate(stats) if type(s) is np.ndarray] + list(batched))
    places = _histogram_places(together, now, reads) if now and not batched else None
    counts = (
        histograms.many([values[i] for i in now], reads, places, pending.counts) if now else None
    )
    if counts is not None:
        pending.histogram_blocks.append((np.asarray(now, dtype=np.int64) + first_row, counts))
    pending.histograms.extend((first_row + i, s) for i, s in enumerate(stats) if type(s) is Staged)


def _histogram_places(
    together: Sequence[Sequence[int]], now: list[int], reads: Reads
) -> np.ndarray | None:
    """Where the entries ``now`` lie, for the histogram kernel (``histogram_kernel.
    histograms_at``), from the places the statistics read them at this step
    (``staged_kernels.TensorsInPlace.read``; ``together``: the entries it was given, in
    order): no tensor is asked again where it lies. None where one of them was not read
    there, or is of a dtype the histogram kernel does not read (int64). Built again only
    when the statistics read other positions, or the entries changed; where the same
    positions moved (a gradient is a new tensor each step), only their addresses are
    taken again."""
    read = reads.stats.read if reads.stats is not None else None
    if read is None:
        return None
    found, places = read
    cached = reads.histogram_places
    if cached is not None and cached[0] is found and cached[1] == tuple(now):
        _, _, rows, built, built_from = cached
        if built is None or built_from is places:
            return built
        built = built.copy()
        built[:, 0] = places[rows, 0]
        reads.histogram_places = (found, cached[1], rows, built, places)
        return built
    indices = [i for group in together for i in group]
    row_of = {indices[position]: row for row, position in enumerate(found)}
    found_rows = [row_of.get(i) for i in now]
    built = None
    rows = np.zeros(0, dtype=np.int64)
    hist = numba_kernels.histograms()
    staged = numba_kernels.staged()
    if hist is not None and staged is not None and None not in found_rows:
        rows = np.array(found_rows, dtype=np.int64)
        taken = places[rows]
        codes = [hist.CODES.get(staged.DTYPES[code]) for code in taken[:, 2].tolist()]
        if None not in codes and (taken[:, 1] > 0).all():
            built = np.column_stack(
                [taken[:, 0], taken[:, 1], np.array(codes), np.arange(len(rows))]
            ).astype(np.int64)
    reads.histogram_places = (found, tuple(now), rows, built, places)
    return built


def _plain_cpu(value: torch.Tensor | None) -> bool:
    """A value whose record the hook's route makes as it is (no unusual route) on the CPU."""
    return value is not None and usual(value) and value.is_cpu
