"""Histograms over the fixed exponent bins, compiled by numba: one pass over the values' bits.

Each value is looked up in its format's table by the bits above its mantissa and counted
where the table says (:mod:`hooktrace.recorder.stats.histogram_bits`): no float arithmetic, and no
branch, ``counters[table[bits >> mantissa bits]] += 1``. The four extra counters (an exponent
field of zeros or of ones, by sign) are sorted out afterwards, only where they counted
anything: zeros and infinities by a second pass, a comparison, which vectorises; subnormals
by a third, which runs only where a tensor has some.

Float32, float64, float16 and bfloat16 tensors are read where they lie, a list of them in
one call. The staged float64 copies of small tensors are read from the staging buffer, all
of a step's in one call. For the writer thread, :func:`span_columns` turns a step's
histograms into the histogram table's columns in one pass that lets go of the interpreter.

This module imports numba: :mod:`hooktrace.recorder.stats.histogram` imports it only once the
recorder has loaded numba for its statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import no_type_check

import numba
import numpy as np
import pyarrow as pa
import torch
from numba.cpython.unsafe.numbers import leading_zeros

from hooktrace.recorder.stats import histogram_bits, omp
from hooktrace.recorder.stats.histogram_bits import COUNTERS, HIGH, LOW
from hooktrace.recorder.stats.kernel import _pointer_at
from hooktrace.trace.histograms import (
    MAGNITUDE_BINS,
    NAN,
    NEG,
    NEG_INF,
    POS,
    POS_INF,
    SPAN_HEAD,
    WIDTH,
    ZERO,
    Spans,
)

FLOAT32, FLOAT64, FLOAT16, BFLOAT16 = 0, 1, 2, 3
"""How the kernels name the dtypes they read."""

_CODES = {
    torch.float32: FLOAT32,
    torch.float64: FLOAT64,
    torch.float16: FLOAT16,
    torch.bfloat16: BFLOAT16,
}
CODES = _CODES
_PLAIN = (torch.Tensor, torch.nn.Parameter)


SPAN_VALUES = SPAN_HEAD + 2 * MAGNITUDE_BINS
"""int64 values a histogram may take as :class:`Spans`: its head and both whole spans."""


def _empty(values: int) -> np.ndarray:
    return np.empty(values, dtype=np.int64)


_THREADS_FROM = 1 << 17
"""Values from which a tensor is read by several threads, torch's OpenMP threads
(:mod:`hooktrace.recorder.stats.omp`), as the statistics kernel does."""


def histogram_tensors(tensors: list[torch.Tensor]) -> np.ndarray:
    """:func:`hooktrace.recorder.stats.histogram.histogram_many` of CPU tensors: (len, ``WIDTH``)
    int64. The tensors the kernel can read in place are read there (:func:`_readable`); the
    others are copied first."""
    out = np.zeros((len(tensors), WIDTH), dtype=np.int64)
    readable = [_readable(t) for t in tensors]  # the copies live until the kernel has run
    flush = histogram_bits.flushes_denormals()
    threads = omp.threads()
    places = []
    for i, (t, address) in enumerate(readable):
        n = t.numel()
        if n == 0:
            continue
        if threads > 1 and n >= _THREADS_FROM:
            code = _CODES[t.dtype]
            omp.run(_in_place_threads, threads, address, n, code, threads, out[i], flush)
        else:
            places.append((address, n, _CODES[t.dtype], i))
    if places:
        _in_place(np.array(places, dtype=np.int64), out, flush)
    return out


class TensorsInPlace:
    """:func:`histogram_tensors` of the same tensors step after step (a kind's parameters,
    their gradients): where each lies (and how many values it holds) is read every step,
    and the places are built again when that changed. Any tensor not read in place by one
    thread sends the whole list to :func:`histogram_tensors`."""

    def __init__(self) -> None:
        # what the places were built for, and the places: one tuple, replaced whole
        self._built: tuple[list[int], list[int], np.ndarray] = ([], [], np.zeros((0, 4)))

    def histograms(
        self, tensors: list[torch.Tensor], buffer: Callable[[int], np.ndarray] = _empty
    ) -> Spans | np.ndarray:
        """The tensors' histograms as :class:`Spans` (rows of ``WIDTH`` where one of them is
        not read in place). ``buffer(k)``: where the spans go, ``k`` int64 values or more."""
        try:
            addresses = [
                t.data_ptr()
                if type(t) in _PLAIN
                and t.dtype in _CODES
                and t.is_cpu
                and t.layout is torch.strided
                and t.is_contiguous()
                and not t.is_neg()
                and 0 < t.numel() < _THREADS_FROM
                else 0
                for t in tensors
            ]
        except RuntimeError:  # a tensor with no storage to read
            return histogram_tensors(tensors)
        if not all(addresses):
            return histogram_tensors(tensors)
        sizes = [t.numel() for t in tensors]
        built = self._built
        if addresses != built[0] or sizes != built[1]:
            places = np.array(
                [
                    (a, n, _CODES[t.dtype], i)
                    for i, (a, n, t) in enumerate(zip(addresses, sizes, tensors, strict=True))
                ],
                dtype=np.int64,
            ).reshape(-1, 4)
            built = self._built = (addresses, sizes, places)
        return histograms_at(built[2], buffer)


def histograms_at(places: np.ndarray, buffer: Callable[[int], np.ndarray] = _empty) -> Spans:
    """The histograms of tensors a caller found in place (plain contiguous CPU tensors of a
    dtype :data:`CODES` names, none a negative view, each with 1 to ``_THREADS_FROM - 1``
    values), a row of ``places`` each, in order: (address, values, dtype code, -). Each is
    counted where it is hot in the cache and cut to its spans there (:class:`Spans`), so
    that a step's whole rows (4.5 kB a histogram) are neither zeroed, written nor read
    again. ``buffer(k)``: where they go, ``k`` int64 values or more."""
    n = len(places)
    out = buffer(n * SPAN_VALUES)
    head = out[: n * SPAN_HEAD].reshape(n, SPAN_HEAD)
    pos = out[n * SPAN_HEAD : n * (SPAN_HEAD + MAGNITUDE_BINS)]
    neg = out[n * (SPAN_HEAD + MAGNITUDE_BINS) : n * SPAN_VALUES]
    used = _spans_in_place(places, head, pos, neg, histogram_bits.flushes_denormals())
    return Spans(head, pos[: used[0]], neg[: used[1]])


def histogram_segments(values: np.ndarray, bounds: np.ndarray, positions: list[int]) -> np.ndarray:
    """:func:`hooktrace.recorder.stats.histogram.histogram_staged` in one compiled call."""
    out = np.zeros((len(positions), WIDTH), dtype=np.int64)
    if positions:
        at = np.asarray(positions, dtype=np.int64)
        bounds = np.asarray(bounds, dtype=np.int64)
        _staged(
            np.ascontiguousarray(values, dtype=np.float64),
            bounds,
            at,
            out,
            histogram_bits.flushes_denormals(),
        )
    return out


def span_columns(rows: np.ndarray) -> dict[str, np.ndarray | pa.Array]:
    """:func:`hooktrace.trace.histograms.columns` of histograms that lie anywhere: ``rows``
    holds the address of each one's ``WIDTH`` int64 counts, in the order of the table's rows
    (the caller keeps them alive through the call). One compiled pass, which lets go of the
    interpreter's lock: the writer thread does this every step, and the numpy route's
    dozen passes over a step's counts held the lock the training's hooks wait for."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    counts, pos_start, pos_offsets, pos, neg_start, neg_offsets, neg = _spans(rows)
    return {
        "zero": counts[ZERO],
        "nan": counts[NAN],
        "pos_inf": counts[POS_INF],
        "neg_inf": counts[NEG_INF],
        "pos_start": pos_start,
        "pos": pa.ListArray.from_arrays(pa.array(pos_offsets), pa.array(pos)),
        "neg_start": neg_start,
        "neg": pa.ListArray.from_arrays(pa.array(neg_offsets), pa.array(neg)),
    }


