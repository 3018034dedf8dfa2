"""Where a float's bits put it in the histogram, and the counting done on bits with numpy.

A normal float's bin is a function of its sign bit and its exponent field alone, the bits
above its mantissa: ``bits >> mantissa bits``, looked up in a table (:func:`_table`), names
its place in the flat histogram vector. The two exponent fields that are not one exponent
go to four counters after the histogram's own, one per sign, sorted out afterwards:

* an exponent field of zeros: zeros and subnormals. float64's subnormals (below 2^-1022) all
  lie in bin 0; float32's, bfloat16's and float16's lie in the bin of their mantissa's bit
  length (``Format.subnormal``).
* an exponent field of ones: the infinities, and NaN, the rest.

The compiled kernels (:mod:`hooktrace.recorder.stats.histogram_kernel`) count with these tables;
:func:`counts` does the same with numpy, in a few whole-array passes, for when numba is not
loaded (as fast as the kernel's Python overhead for a tensor of a few thousand values, and
20 times slower than it on large ones, yet 5 to 10 times faster than torch's frexp route).

``flush``: the calling thread treats denormal floats as zero (``torch.set_flush_denormal``),
so every comparison and widening it makes sees a float32 or float64 subnormal (a bfloat16
one is a float32 one) as zero, the reference's included; the counts then hold them as zeros
too. float16's subnormals are float32 normals: they keep their bins.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from hooktrace.trace.histograms import (
    EXPONENT_MIN,
    MAGNITUDE_BINS,
    NAN,
    NEG,
    NEG_INF,
    POS,
    POS_INF,
    WIDTH,
    ZERO,
)

LOW = WIDTH  # (and WIDTH + 1, negative): an exponent field of zeros, zero or subnormal
HIGH = WIDTH + 2  # (and WIDTH + 3): an exponent field of ones, an infinity or NaN
COUNTERS = WIDTH + 4


def _table(exponent_bits: int, bias: int) -> np.ndarray:
    """Where a value goes, by its sign bit and exponent field (``bits >> mantissa bits``)."""
    fields = 1 << exponent_bits
    table = np.empty(2 * fields, dtype=np.int16)
    for negative in (0, 1):
        for field in range(fields):
            if field == 0:
                slot = LOW + negative
            elif field == fields - 1:
                slot = HIGH + negative
            else:  # floor(log2|x|) = field - bias, clipped to the end bins (float64's)
                magnitude = min(max(field - bias - EXPONENT_MIN + 1, 0), MAGNITUDE_BINS - 1)
                slot = (NEG if negative else POS) + magnitude
            table[negative * fields + field] = slot
    return table


def _subnormal_bin(bias: int, mantissa: int) -> int:
    """A subnormal is m * 2^(1 - bias - mantissa), m its mantissa bits: floor(log2|x|) is
    bit_length(m) - 1 + (1 - bias - mantissa), in bin bit_length(m) + this."""
    return (1 - bias - mantissa) - 1 - EXPONENT_MIN + 1


class Format(NamedTuple):
    """A float format's bits: its ``mantissa`` bits, ``table``, ``sign`` bit and the bits of
    ``infinity``; ``subnormal``: the bin of a subnormal of bit length 0 (-1: float64's, all
    in bin 0); ``flushed``: whether its subnormals read as zero where denormals are
    flushed; ``bits``: the unsigned integer of its width."""

    mantissa: int
    table: np.ndarray
    sign: int
    infinity: int
    subnormal: int
    flushed: bool
    bits: type[np.unsignedinteger]


FLOAT32 = Format(23, _table(8, 127), 1 << 31, 0x7F800000, _subnormal_bin(127, 23), True, np.uint32)
FLOAT64 = Format(52, _table(11, 1023), 1 << 63, 0x7FF << 52, -1, True, np.uint64)
FLOAT16 = Format(10, _table(5, 15), 1 << 15, 0x7C00, _subnormal_bin(15, 10), False, np.uint16)
BFLOAT16 = Format(7, FLOAT32.table, 1 << 15, 0x7F80, _subnormal_bin(127, 7), True, np.uint16)
"""bfloat16's bits are a float32's upper half: float32's table, its subnormals in the bins
of float32's whose mantissa is theirs followed by 16 zeros."""

_DENORMAL32 = np.float32(1e-40)


def flushes_denormals() -> bool:
    """Whether this thread's CPU treats denormal floats as zero (``torch.set_flush_denormal``
    sets it per thread): numpy's scalar comparison runs on the CPU's own flags."""
    return bool(_DENORMAL32 == 0)


def counts(bits: np.ndarray, form: Format, flush: bool) -> np.ndarray:
    """The histogram (``WIDTH`` int64) of the floats of ``form`` whose bits are ``bits``
    (1-d, ``form.bits``), with numpy: the table's counters, then the four extra ones sorted
    out where they counted anything."""
    by_field = np.bincount((bits >> form.mantissa).astype(np.intp), minlength=len(form.table))
    found = np.zeros(COUNTERS, dtype=np.int64)
    np.add.at(found, form.table, by_field)
    row = found[:WIDTH]
    low = found[LOW] + found[LOW + 1]
    if low and flush and form.flushed:
        row[ZERO] += low
    elif low:
        zeros = np.count_nonzero(bits == 0)
        negative_zeros = np.count_nonzero(bits == form.sign)
        row[ZERO] += zeros + negative_zeros
        if form.subnormal < 0:
            row[POS] += found[LOW] - zeros
            row[NEG] += found[LOW + 1] - negative_zeros
        elif low > zeros + negative_zeros:
            magnitude = bits & form.bits(form.sign - 1)
            subnormal = bits[(magnitude != 0) & (magnitude < form.bits(1 << form.mantissa))]
            # |m| < 2^23 as float64 is exact: frexp's exponent is its bit length
            _, length = np.frexp((subnormal & form.bits(form.sign - 1)).astype(np.float64))
            places = np.where(subnormal & form.bits(form.sign), NEG, POS) + length
            row += np.bincount(places + form.subnormal, minlength=WIDTH)
    high = found[HIGH] + found[HIGH + 1]
    if high:
        infinities = np.count_nonzero(bits == form.infinity)
        negative_infinities = np.count_nonzero(bits == (form.sign | form.infinity))
        row[POS_INF] += infinities
        row[NEG_INF] += negative_infinities
        row[NAN] += high - infinities - negative_infinities
    return row
