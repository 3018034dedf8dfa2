"""One pass over a CPU tensor's values for all of its statistics, compiled by numba.

torch computes each statistic with its own vectorised pass: min and max, the sum, the sum of
squares, the zero count and the per-unit positive counts are four or five passes over every
activation and gradient. The kernel here makes one: each value is read once, and the sums,
extremes and counts are kept in vector registers. On one thread it takes 0.18 to 0.28 of the
time torch's passes take on both cores (``benchmarks/bench_stats_kernels.py``).

Extremes are taken on integer keys: a float32's bits, with the magnitude bits flipped for
negative values, order the same way as the floats do, and integer minimum and maximum
vectorise where a float minimum (which must mind NaN) does not. Keys beyond those of the
infinities are NaN; keys equal to them are infinities. Such tensors are left to the eager
route, which counts them (:func:`one_pass` returns None).

Sums are float32 within a block of ``_BLOCK`` values, then float64 across blocks. Where the
sums come from matters to their last bits, so the choice of route never depends on timing:
a tensor takes the kernel whenever numba is installed and the tensor is a contiguous float32
CPU tensor with finite values (:func:`hooktrace.recorder.stats.summarize_with_activity`).

Large tensors are read by several threads: torch's own OpenMP threads, which otherwise spin
between torch's operators (:mod:`hooktrace.recorder.omp`). The chunks a tensor is cut into
depend on its shape alone, each is summed apart, and the chunks are added in order by the same
code on one thread or on several, so the results do not depend on how many threads ran (a
test checks it bit for bit, on values of magnitudes far apart).

The same module holds the writer's kernels for small tensors (:func:`summarize_segments`,
:func:`unit_counts`): a step's staged values, all of its tensors in one call, with the very
sums numpy's reductions make, bit for bit. (One difference: where a tensor's smallest or
largest value is a zero of both signs, they order -0.0 before 0.0; numpy returns either.)

This module imports numba; :mod:`hooktrace.recorder.stats` imports it on first use only.
"""

from __future__ import annotations

import functools
import math
from typing import Any, no_type_check

import numba
import numpy as np
import torch
from numba import types
from numba.extending import intrinsic

from hooktrace.recorder import omp

_BLOCK = 512
"""Values summed in float32 before the sum is added to the float64 total. Each vector lane
adds 32 to 64 of them one after another: at 4,096 the mean of a constant 0.1 was off by
2.4e-6 (torch's 1.5e-7), at 512 by 3e-7, for 7% more time."""

_CHUNK = 64 * _BLOCK
"""Values in a chunk, about (whole rows or blocks: the last chunk of a tensor holds what is
left): the kernel sums each chunk apart, and threads take whole chunks."""

_MOST_CHUNKS = 16
"""Chunks in a tensor, at most: each keeps counts of its own per unit (or per column), and a
tensor of many units (a language model's logits) would otherwise keep more counts than it
has values."""

_LEAST_ROWS = 8
"""Rows in a chunk counted per column, at least: its counts are then at most an eighth of its
values, however wide the rows."""

_THREADS_FROM = 1 << 17
"""Values from which a tensor is read by several threads (:mod:`hooktrace.recorder.omp`):
below, starting them costs more than they save."""

_KEY_POS_INF = 0x7F800000  # key of +inf; greater keys are NaN
_KEY_NEG_INF = -0x7F800001  # key of -inf; smaller keys are NaN with the sign bit set


def one_pass(
    x: torch.Tensor, dim: int | None
) -> tuple[float, float, float, float, int, np.ndarray | None] | None:
    """Sum, sum of squares, min, max and zero count of ``x``, and the count of positive
    values per unit along ``dim`` (int64; None where ``dim`` is None).

    ``x`` is a contiguous float32 CPU tensor with fewer than 2**31 values (the caller checks).
    None where ``x`` holds a NaN or an infinity.
    """
    outer, units, inner, fold, columns = _plan(x.shape, dim)
    values = x.detach().numpy().ravel()
    threads = omp.threads() if values.size >= _THREADS_FROM else 1
    if threads > 1:
        sums = omp.run(_one_pass_threads, threads, values, outer, units, inner, fold, columns)
    else:
        sums = _one_pass(values, outer, units, inner, fold, columns)
    finite, total, squares, lo, hi, zeros, counts = sums
    if not finite:
        return None
    return total, squares, lo, hi, zeros, counts if dim is not None else None


