"""Small CPU tensors' statistics, compiled by numba: what the writer computes from their staged
copies (:func:`hooktrace.recorder.stats.stats.summarize_staged`), bit for bit, without the copy.

A small tensor (``stats.STAGED_MAX_VALUES`` values or fewer) is staged: its values copied
aside in the hook and summarised by numpy in the writer. These kernels give the very rows
numpy gives, in the same order of operations (no fastmath, numpy's pairwise summation), so
which of the two summarised a tensor never shows in a trace: a step's staged values, all of
its tensors in one call (:func:`summarize_segments`, :func:`unit_counts`), and float32,
float64 and int64 tensors read where they lie, in the hook (:class:`InPlace`; a kind's
parameters in one call, :class:`TensorsInPlace`). (One difference: where a
tensor's smallest or largest value is a zero of both signs, they order -0.0 before 0.0;
numpy returns either.) Side by side they take about 5% off the reference CNN's recorded
step (docs/PERFORMANCE.md).

They are loaded from numba's cache with the one-pass kernel, at the first CPU tensor
(:func:`hooktrace.recorder.stats.stats.route`, :mod:`hooktrace.recorder.stats.kernel_cache`).
"""

from __future__ import annotations

import sys
import threading
from typing import no_type_check

import numba
import numpy as np
import torch

from hooktrace.recorder.stats.kernel import (
    _FLIP,
    _KEY_POS_INF,
    _LOWEST,
    _float_of,
    _key,
    _plan,
    _pointer_at,
)


def warm_up() -> None:
    """Compile the kernels now (or load them from numba's cache)."""
    summarize_segments(np.zeros(1), np.array([0, 1], dtype=np.int64))
    unit_counts(np.zeros(1), np.array([[0, 1, 1, 1]], dtype=np.int64))
    summarize_tensors([torch.zeros(1, device="cpu")])  # one kernel for every dtype read in place
    InPlace().summarize(torch.zeros(1, device="cpu"), None)


