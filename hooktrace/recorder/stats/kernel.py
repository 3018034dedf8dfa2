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
sums come from matters to their last bits: a tensor takes the kernel whenever it is loaded
and the tensor is a contiguous float32 CPU tensor with finite values
(:func:`hooktrace.recorder.stats.stats.summarize_with_activity`). It is loaded from numba's cache
before the first large tensor, or, where the cache lacked it, once a process of its own has
compiled it (:mod:`hooktrace.recorder.stats.kernel_cache`): then, and only then, the route changes
mid-run, and the statistics on either side agree to float32 rounding.

Large tensors are read by several threads: torch's own OpenMP threads, which otherwise spin
between torch's operators (:mod:`hooktrace.recorder.stats.omp`). The chunks a tensor is cut into
depend on its shape alone, each is summed apart, and the chunks are added in order by the same
code on one thread or on several, so the results do not depend on how many threads ran (a
test checks it bit for bit, on values of magnitudes far apart).

This module imports numba; :mod:`hooktrace.recorder.stats.stats` imports it on first use only.
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

from hooktrace.recorder.stats import omp

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
"""Values from which a tensor is read by several threads (:mod:`hooktrace.recorder.stats.omp`):
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
    # the kernels read x where it lies, by address (x stays alive meanwhile): no numpy view
    # to make (host.as_numpy, some microseconds a call), nor to pin x's storage (numpy())
    at, n = x.data_ptr(), x.numel()
    threads = omp.threads() if n >= _THREADS_FROM else 1
    if threads > 1:
        sums = omp.run(_one_pass_threads, threads, at, n, outer, units, inner, fold, columns)
    else:
        sums = _one_pass(at, n, outer, units, inner, fold, columns)
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


def warm_up() -> str | None:
    """Compile the kernels now (or load them from numba's cache), not at their first use,
    and start numba's threads. None if large tensors may be read on torch's threads, else
    why they are read on one (:func:`hooktrace.recorder.stats.omp.join`)."""
    one = np.zeros(1, dtype=np.float32)
    at = one.ctypes.data
    _one_pass(at, 1, 1, 1, 1, 1, False)
    return omp.join(lambda: _one_pass_threads(at, 1, 1, 1, 1, 1, False))


@intrinsic
def _pointer_at(typingctx: Any, address: Any, dtype: Any) -> Any:
    """A pointer to values of ``dtype`` (a numpy scalar type) at the integer ``address``
    (numba has no cast for it)."""
    signature = types.CPointer(dtype.dtype)(types.int64, dtype)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

    return signature, codegen


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
def _one_pass(at, n, outer, units, inner, fold, columns):
    """:func:`_chunked` of the ``n`` float32 values at address ``at``."""
    values = numba.carray(_pointer_at(at, np.float32), n)
    return _chunked(values, outer, units, inner, fold, columns)


@numba.njit(
    nogil=True, cache=True, parallel=True, fastmath={"reassoc", "contract"}, boundscheck=False
)
@no_type_check
def _one_pass_threads(at, n, outer, units, inner, fold, columns):
    """:func:`_one_pass`, its chunks on several threads."""
    values = numba.carray(_pointer_at(at, np.float32), n)
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