def warm_up() -> None:
    """Compile the kernels (or load them from numba's cache)."""
    histogram_tensors([torch.zeros(1, device="cpu")])  # one kernel for every dtype
    histogram_segments(np.zeros(1), np.array([0, 1], dtype=np.int64), [0])
    span_columns(np.zeros(0, dtype=np.int64))
    one = torch.zeros(1, device="cpu")  # (whatever the script's default device: read by address)
    histograms_at(np.array([[one.data_ptr(), 1, FLOAT32, 0]], dtype=np.int64))
    # the threaded kernel wherever numba's threads started (omp.join), whatever torch's
    # count is now (it may grow later in the run); compiled on a team of one, which waits for
    # no thread (a forked child's team may lack them)
    if omp.started() > 1:
        row = np.zeros(WIDTH, dtype=np.int64)
        one = torch.zeros(1, device="cpu")
        omp.run(_in_place_threads, 1, one.data_ptr(), 1, FLOAT32, 1, row, False)


def _readable(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` and where its values lie, if the kernel can read it there, else a copy it can
    read and where that lies: values of a dtype it reads (``_CODES``; others as float64, as
    the reference takes them) that fill ``numel()`` places in memory one after another, in
    any order (:func:`_dense`)."""
    if (
        type(t) in _PLAIN
        and t.dtype in _CODES
        and t.layout is torch.strided
        and _dense(t)
        and not t.is_neg()
    ):
        try:
            return t, t.data_ptr()
        except RuntimeError:  # no storage to read (a functional tensor)
            pass
    source = t.detach()
    if source.layout is not torch.strided:
        source = source.to_dense()
    copy = torch.empty(source.shape, dtype=t.dtype if t.dtype in _CODES else torch.float64)
    copy.copy_(source)
    return copy, copy.data_ptr()


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s values lie one after the other from ``data_ptr()``, in some order:
    contiguous, transposed, permuted. A histogram does not depend on the order."""
    if t.is_contiguous():
        return True
    expected = 1
    for stride, size in sorted(
        (st, sz) for sz, st in zip(t.shape, t.stride(), strict=True) if sz != 1
    ):
        if stride != expected:
            return False
        expected *= size
    return True


_LANES = 4
"""Copies of the counters, value ``j`` counted in copy ``j % _LANES``. An increment waits
for the one before it to the same counter; with one copy, a tensor whose values share a few
bins (zeros, a constant, most tensors) waits on nearly every value: 2.2 ns a value where all
are 1.0, 0.6 with four copies (more cost more again)."""

_LANES_FROM = 512
"""Values from which the copies are used: adding them up costs about as much as counting
that many values in one."""


# the formats' tables and subnormal bins, as globals: numba compiles them in as constants
_TABLE32 = histogram_bits.FLOAT32.table  # bfloat16's too
_TABLE64 = histogram_bits.FLOAT64.table
_TABLE16 = histogram_bits.FLOAT16.table
_SUBNORMAL32 = histogram_bits.FLOAT32.subnormal
_SUBNORMAL16 = histogram_bits.FLOAT16.subnormal
_SUBNORMAL_BF16 = histogram_bits.BFLOAT16.subnormal

_inline = numba.njit(inline="always", boundscheck=False)
_jit = numba.njit(nogil=True, cache=True, boundscheck=False)


@_inline
@no_type_check
def _histogram(
    bits, mantissa, table, sign, infinity, subnormal, flushed, flush, row, counters
):  # fmt: skip
    """Add the histogram of ``bits`` (unsigned integers: floats' bits) to ``row`` (``WIDTH``
    int64), as :func:`hooktrace.recorder.stats.histogram_bits.counts` does; the other arguments
    but ``flush`` are a ``histogram_bits.Format``'s. ``counters``: int64 (``_LANES``,
    ``COUNTERS``), zeros on entry and on return."""
    n = bits.size
    if n < _LANES_FROM:
        for j in range(n):
            counters[0, table[bits[j] >> mantissa]] += 1
    else:
        end = n - n % _LANES
        for j in range(0, end, _LANES):
            for lane in range(_LANES):
                counters[lane, table[bits[j + lane] >> mantissa]] += 1
        for j in range(end, n):
            counters[0, table[bits[j] >> mantissa]] += 1
        for lane in range(1, _LANES):
            for s in range(COUNTERS):
                counters[0, s] += counters[lane, s]
                counters[lane, s] = 0
    counts = counters[0]
    low = counts[LOW] + counts[LOW + 1]
    if low:
        if flush and flushed:
            counts[ZERO] += low
        else:
            zeros, negative_zeros = _count_two(bits, bits.dtype.type(0), sign)
            counts[ZERO] += zeros + negative_zeros
            rest, negative_rest = counts[LOW] - zeros, counts[LOW + 1] - negative_zeros
            if subnormal < 0:
                counts[POS] += rest
                counts[NEG] += negative_rest
            elif rest + negative_rest:
                _subnormals(bits, mantissa, sign, subnormal, counts)
    high = counts[HIGH] + counts[HIGH + 1]
    if high:
        infinities, negative_infinities = _count_two(bits, infinity, sign | infinity)
        counts[POS_INF] += infinities
        counts[NEG_INF] += negative_infinities
        counts[NAN] += high - infinities - negative_infinities
    for s in range(WIDTH):
        row[s] += counts[s]
    for s in range(COUNTERS):
        counts[s] = 0


@_inline
@no_type_check
def _count_two(bits, a, b):
    """How many of ``bits`` equal ``a``, and how many ``b``."""
    n_a = n_b = 0
    for j in range(bits.size):
        n_a += bits[j] == a
        n_b += bits[j] == b
    return n_a, n_b


@_inline
@no_type_check
def _subnormals(bits, mantissa, sign, subnormal, counters):
    """Count the subnormals of ``bits`` in their bins, by the bit length of their mantissa."""
    below = bits.dtype.type(1) << mantissa  # the bits of the smallest normal value
    magnitude_bits = sign - bits.dtype.type(1)
    for j in range(bits.size):
        magnitude = bits[j] & magnitude_bits
        if magnitude != 0 and magnitude < below:
            length = 64 - leading_zeros(np.uint64(magnitude))
            counters[(NEG if bits[j] & sign else POS) + length + subnormal] += 1


# One function per dtype, the dtype's constants written in: numba inlines _histogram into
# each and the compiler folds them in.
@_inline
@no_type_check
def _float32(bits, flush, row, counters):
    _histogram(
        bits, np.uint32(23), _TABLE32, np.uint32(0x80000000), np.uint32(0x7F800000),
        _SUBNORMAL32, True, flush, row, counters,
    )  # fmt: skip


@_inline
@no_type_check
def _float64(bits, flush, row, counters):
    _histogram(
        bits, np.uint64(52), _TABLE64, np.uint64(0x8000000000000000),
        np.uint64(0x7FF0000000000000), -1, True, flush, row, counters,
    )  # fmt: skip


@_inline
@no_type_check
def _float16(bits, flush, row, counters):
    _histogram(
        bits, np.uint16(10), _TABLE16, np.uint16(0x8000), np.uint16(0x7C00),
        _SUBNORMAL16, False, flush, row, counters,
    )  # fmt: skip


@_inline
@no_type_check
def _bfloat16(bits, flush, row, counters):
    _histogram(
        bits, np.uint16(7), _TABLE32, np.uint16(0x8000), np.uint16(0x7F80),
        _SUBNORMAL_BF16, True, flush, row, counters,
    )  # fmt: skip


@_jit
@no_type_check
def _tensor(address, n, dtype, lo, hi, flush, row, counters):
    """Add the histogram of values ``lo`` to ``hi`` of a tensor of ``n`` values of ``dtype``
    at ``address`` to ``row``."""
    if dtype == FLOAT32:
        _float32(numba.carray(_pointer_at(address, np.uint32), n)[lo:hi], flush, row, counters)
    elif dtype == FLOAT64:
        _float64(numba.carray(_pointer_at(address, np.uint64), n)[lo:hi], flush, row, counters)
    elif dtype == FLOAT16:
        _float16(numba.carray(_pointer_at(address, np.uint16), n)[lo:hi], flush, row, counters)
    else:
        _bfloat16(numba.carray(_pointer_at(address, np.uint16), n)[lo:hi], flush, row, counters)


@_jit
@no_type_check
def _in_place(places, out, flush):
    """Tensor ``k`` is ``places[k, 1]`` values of dtype ``places[k, 2]`` (``FLOAT32``, ...)
    from address ``places[k, 0]``; its histogram is added to ``out[places[k, 3]]`` (int64,
    ``WIDTH``)."""
    counters = np.zeros((_LANES, COUNTERS), dtype=np.int64)
    for k in range(places.shape[0]):
        address, n, dtype, i = places[k, 0], places[k, 1], places[k, 2], places[k, 3]
        _tensor(address, n, dtype, 0, n, flush, out[i], counters)


@numba.njit(nogil=True, cache=True, parallel=True, boundscheck=False)
@no_type_check
def _in_place_threads(address, n, dtype, parts, row, flush):
    """:func:`_in_place` of one tensor, cut into ``parts`` counted on threads of their own."""
    per = (n + parts - 1) // parts
    rows = np.empty((parts, WIDTH), dtype=np.int64)
    for part in numba.prange(parts):
        # no np.zeros here: each would be a parallel loop of its own
        counters = np.empty((_LANES, COUNTERS), dtype=np.int64)
        for lane in range(_LANES):
            for s in range(COUNTERS):
                counters[lane, s] = 0
        for s in range(WIDTH):
            rows[part, s] = 0
        lo = part * per
        _tensor(address, n, dtype, lo, min(n, lo + per), flush, rows[part], counters)
    for part in range(parts):
        for s in range(WIDTH):
            row[s] += rows[part, s]


@_jit
@no_type_check
def _staged(values, bounds, positions, out, flush):
    """``out[i]`` (int64, ``WIDTH``) += the histogram of ``values[bounds[p]:bounds[p + 1]]``,
    ``p = positions[i]``; ``values`` float64."""
    bits = values.view(np.uint64)
    counters = np.zeros((_LANES, COUNTERS), dtype=np.int64)
    for i in range(positions.size):
        p = positions[i]
        _float64(bits[bounds[p] : bounds[p + 1]], flush, out[i], counters)


@_inline
@no_type_check
def _ends(row, lo):
    """The occupied span of ``row[lo:lo + MAGNITUDE_BINS]``: (first, end) within it, (0, 0)
    where every bin is empty."""
    first = 0
    while first < MAGNITUDE_BINS and row[lo + first] == 0:
        first += 1
    if first == MAGNITUDE_BINS:
        return 0, 0
    end = MAGNITUDE_BINS
    while row[lo + end - 1] == 0:
        end -= 1
    return first, end


@_jit
@no_type_check
def _spans(rows):
    """The histogram table's columns of the histograms whose counts lie at ``rows``
    (addresses): the four counts (int64, ``counts[ZERO]``: each histogram's zeros, ...),
    and each sign's span starts (int16), offsets (int32) and values (int64)."""
    n = rows.size
    counts = np.empty((4, n), dtype=np.int64)
    pos_start = np.empty(n, dtype=np.int16)
    neg_start = np.empty(n, dtype=np.int16)
    pos_offsets = np.zeros(n + 1, dtype=np.int32)
    neg_offsets = np.zeros(n + 1, dtype=np.int32)
    for i in range(n):
        row = numba.carray(_pointer_at(rows[i], np.int64), WIDTH)
        for s in range(4):
            counts[s, i] = row[s]
        first, end = _ends(row, POS)
        pos_start[i] = first
        pos_offsets[i + 1] = pos_offsets[i] + end - first
        first, end = _ends(row, NEG)
        neg_start[i] = first
        neg_offsets[i + 1] = neg_offsets[i] + end - first
    pos = np.empty(pos_offsets[n], dtype=np.int64)
    neg = np.empty(neg_offsets[n], dtype=np.int64)
    for i in range(n):
        row = numba.carray(_pointer_at(rows[i], np.int64), WIDTH)
        at = pos_offsets[i]
        for k in range(pos_offsets[i + 1] - at):
            pos[at + k] = row[POS + pos_start[i] + k]
        at = neg_offsets[i]
        for k in range(neg_offsets[i + 1] - at):
            neg[at + k] = row[NEG + neg_start[i] + k]
    return counts, pos_start, pos_offsets, pos, neg_start, neg_offsets, neg


@_jit
@no_type_check
def _spans_in_place(places, head, pos, neg, flush):
    """:func:`_in_place` of each tensor of ``places`` in turn into one row of counts, hot in
    the cache, then cut to its spans: its head into ``head[k]`` (``SPAN_HEAD``), its
    spans after the last one's in ``pos`` and ``neg``. Returns how much of each it took."""
    counters = np.zeros((_LANES, COUNTERS), dtype=np.int64)
    row = np.zeros(WIDTH, dtype=np.int64)
    pos_at = neg_at = 0
    for k in range(places.shape[0]):
        _tensor(places[k, 0], places[k, 1], places[k, 2], 0, places[k, 1], flush, row, counters)
        for s in range(4):
            head[k, s] = row[s]
        first, end = _ends(row, POS)
        head[k, 4], head[k, 5] = first, end - first
        for b in range(first, end):
            pos[pos_at] = row[POS + b]
            pos_at += 1
        first, end = _ends(row, NEG)
        head[k, 6], head[k, 7] = first, end - first
        for b in range(first, end):
            neg[neg_at] = row[NEG + b]
            neg_at += 1
        for s in range(WIDTH):
            row[s] = 0
    return pos_at, neg_at
