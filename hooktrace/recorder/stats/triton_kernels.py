"""The Triton kernels of :mod:`hooktrace.recorder.stats.device_kernels`, which says what they
compute and imports this module only where Triton is installed (Triton resolves a kernel's
helpers among its module's globals: they live here, at the top level)."""

# mypy: disable-error-code="no-untyped-def"
# (Triton kernels: their arguments are pointers and compile-time constants, not Python types)

from __future__ import annotations

import triton
import triton.language as tl

from hooktrace.trace import histograms

# a kernel reads a global only as a compile-time constant (Triton 3 refuses a plain int;
# its interpreter does not)
EXPONENT_MIN = tl.constexpr(histograms.EXPONENT_MIN)
MAGNITUDE_BINS = tl.constexpr(histograms.MAGNITUDE_BINS)
POS = tl.constexpr(histograms.POS)
NEG = tl.constexpr(histograms.NEG)


@triton.jit
def float32(x):
    # bfloat16 is float32's upper half: its bits moved up, exactly (subnormals too,
    # which Triton's interpreter converts wrongly)
    if x.dtype == tl.bfloat16:
        return (x.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def block_sums(x, inside):
    # one block's partial result: count, sum, centred sum of squares, sum of squares, min,
    # max, zeros, NaNs, Infs
    count = tl.sum(inside.to(tl.float32), axis=0)
    total = tl.sum(x, axis=0)
    centred = tl.where(inside, x - total / count, 0.0)
    return (
        count,
        total,
        tl.sum(centred * centred, axis=0),
        tl.sum(x * x, axis=0),
        tl.min(tl.where(inside, x, float("inf")), axis=0),
        tl.max(tl.where(inside, x, float("-inf")), axis=0),
        tl.sum((inside & (x == 0.0)).to(tl.float32), axis=0),
        tl.sum((x != x).to(tl.float32), axis=0),
        tl.sum((tl.abs(x) == float("inf")).to(tl.float32), axis=0),
    )


@triton.jit(do_not_specialize=["n"])
def partials(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = float32(tl.load(x_ptr + offsets, mask=inside, other=0.0))
    count, total, centred, squares, low, high, zeros, nans, infs = block_sums(x, inside)
    out = out_ptr + block * 9
    tl.store(out + 0, count)
    tl.store(out + 1, total)
    tl.store(out + 2, centred)
    tl.store(out + 3, squares)
    tl.store(out + 4, low)
    tl.store(out + 5, high)
    tl.store(out + 6, zeros)
    tl.store(out + 7, nans)
    tl.store(out + 8, infs)


@triton.jit(do_not_specialize=["n"])
def alone(x_ptr, row_ptr, n, BLOCK: tl.constexpr):
    # a tensor of one block, in one launch: its partial result, and the row ``combine``
    # makes of one partial result (its mean apart from the block's by exactly 0)
    offsets = tl.arange(0, BLOCK)
    inside = offsets < n
    x = float32(tl.load(x_ptr + offsets, mask=inside, other=0.0))
    count, total, centred, squares, low, high, zeros, nans, infs = block_sums(x, inside)
    size = count.to(tl.float64)
    store_row(
        row_ptr,
        total.to(tl.float64) / size,
        centred.to(tl.float64) / size,
        low.to(tl.float64),
        high.to(tl.float64),
        squares.to(tl.float64),
        zeros.to(tl.float64),
        nans.to(tl.float64),
        infs.to(tl.float64),
    )


@triton.jit(do_not_specialize=["blocks", "n"])
def combine(part_ptr, blocks, n, row_ptr, PARTS: tl.constexpr):
    # Chan's combination, in float64: the mean first, then each block's centred sum
    # of squares moved to it
    total = tl.zeros([PARTS], dtype=tl.float64)
    squares = tl.zeros([PARTS], dtype=tl.float64)
    zeros = tl.zeros([PARTS], dtype=tl.float64)
    nans = tl.zeros([PARTS], dtype=tl.float64)
    infs = tl.zeros([PARTS], dtype=tl.float64)
    lo = tl.full([PARTS], float("inf"), dtype=tl.float32)
    hi = tl.full([PARTS], float("-inf"), dtype=tl.float32)
    start = blocks * 0  # (a while loop: the interpreter's ranges take no runtime bound)
    while start < blocks:
        rows = start + tl.arange(0, PARTS)
        inside = rows < blocks
        part = part_ptr + rows.to(tl.int64) * 9
        start += PARTS
        total += tl.load(part + 1, mask=inside, other=0.0).to(tl.float64)
        squares += tl.load(part + 3, mask=inside, other=0.0).to(tl.float64)
        lo = tl.minimum(lo, tl.load(part + 4, mask=inside, other=float("inf")))
        hi = tl.maximum(hi, tl.load(part + 5, mask=inside, other=float("-inf")))
        zeros += tl.load(part + 6, mask=inside, other=0.0).to(tl.float64)
        nans += tl.load(part + 7, mask=inside, other=0.0).to(tl.float64)
        infs += tl.load(part + 8, mask=inside, other=0.0).to(tl.float64)
    count = n.to(tl.float64)
    mean = tl.sum(total, axis=0) / count
    spread = tl.zeros([PARTS], dtype=tl.float64)
    start = blocks * 0
    while start < blocks:
        rows = start + tl.arange(0, PARTS)
        inside = rows < blocks
        part = part_ptr + rows.to(tl.int64) * 9
        start += PARTS
        size = tl.load(part + 0, mask=inside, other=0.0).to(tl.float64)
        block_total = tl.load(part + 1, mask=inside, other=0.0).to(tl.float64)
        block_m2 = tl.load(part + 2, mask=inside, other=0.0).to(tl.float64)
        apart = tl.where(inside, block_total / tl.maximum(size, 1.0) - mean, 0.0)
        spread += block_m2 + size * apart * apart
    store_row(
        row_ptr,
        mean,
        tl.sum(spread, axis=0) / count,
        tl.min(lo, axis=0).to(tl.float64),
        tl.max(hi, axis=0).to(tl.float64),
        tl.sum(squares, axis=0),
        tl.sum(zeros, axis=0),
        tl.sum(nans, axis=0),
        tl.sum(infs, axis=0),
    )


@triton.jit
def store_row(row_ptr, mean, variance, low, high, squares, zeros, nans, infs):
    # the row, in float64: a NaN makes the extremes NaN (the mean and std are NaN already)
    any_nan = nans > 0
    tl.store(row_ptr + 0, mean)
    tl.store(row_ptr + 1, tl.sqrt(variance))
    tl.store(row_ptr + 2, tl.where(any_nan, float("nan"), low))
    tl.store(row_ptr + 3, tl.where(any_nan, float("nan"), high))
    tl.store(row_ptr + 4, tl.sqrt(squares))
    tl.store(row_ptr + 5, zeros)
    tl.store(row_ptr + 6, nans)
    tl.store(row_ptr + 7, infs)


@triton.jit(do_not_specialize=["n"])
def bins(x_ptr, counts_ptr, n, BLOCK: tl.constexpr, BINS: tl.constexpr, ALONE: tl.constexpr):
    # ALONE: the tensor is this one block, which writes every count (nothing to add to)
    block = tl.program_id(0).to(tl.int64)
    offsets = block * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    x = float32(tl.load(x_ptr + offsets, mask=inside, other=0.0))
    magnitude = tl.abs(x)
    subnormal = magnitude < 1.1754943508222875e-38  # below 2^-126: scaled by 2^64 first
    scaled = tl.where(subnormal, magnitude * 18446744073709551616.0, magnitude)
    exponent = ((scaled.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exponent = tl.where(subnormal, exponent - 64, exponent)
    place = tl.minimum(tl.maximum(exponent - EXPONENT_MIN + 1, 0), MAGNITUDE_BINS - 1)
    bin = tl.where(x > 0, POS + place, NEG + place)
    bin = tl.where(x == 0.0, 0, bin)  # ZERO
    bin = tl.where(x != x, 1, bin)  # NAN
    bin = tl.where(x == float("inf"), 2, bin)  # POS_INF
    bin = tl.where(x == float("-inf"), 3, bin)  # NEG_INF
    bin = tl.where(inside, bin, BINS - 1)  # past WIDTH: not returned
    counted = tl.histogram(bin, BINS)
    if ALONE:
        tl.store(counts_ptr + tl.arange(0, BINS), counted.to(tl.int64))
    else:  # (most of a block's bins are empty: no atomic for them)
        tl.atomic_add(counts_ptr + tl.arange(0, BINS), counted.to(tl.int64), mask=counted != 0)