def summarize_segments(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """:func:`hooktrace.recorder.stats.stats.summarize_staged` in one compiled call: the rows are
    equal to numpy's, sums included (``values`` float64, ``bounds`` int64, each segment
    ``values[bounds[i]:bounds[i + 1]]`` non-empty)."""
    out = np.empty((len(bounds) - 1, 8), dtype=np.float64)
    _segments(values, bounds, out)
    return out


def unit_counts(values: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """Positive values per unit of several staged tensors, one after the other (int64).

    ``segments`` is int64 (k, 4): each tensor's first value in ``values``, and its
    (outer, units, inner) sizes around the unit dimension."""
    out = np.zeros(int(segments[:, 2].sum()), dtype=np.int64)
    _unit_counts(values, segments, out)
    return out


def summarize_tensors(tensors: list[torch.Tensor]) -> list[np.ndarray | None]:
    """:func:`summarize_segments` of float32, float64 and int64 CPU tensors, read where they
    lie: no copy, and rows equal to those of their float64 copies, bit for bit. One row per
    tensor, or None for a tensor that cannot be read in place (:func:`_address`), which is
    not read. The caller keeps the tensors alive through the call."""
    rows: list[np.ndarray | None] = [None] * len(tensors)
    found = [(i, address) for i, t in enumerate(tensors) if (address := _address(t))]
    if found:
        out = np.empty((len(found), 8), dtype=np.float64)
        places = np.array(
            [
                (address, tensors[i].numel(), _IN_PLACE[tensors[i].dtype], 0, 0, 0)
                for i, address in found
            ],
            dtype=np.int64,
        )
        _in_place(places, out, _NO_COUNTS, _flushes_denormals())
        for k, (i, _) in enumerate(found):
            rows[i] = out[k]
    return rows


class TensorsInPlace:
    """:func:`summarize_tensors` of the same kind of tensors step after step (a model's
    parameters, their gradients), for a caller that checks that each position still holds a
    small strided CPU tensor of the same dtype and shape (``params.RecordsCache``), and says
    where it found each of the same type, strides and negation bit as well (``unchanged``):
    where each tensor lies is read every step, and the places are built again when one moved
    or is no longer read in place (a parameter is updated in place, so most steps find every
    address where it was)."""

    def __init__(self) -> None:
        # the positions read in place, their addresses and their places: one tuple, replaced
        # whole, so that a thread reading it never sees the parts of two steps
        self._built: tuple[list[int], list[int], np.ndarray] = ([], [], np.zeros((0, 6)))
        self._checked = -1  # the number of tensors the positions were found among
        self.read: tuple[list[int], np.ndarray] | None = None
        """Where the last :meth:`summarize` read its tensors in place: their positions in
        its list, and a place each, (address, values, dtype as :data:`DTYPES` names it, ...).
        The positions are the same list object while the same positions are read, the
        places the same array while nothing moved. None: it read none so."""

    def summarize(
        self, tensors: list[torch.Tensor], unchanged: bool = False
    ) -> list[np.ndarray | None]:
        """``unchanged``: the caller found each tensor of the same type, dtype, strides and
        negation bit as at the last call (``params.RecordsCache``): only where they lie is
        read again, not whether they can be read in place."""
        self.read = None
        flush = _DENORMAL64 == 0.0
        if flush:
            return summarize_tensors(tensors)  # float64 ones are staged then: rare
        built = self._built
        try:
            addresses = None
            if unchanged and self._checked == len(tensors):
                found = built[0]
                addresses = [tensors[i].data_ptr() for i in found]
                if 0 in addresses:  # one with no memory of its own now: checked again
                    addresses = None
            if addresses is None:
                self._checked = -1
                found = [
                    i
                    for i, t in enumerate(tensors)
                    if type(t) in _PLAIN
                    and t.dtype in _IN_PLACE
                    and t.is_contiguous()
                    and not t.is_neg()
                ]  # the rest of _address(): the caller's checks (small CPU tensors, strided)
                addresses = [tensors[i].data_ptr() for i in found]
                if 0 in addresses:  # no memory of its own to read (an efficient zero tensor)
                    found = [i for i, a in zip(found, addresses, strict=True) if a]
                    addresses = [a for a in addresses if a]
                self._checked = len(tensors)
        except RuntimeError:  # a tensor with no storage to read
            self._checked = -1
            return summarize_tensors(tensors)
        if addresses != built[1]:
            if found == built[0]:  # the same positions, moved (a gradient is new each step):
                found = built[0]  # their sizes and dtypes are as before, by the caller's check
                places = built[2].copy()
                places[:, 0] = addresses
            else:
                places = np.array(
                    [
                        (address, tensors[i].numel(), _IN_PLACE[tensors[i].dtype], 0, 0, 0)
                        for i, address in zip(found, addresses, strict=True)
                    ],
                    dtype=np.int64,
                ).reshape(-1, 6)
            built = self._built = (found, addresses, places)
        found, _, places = built
        self.read = (found, places)
        rows: list[np.ndarray | None] = [None] * len(tensors)
        if found:
            out = np.empty((len(found), 8), dtype=np.float64)
            _in_place(places, out, _NO_COUNTS, flush)
            for i, row in zip(found, out, strict=True):
                rows[i] = row
        return rows


class InPlace:
    """:func:`summarize_tensors` of one tensor at a time, with its positive counts per unit,
    for the hooks: what the writer makes of the tensor staged, without staging it, and with
    no array allocated a tensor. Rows and counts are views into blocks allocated a few
    hundred tensors at a time and never written again once handed out, so they stay valid
    for as long as the step holds them. Hooks in several threads may call it: the kernel
    takes each call's place in the blocks holding the GIL (no lock taken: 0.9 us a call
    less, 2026-11-30), and new blocks are made under a lock."""

    _ROWS = 256
    _COUNTS = 8192

    def __init__(self) -> None:
        # how the kernel names the dtypes it reads, for a caller that checks a tensor itself
        self.codes = _IN_PLACE
        self.FLOAT64, self.INT64 = _FLOAT64, _INT64
        self.flushes = _flushes_denormals  # float64 is then not read in place
        self._lock = threading.Lock()  # a free-threaded Python's calls (no GIL to hold)
        self._replacing = threading.Lock()
        # the rows, the counts, and the next place in each (the kernel moves it on): one
        # tuple, replaced whole when they are full
        self._blocks = (np.empty((0, 8)), np.zeros(0, dtype=np.int64), np.zeros(2, np.int64))

    def summarize(
        self, tensor: torch.Tensor, dim: int | None
    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The statistics row of ``tensor`` and its positive counts per unit along ``dim``
        (None: no counts), or None if the tensor cannot be read in place."""
        address = _address(tensor)
        if not address:
            return None
        outer, units, inner = (0, 0, 0) if dim is None else _plan(tuple(tensor.shape), dim)[:3]
        return self.read(address, tensor.numel(), _IN_PLACE[tensor.dtype], outer, units, inner)

    def read(
        self, address: int, numel: int, code: int, outer: int, units: int, inner: int
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`summarize` of a tensor that :func:`_address` found at ``address``, with
        ``numel`` values of the dtype ``_IN_PLACE`` names ``code``, counted per unit as
        (``outer``, ``units``, ``inner``) values (``units`` 0: not counted). The hooks call
        this once a tensor: one frame around the kernel."""
        flush = _DENORMAL64 == 0.0
        blocks = self._blocks
        if _NO_GIL:  # no GIL to hold: the lock orders two threads' places
            with self._lock:
                place = _one_in_place(address, numel, code, outer, units, inner, *blocks, flush)
        else:
            place = _one_in_place(address, numel, code, outer, units, inner, *blocks, flush)
        while place < 0:  # full: new blocks, unless another thread's call made them
            with self._replacing:
                if self._blocks is blocks:
                    self._blocks = (np.empty((self._ROWS, 8)),
                                    np.zeros(max(self._COUNTS, units), dtype=np.int64),
                                    np.zeros(2, dtype=np.int64))  # fmt: skip
                blocks = self._blocks
            with self._lock:
                place = _one_in_place(address, numel, code, outer, units, inner, *blocks, flush)
        rows, counts, _ = blocks
        i, at = place >> 32, place & 0xFFFFFFFF
        return rows[i], counts[at : at + units] if units else None


def _address(t: torch.Tensor) -> int:
    """Where ``t``'s values lie, if they are ``numel()`` values of a dtype read in place
    (``_IN_PLACE``) one after the other: a plain contiguous CPU tensor with values, not a
    view that negates its memory (``is_neg``), and with memory of its own (a functional
    tensor has none: 0). Else 0."""
    if t.dtype is torch.float64 and _flushes_denormals():
        # a staged copy keeps float64 denormals as they are (a byte copy) where this thread
        # would read them as zeros: the two routes must agree, whenever the kernels arrive
        return 0
    if not (
        type(t) in _PLAIN
        and t.dtype in _IN_PLACE
        and t.is_cpu
        and t.layout is torch.strided
        and t.is_contiguous()
        and not t.is_neg()
        and t.numel() > 0
    ):
        return 0
    try:
        return t.data_ptr()
    except RuntimeError:  # no storage to read
        return 0


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NO_GIL = not getattr(sys, "_is_gil_enabled", lambda: True)()
"""A free-threaded Python runs without the GIL that :func:`_one_in_place` holds."""
_FLOAT32, _FLOAT64, _INT64 = 0, 1, 2
_IN_PLACE = {torch.float32: _FLOAT32, torch.float64: _FLOAT64, torch.int64: _INT64}
"""The dtypes read in place, and how the kernel names them. Others (half precision, bool,
smaller integers) are rare in parameters and buffers, and staged."""
DTYPES = {code: dtype for dtype, code in _IN_PLACE.items()}
"""The dtype each code names (``TensorsInPlace.read``'s places hold codes)."""
_NO_COUNTS = np.zeros(0, dtype=np.int64)
_DENORMAL64 = 5e-324  # the smallest float64: zero where this thread flushes denormals
_SMALLEST_NORMAL32 = np.int32(0x00800000)  # the bits of float32's smallest normal value


def _flushes_denormals() -> bool:
    """Whether this thread's CPU treats denormal floats as zero (``torch.set_flush_denormal``
    sets it per thread): a Python float's comparison runs on the CPU's own flags."""
    return _DENORMAL64 == 0.0


# The writer's kernels, for the staged values of small tensors (float64). Their results must
# equal numpy's (``stats.summarize_staged``), so they do what numpy does in the order numpy
# does it: no fastmath, and numpy's pairwise summation (:func:`_pairwise`).
_exact = numba.njit(nogil=True, cache=True, boundscheck=False)
_held = numba.njit(cache=True, boundscheck=False)  # holds the GIL: see _one_in_place
_inline = numba.njit(inline="always", boundscheck=False)  # no fastmath: numpy's order
_part = numba.njit(boundscheck=False)
"""A kernel's part, compiled once for each of its callers' argument types and left to LLVM
to inline, instead of numba inlining it into every call site (``_inline``, kept for the
smallest): every kernel the recorder loads compiled cold in 44 s against 57 to 60 with these
inlined too. The hooks' calls took the same time, the writer's staged segments 60 ns more
each (2026-11-30, paired)."""


@_exact
@no_type_check
def _segments(values, bounds, out):
    """One row per segment: mean, std (two passes), min, max, norm, zeros, NaNs, infinities."""
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        extremes, zeros, nans, infs = _scan64(values, lo, hi)
        _finish_row(values, lo, hi, extremes, zeros, nans, infs, out[i])


@_part
@no_type_check
def _scan64(values, lo, hi):
    """Extremes and counts of float64 ``values[lo:hi]``, taken on the values' bits, as
    integers (as :func:`hooktrace.recorder.stats.kernel._rows` does for float32): integer comparisons vectorise where float
    ones, which must mind NaN, do not."""
    bits = values.view(np.int64)
    k_lo, k_hi = _FLIP64, _LOWEST64
    zeros = nans = infs = 0
    for j in range(lo, hi):
        b = bits[j]
        k = b ^ ((b >> 63) & _FLIP64)
        k_lo, k_hi = min(k_lo, k), max(k_hi, k)
        magnitude = b & _FLIP64
        zeros += magnitude == 0
        nans += magnitude > _INF64
        infs += magnitude == _INF64
    return (_from_key64(k_lo), _from_key64(k_hi)), zeros, nans, infs


@_part
@no_type_check
def _scan32(values, flush):
    """As :func:`_scan64`, for float32 values; the extremes widened to float64. ``flush``:
    the calling thread treats denormals as zero (``torch.set_flush_denormal``), so widening
    makes zeros of them, as it does in the staged copy: they count as zeros."""
    bits = values.view(np.int32)
    k_lo, k_hi = _FLIP, _LOWEST
    zeros = nans = infs = 0
    for j in range(values.size):
        b = bits[j]
        k_lo, k_hi = min(k_lo, _key(b)), max(k_hi, _key(b))
        magnitude = b & _FLIP
        zeros += magnitude == 0 or (flush and magnitude < _SMALLEST_NORMAL32)
        nans += magnitude > _KEY_POS_INF
        infs += magnitude == _KEY_POS_INF
    return (np.float64(_float_of(k_lo)), np.float64(_float_of(k_hi))), zeros, nans, infs


@_part
@no_type_check
def _scan_int64(values):
    """As :func:`_scan64`, for int64 values; the extremes widened to float64 (widening keeps
    the order, so they are the extremes of the widened values)."""
    lo, hi = values[0], values[0]
    zeros = 0
    for j in range(values.size):
        v = values[j]
        lo, hi = min(lo, v), max(hi, v)
        zeros += v == 0
    return (np.float64(lo), np.float64(hi)), zeros, 0, 0


@_exact
@no_type_check
def _in_place(places, out, counts, flush):
    """:func:`_segments` of tensors read where they lie, and :func:`_unit_counts` of them:
    tensor ``i`` is ``places[i, 1]`` values of dtype ``places[i, 2]`` (``_IN_PLACE``) from
    address ``places[i, 0]``, seen as (outer, units, inner) = ``places[i, 3:6]`` (no units:
    not counted). Each value is widened to float64 as it is read, so the rows equal those of
    the tensors' float64 copies, bit for bit. ``counts``: int64, the tensors' units one after
    the other, zeros on entry. ``flush``: whether this thread flushes denormals
    (:func:`_flushes_denormals`)."""
    at = 0
    for i in range(places.shape[0]):
        address, n, dtype = places[i, 0], places[i, 1], places[i, 2]
        outer, units, inner = places[i, 3], places[i, 4], places[i, 5]
        if dtype == _FLOAT32:
            values32 = numba.carray(_pointer_at(address, np.float32), n)
            extremes, zeros, nans, infs = _scan32(values32, flush)
            _finish_row(values32, 0, n, extremes, zeros, nans, infs, out[i])
            _count_units(values32, 0, outer, units, inner, counts[at : at + units])
        elif dtype == _FLOAT64:
            values64 = numba.carray(_pointer_at(address, np.float64), n)
            extremes, zeros, nans, infs = _scan64(values64, 0, n)
            _finish_row(values64, 0, n, extremes, zeros, nans, infs, out[i])
            _count_units(values64, 0, outer, units, inner, counts[at : at + units])
        else:
            integers = numba.carray(_pointer_at(address, np.int64), n)
            extremes, zeros, nans, infs = _scan_int64(integers)
            _finish_row(integers, 0, n, extremes, zeros, nans, infs, out[i])
            _count_units(integers, 0, outer, units, inner, counts[at : at + units])
        at += units


@_held
@no_type_check
def _one_in_place(address, n, dtype, outer, units, inner, rows, counts, cursor, flush):
    """:func:`_in_place` of one tensor, given as scalars, into the next row of ``rows`` and
    the next ``units`` of ``counts``, at ``cursor`` (a row, a count), which it moves on.
    Returns where, ``row << 32 | count``, or -1 where the blocks are too full (nothing
    read). It holds the GIL throughout, so two threads' calls never take the same place."""
    i, at = cursor[0], cursor[1]
    if i >= rows.shape[0] or at + units > counts.shape[0]:
        return -1
    cursor[0], cursor[1] = i + 1, at + units
    row, out = rows[i], counts[at : at + units]
    if dtype == _FLOAT32:
        values32 = numba.carray(_pointer_at(address, np.float32), n)
        extremes, zeros, nans, infs = _scan32(values32, flush)
        _finish_row(values32, 0, n, extremes, zeros, nans, infs, row)
        _count_units(values32, 0, outer, units, inner, out)
    elif dtype == _FLOAT64:
        values64 = numba.carray(_pointer_at(address, np.float64), n)
        extremes, zeros, nans, infs = _scan64(values64, 0, n)
        _finish_row(values64, 0, n, extremes, zeros, nans, infs, row)
        _count_units(values64, 0, outer, units, inner, out)
    else:
        integers = numba.carray(_pointer_at(address, np.int64), n)
        extremes, zeros, nans, infs = _scan_int64(integers)
        _finish_row(integers, 0, n, extremes, zeros, nans, infs, row)
        _count_units(integers, 0, outer, units, inner, out)
    return (i << 32) | at


@_part
@no_type_check
def _finish_row(values, lo, hi, extremes, zeros, nans, infs, row):
    """Fill ``row`` for ``values[lo:hi]``, given its extremes and counts: the sums as numpy
    makes them (:func:`_reduce`), NaN where numpy's would be."""
    n = hi - lo
    total, squares = _reduce_both(values, lo, hi)
    mean = total / n
    norm = np.sqrt(squares)
    std = np.sqrt(_reduce(values, lo, hi, mean, True) / n)
    smallest, largest = extremes
    if nans:  # numpy's minimum and maximum propagate NaN
        smallest = largest = std = np.nan
    elif infs:
        std = np.nan
    row[0], row[1], row[2], row[3], row[4] = mean, std, smallest, largest, norm
    row[5], row[6], row[7] = zeros, nans, infs


_FLIP64 = np.int64(0x7FFFFFFFFFFFFFFF)
_LOWEST64 = np.int64(-0x8000000000000000)
_INF64 = np.int64(0x7FF0000000000000)  # the bits of +inf; larger magnitudes are NaN


@_part
@no_type_check
def _from_key64(key):
    bits = key ^ _FLIP64 if key < 0 else key
    return np.array([bits]).view(np.float64)[0]


@_exact
@no_type_check
def _unit_counts(values, segments, out):
    at = 0
    for k in range(segments.shape[0]):
        start, outer, units, inner = segments[k, 0], segments[k, 1], segments[k, 2], segments[k, 3]
        _count_units(values, start, outer, units, inner, out[at : at + units])
        at += units


@_part
@no_type_check
def _count_units(values, start, outer, units, inner, out):
    """Positive values per unit of the (outer, units, inner) values from ``start``, added
    to ``out``."""
    for o in range(outer):
        for u in range(units):
            base = start + (o * units + u) * inner
            p = 0
            for j in range(base, base + inner):
                p += values[j] > 0
            out[u] += p


@_exact
@no_type_check
def _reduce(a, lo, hi, shift, square):
    """``np.add.reduceat``'s sum of the terms of ``a[lo:hi]``: the first term, plus the
    pairwise sum of the rest. A term is ``a[j]``, or ``(a[j] - shift) ** 2`` where
    ``square`` (rounded as numpy rounds ``d * d`` before summing it; ``a[j] - 0.0`` is
    ``a[j]``)."""
    first = _term(a[lo], shift, square)
    return first + _pairwise(a, lo + 1, hi, shift, square) if hi - lo > 1 else first


@_exact
@no_type_check
def _reduce_both(a, lo, hi):
    """``_reduce(a, lo, hi, 0.0, False)`` and ``_reduce(a, lo, hi, 0.0, True)`` in one pass
    over ``a``: the same additions in the same order, so the same sums, bit for bit."""
    w = _wide(a, lo)
    if hi - lo == 1:
        return w, w * w
    total, squares = _pairwise_both(a, lo + 1, hi)
    return w + total, w * w + squares


@_exact
@no_type_check
def _pairwise_both(a, lo, hi):
    """:func:`_pairwise` of the values and of their squares, side by side."""
    n = hi - lo
    if n < 8:
        total = squares = -0.0
        for j in range(lo, hi):
            w = _wide(a, j)
            total += w
            squares += w * w
        return total, squares
    if n <= 128:
        w0, w1, w2, w3 = _wide(a, lo), _wide(a, lo + 1), _wide(a, lo + 2), _wide(a, lo + 3)
        w4, w5, w6, w7 = _wide(a, lo + 4), _wide(a, lo + 5), _wide(a, lo + 6), _wide(a, lo + 7)
        r0, r1, r2, r3, r4, r5, r6, r7 = w0, w1, w2, w3, w4, w5, w6, w7
        q0, q1, q2, q3 = w0 * w0, w1 * w1, w2 * w2, w3 * w3
        q4, q5, q6, q7 = w4 * w4, w5 * w5, w6 * w6, w7 * w7
        end = hi - n % 8
        for j in range(lo + 8, end, 8):
            w0, w1, w2, w3 = _wide(a, j), _wide(a, j + 1), _wide(a, j + 2), _wide(a, j + 3)
            w4, w5, w6, w7 = _wide(a, j + 4), _wide(a, j + 5), _wide(a, j + 6), _wide(a, j + 7)
            r0, r1, r2, r3 = r0 + w0, r1 + w1, r2 + w2, r3 + w3
            r4, r5, r6, r7 = r4 + w4, r5 + w5, r6 + w6, r7 + w7
            q0, q1, q2, q3 = q0 + w0 * w0, q1 + w1 * w1, q2 + w2 * w2, q3 + w3 * w3
            q4, q5, q6, q7 = q4 + w4 * w4, q5 + w5 * w5, q6 + w6 * w6, q7 + w7 * w7
        total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        squares = ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))
        for j in range(end, hi):
            w = _wide(a, j)
            total += w
            squares += w * w
        return total, squares
    half = n // 2
    half -= half % 8
    t0, s0 = _pairwise_both(a, lo, lo + half)
    t1, s1 = _pairwise_both(a, lo + half, hi)
    return t0 + t1, s0 + s1


@_inline
@no_type_check
def _wide(a, j):
    return np.float64(a[j])


@_inline
@no_type_check
def _term(v, shift, square):
    w = np.float64(v)  # a float32 value is widened as it is read: the sums are float64
    if square:
        d = w - shift
        return d * d
    return w


@_exact
@no_type_check
def _pairwise(a, lo, hi, shift, square):
    """numpy's pairwise summation (``pairwise_sum`` in its loops): up to 8 terms one after
    another, up to 128 in 8 running sums, more split in two (at a multiple of 8)."""
    n = hi - lo
    if n < 8:
        total = -0.0
        for j in range(lo, hi):
            total += _term(a[j], shift, square)
        return total
    if n <= 128:
        r0, r1 = _term(a[lo], shift, square), _term(a[lo + 1], shift, square)
        r2, r3 = _term(a[lo + 2], shift, square), _term(a[lo + 3], shift, square)
        r4, r5 = _term(a[lo + 4], shift, square), _term(a[lo + 5], shift, square)
        r6, r7 = _term(a[lo + 6], shift, square), _term(a[lo + 7], shift, square)
        end = hi - n % 8
        for j in range(lo + 8, end, 8):
            r0 += _term(a[j], shift, square)
            r1 += _term(a[j + 1], shift, square)
            r2 += _term(a[j + 2], shift, square)
            r3 += _term(a[j + 3], shift, square)
            r4 += _term(a[j + 4], shift, square)
            r5 += _term(a[j + 5], shift, square)
            r6 += _term(a[j + 6], shift, square)
            r7 += _term(a[j + 7], shift, square)
        total = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
        for j in range(end, hi):
            total += _term(a[j], shift, square)
        return total
    half = n // 2
    half -= half % 8
    return _pairwise(a, lo, lo + half, shift, square) + _pairwise(a, lo + half, hi, shift, square)