@functools.lru_cache(maxsize=1024)
def _plan(shape: tuple[int, ...], dim: int | None) -> tuple[int, int, int, int, bool]:
    """How the kernel takes a tensor of ``shape``, counting units along ``dim``: as (outer,
    units, inner) values around the unit dimension, ``fold`` rows at a time, per column or
    per row. Remembered: the same shapes come back every step."""
    if dim is None:
        return 1, 1, _prod(shape), 1, False
    outer, units, inner = _prod(shape[:dim]), shape[dim], _prod(shape[dim + 1 :])
    # short runs per unit (inner < half a block): count per column, then per unit;
    # long runs: count per (outer, unit) row
    columns = inner < _BLOCK // 2
    return outer, units, inner, _fold(outer, units * inner) if columns else 1, columns


def _fold(rows: int, width: int) -> int:
    """How many rows of ``width`` values to take as one, for rows of a block's length or
    less: the kernel's loop ends at every row, and rows of 10 or 128 values (a classifier's
    logits, a transformer's features) would spend more time ending loops than summing.
    The largest divisor of ``rows`` that keeps the folded row within a block."""
    limit, best = max(_BLOCK // width, 1), 1
    for d in range(1, math.isqrt(rows) + 1):
        if rows % d == 0:
            best = max([best] + [f for f in (d, rows // d) if f <= limit])
    return best


def _prod(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def summarize_segments(values: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """:func:`hooktrace.recorder.stats.summarize_staged` in one compiled call: the rows are
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


def summarize_in_place(
    tensor: torch.Tensor, dim: int | None
) -> tuple[np.ndarray, np.ndarray | None] | None:
    """:func:`summarize_tensors` of one tensor, with :func:`unit_counts` along ``dim`` (None:
    no counts): what the writer makes of the tensor staged, without staging it. None if the
    tensor cannot be read in place."""
    address = _address(tensor)
    if not address:
        return None
    shape = tensor.shape
    outer, units, inner = (0, 0, 0) if dim is None else _plan(tuple(shape), dim)[:3]
    counts = np.zeros(units, dtype=np.int64)
    row = np.empty((1, 8), dtype=np.float64)
    place = np.array(
        [(address, tensor.numel(), _IN_PLACE[tensor.dtype], outer, units, inner)], dtype=np.int64
    )
    _in_place(place, row, counts, _flushes_denormals())
    return row[0], counts if dim is not None else None


def _address(t: torch.Tensor) -> int:
    """Where ``t``'s values lie, if they are ``numel()`` values of a dtype read in place
    (``_IN_PLACE``) one after the other: a plain contiguous CPU tensor with values, not a
    view that negates its memory (``is_neg``), and with memory of its own (a functional
    tensor has none: 0). Else 0."""
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
_FLOAT32, _FLOAT64, _INT64 = 0, 1, 2
_IN_PLACE = {torch.float32: _FLOAT32, torch.float64: _FLOAT64, torch.int64: _INT64}
"""The dtypes read in place, and how the kernel names them. Others (half precision, bool,
smaller integers) are rare in parameters and buffers, and staged."""
_NO_COUNTS = np.zeros(0, dtype=np.int64)
_DENORMAL32 = np.float32(1e-40)
_SMALLEST_NORMAL32 = np.int32(0x00800000)  # the bits of float32's smallest normal value


def _flushes_denormals() -> bool:
    """Whether this thread's CPU treats denormal floats as zero (``torch.set_flush_denormal``
    sets it per thread): numpy's scalar comparison runs on the CPU's own flags."""
    return bool(_DENORMAL32 == 0)


def warm_up() -> str | None:
    """Compile the kernels now (or load them from numba's cache), not at their first use,
    and start numba's threads. None if large tensors may be read on torch's threads, else
    why they are read on one (:func:`hooktrace.recorder.omp.join`)."""
    one = np.zeros(1, dtype=np.float32)
    _one_pass(one, 1, 1, 1, 1, False)
    summarize_segments(np.zeros(1), np.array([0, 1], dtype=np.int64))
    unit_counts(np.zeros(1), np.array([[0, 1, 1, 1]], dtype=np.int64))
    summarize_tensors([torch.zeros(1)])  # one kernel for every dtype read in place
    return omp.join(lambda: _one_pass_threads(one, 1, 1, 1, 1, False))


# The kernels are numba code: plain loops over blocks of values, which numba compiles for
# this CPU and vectorises. Each returns (sum, sum of squares, smallest key, largest key,
# zero count). Reassociating the sums lets them vectorise; no option assumes finite values
# (nnan, ninf): an infinite sum of squares stays infinite, as on the eager route.
_jit = numba.njit(nogil=True, cache=True, fastmath={"reassoc", "contract"}, boundscheck=False)
_inline = numba.njit(inline="always", fastmath={"reassoc", "contract"}, boundscheck=False)

# Integer arithmetic in numba widens to int64 unless cast back: the keys and counts below are
# cast to int32 at each step, which keeps 16 of them to a 512-bit vector instead of 8 (the
# kernel then reads twice as many values per instruction).
_I32 = np.int32
_FLIP = _I32(0x7FFFFFFF)  # the magnitude bits; also the largest key
_LOWEST = _I32(-0x80000000)  # the smallest key
_SIGN = _I32(31)  # shifting a key by this fills it with its sign bit


@_inline
@no_type_check
def _chunked(values, outer, units, inner, fold, columns):
    """:func:`one_pass` on ``values`` (float32, flat, C order, seen as (outer, units, inner)):
    (finite, sum, sum of squares, min, max, zero count, positive counts per unit).

    The values are taken in chunks of about ``_CHUNK`` values, fixed by the shape alone; each
    chunk's sums are kept apart and added in chunk order, so the result is the same whether
    the chunks ran one after another or on several threads (``prange``)."""
    # no np.zeros here: in the threaded kernel each would be a parallel loop of its own
    counts = np.empty(units, dtype=np.int64)
    for u in range(units):
        counts[u] = 0
    if columns:
        width = fold * units * inner
        rows = outer // fold
        x = values.reshape(rows, width)
        per = _chunk_length(rows, max(_CHUNK // width, _LEAST_ROWS))
        chunks = (rows + per - 1) // per
        part = np.empty((chunks, 5), dtype=np.float64)
        per_column = np.empty((chunks, width), dtype=np.int32)
        for c in numba.prange(chunks):
            for i in range(width):
                per_column[c, i] = 0
            stop = min(rows, (c + 1) * per)
            s, q, k_lo, k_hi, z = _columns(x[c * per : stop], per_column[c])
            part[c, 0], part[c, 1], part[c, 2], part[c, 3], part[c, 4] = s, q, k_lo, k_hi, z
        for c in range(1, chunks):  # the chunks' counts into the first, row by row
            for i in range(width):
                per_column[0, i] += per_column[c, i]
        for f in range(fold):
            for u in range(units):
                start = (f * units + u) * inner
                for i in range(start, start + inner):
                    counts[u] += per_column[0, i]
    else:
        x = values.reshape(outer * units, inner)
        per_row = (inner + _BLOCK - 1) // _BLOCK
        blocks = outer * units * per_row
        per = _chunk_length(blocks, _CHUNK // _BLOCK)
        chunks = (blocks + per - 1) // per
        part = np.empty((chunks, 5), dtype=np.float64)
        per_unit = np.empty((chunks, units), dtype=np.int64)
        for c in numba.prange(chunks):
            for u in range(units):
                per_unit[c, u] = 0
            stop = min(blocks, (c + 1) * per)
            s, q, k_lo, k_hi, z = _rows(x, units, per_row, c * per, stop, per_unit[c])
            part[c, 0], part[c, 1], part[c, 2], part[c, 3], part[c, 4] = s, q, k_lo, k_hi, z
        for c in range(chunks):
            for u in range(units):
                counts[u] += per_unit[c, u]
    total, squares, lo, hi, zeros = 0.0, 0.0, _FLIP, _LOWEST, 0
    for c in range(chunks):
        total += part[c, 0]
        squares += part[c, 1]
        lo, hi = min(lo, _I32(part[c, 2])), max(hi, _I32(part[c, 3]))
        zeros += np.int64(part[c, 4])
    finite = lo > _KEY_NEG_INF and hi < _KEY_POS_INF
    return finite, total, squares, _float_of(lo), _float_of(hi), zeros, counts


@_inline
@no_type_check
def _chunk_length(items, least):
    """Rows or blocks in a chunk: ``least`` or more, and no more than ``_MOST_CHUNKS``
    chunks."""
    return max(least, (items + _MOST_CHUNKS - 1) // _MOST_CHUNKS, 1)


@_jit
@no_type_check
def _one_pass(values, outer, units, inner, fold, columns):
    return _chunked(values, outer, units, inner, fold, columns)


@numba.njit(
    nogil=True, cache=True, parallel=True, fastmath={"reassoc", "contract"}, boundscheck=False
)
@no_type_check
def _one_pass_threads(values, outer, units, inner, fold, columns):
    return _chunked(values, outer, units, inner, fold, columns)


@_inline
@no_type_check
def _float_of(key):
    """The float32 whose key (:func:`_key`) is ``key``."""
    bits = key ^ _FLIP if key < 0 else key
    return np.array([bits], dtype=np.int32).view(np.float32)[0]


@_jit
@no_type_check
def _rows(x, units, per_row, first, stop, counts):
    """Blocks ``first`` to ``stop`` of x, float32 (rows, inner), C order, each row cut into
    ``per_row`` blocks; row r is unit ``r % units``. counts: int64 (units,), positives added."""
    keys = x.view(np.int32)
    total, squares, lo, hi, zeros = 0.0, 0.0, _FLIP, _LOWEST, 0
    for b in range(first, stop):
        r = b // per_row
        start = (b - r * per_row) * _BLOCK
        stop_ = start + _BLOCK
        s, q, k_lo, k_hi, z, p = _block(x[r, start:stop_], keys[r, start:stop_])
        total += s
        squares += q
        lo, hi = min(lo, k_lo), max(hi, k_hi)
        zeros += z
        counts[r % units] += p
    return total, squares, lo, hi, zeros


@_jit
@no_type_check
def _columns(x, counts):
    """x: float32 (outer, m), C order; counts: int32 (m,), positives per column added."""
    keys = x.view(np.int32)
    outer, m = x.shape
    total, squares, lo, hi, zeros = 0.0, 0.0, _FLIP, _LOWEST, 0
    for o in range(outer):
        for start in range(0, m, _BLOCK):
            stop = start + _BLOCK
            s, q, k_lo, k_hi, z = _block_columns(
                x[o, start:stop], keys[o, start:stop], counts[start:stop]
            )
            total += s
            squares += q
            lo, hi = min(lo, k_lo), max(hi, k_hi)
            zeros += z
    return total, squares, lo, hi, zeros


@_inline
@no_type_check
def _block(values, keys):
    """One block's sums (float32), extreme keys, zero count and positive count."""
    s, q, k_lo, k_hi, z, p = np.float32(0), np.float32(0), _FLIP, _LOWEST, _I32(0), _I32(0)
    for i in range(values.size):
        v = values[i]
        s += v
        q += v * v
        k = _key(keys[i])
        k_lo, k_hi = min(k_lo, k), max(k_hi, k)
        z = _I32(z + (v == 0))
        p = _I32(p + (v > 0))
    return s, q, k_lo, k_hi, z, p


@_inline
@no_type_check
def _block_columns(values, keys, counts):
    """As :func:`_block`, counting positives per value's column instead."""
    s, q, k_lo, k_hi, z = np.float32(0), np.float32(0), _FLIP, _LOWEST, _I32(0)
    for i in range(values.size):
        v = values[i]
        s += v
        q += v * v
        k = _key(keys[i])
        k_lo, k_hi = min(k_lo, k), max(k_hi, k)
        z = _I32(z + (v == 0))
        counts[i] = _I32(counts[i] + (v > 0))
    return s, q, k_lo, k_hi, z


@_inline
@no_type_check
def _key(bits):
    """A float32's bits as an int32 that orders as the float does: negative values have
    their magnitude bits flipped."""
    return _I32(bits ^ ((bits >> _SIGN) & _FLIP))


# The writer's kernels, for the staged values of small tensors (float64). Their results must
# equal numpy's (``stats.summarize_staged``), so they do what numpy does in the order numpy
# does it: no fastmath, and numpy's pairwise summation (:func:`_pairwise`).
_exact = numba.njit(nogil=True, cache=True, boundscheck=False)


@_exact
@no_type_check
def _segments(values, bounds, out):
    """One row per segment: mean, std (two passes), min, max, norm, zeros, NaNs, infinities."""
    for i in range(len(bounds) - 1):
        lo, hi = bounds[i], bounds[i + 1]
        extremes, zeros, nans, infs = _scan64(values, lo, hi)
        _finish_row(values, lo, hi, extremes, zeros, nans, infs, out[i])


@_inline
@no_type_check
def _scan64(values, lo, hi):
    """Extremes and counts of float64 ``values[lo:hi]``, taken on the values' bits, as
    integers (as :func:`_rows` does for float32): integer comparisons vectorise where float
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


@_inline
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


@_inline
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


@_inline
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


@intrinsic
def _pointer_at(typingctx: Any, address: Any, dtype: Any) -> Any:
    """A pointer to values of ``dtype`` (a numpy scalar type) at the integer ``address``
    (numba has no cast for it)."""
    signature = types.CPointer(dtype.dtype)(types.int64, dtype)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


_FLIP64 = np.int64(0x7FFFFFFFFFFFFFFF)
_LOWEST64 = np.int64(-0x8000000000000000)
_INF64 = np.int64(0x7FF0000000000000)  # the bits of +inf; larger magnitudes are NaN


@_inline
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


@_inline
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
