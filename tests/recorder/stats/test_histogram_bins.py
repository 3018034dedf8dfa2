"""Exponent histograms (hooktrace.recorder.stats.histogram) against bins worked out by hand, and
against the numpy definition (hooktrace.trace.histograms.reference) on tensors of every
dtype, layout and size the recorder meets; on both CPU routes: the compiled kernels, once
numba is loaded, and numpy on the same bits before that or without numba; and the torch
route that other devices take."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hooktrace.recorder.records.staging import Staging
from hooktrace.recorder.stats import histogram_kernel, numba_kernels
from hooktrace.recorder.stats.histogram import histogram, histogram_many, histogram_staged
from hooktrace.recorder.stats.stats import route
from hooktrace.recorder.stats.torch_route import histogram_torch
from hooktrace.trace.histograms import (
    MAGNITUDE_BINS,
    NAN,
    NEG,
    NEG_INF,
    POS,
    POS_INF,
    WIDTH,
    ZERO,
    reference,
)

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
INTEGERS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)

# sizes on both sides of the kernel's thresholds: one counter or four, one thread or several
SIZES = sorted(
    {0, 1, 7}
    | {histogram_kernel._LANES_FROM + d for d in (-1, 0, 1)}
    | {histogram_kernel._THREADS_FROM + d for d in (-1, 0, 3)}
)


@pytest.fixture(params=["compiled", "numpy"])
def on_route(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each test runs on both CPU routes. ``compiled``: numba is loaded, as once the recorder
    summarised a large CPU tensor (the test set-up installs numba: a broken kernel must fail
    here, not hide behind the other route). ``numpy``: as before that, or without numba."""
    if request.param == "compiled":
        assert route().one_pass is not None, route().description
        assert numba_kernels.histograms() is histogram_kernel
    else:
        monkeypatch.setattr(numba_kernels, "histograms", lambda: None)
    yield request.param


def all_three(tensor: torch.Tensor) -> list[np.ndarray]:
    """The histogram of ``tensor`` by each function: histogram, histogram_many (among other
    tensors, and its row), histogram_staged (its float64 copy staged between two others)."""
    one = histogram(tensor)
    assert isinstance(one, np.ndarray)
    others = [torch.full((3,), 2.0), torch.zeros(0)]
    rows = histogram_many([others[0], tensor, others[1]])
    assert rows.shape == (3, WIDTH) and rows.dtype == np.int64
    staging = Staging()
    before = staging.add(others[0])
    position = staging.add(tensor)
    after = staging.add(torch.tensor([-1.0, float("nan")]))
    staged = histogram_staged(staging.values(), staging.bounds(), [after, position, before])
    assert staged.shape == (3, WIDTH) and staged.dtype == np.int64
    assert staged[0].tolist() == _at({NEG + 150: 1, NAN: 1})  # -1.0 and NaN
    assert staged[2].tolist() == rows[0].tolist() == _at({POS + 151: 3})  # 2.0 three times
    assert rows[2].tolist() == [0] * WIDTH
    return [np.asarray(one), rows[1], staged[1]]


def _at(counts: dict[int, int]) -> list[int]:
    """A flat histogram with ``counts`` at the given places, zeros elsewhere."""
    flat = [0] * WIDTH
    for place, count in counts.items():
        flat[place] += count
    return flat


def _bits(pattern: int, dtype: torch.dtype) -> torch.Tensor:
    """A one-value tensor of ``dtype`` whose bits are ``pattern`` (NaN payloads and all)."""
    signed = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
    width = torch.finfo(dtype).bits
    if pattern >= 1 << (width - 1):  # the sign bit set: as the signed integer of those bits
        pattern -= 1 << width
    return torch.tensor([pattern], dtype=signed[dtype]).view(dtype)


# (value, dtype, its place in the flat vector), worked out by hand from the bins' definition
# (docs/FORMAT.md: pos[k] holds 2^(k-150) <= |x| < 2^(k-149), k = 1..277; 0 below; 278 above)
HAND: list[tuple[float | torch.Tensor, torch.dtype, int]] = [
    (1.0, torch.float32, POS + 150),  # [2^0, 2^1)
    (1.5, torch.float32, POS + 150),
    (1.9999999, torch.float32, POS + 150),
    (2.0, torch.float32, POS + 151),
    (0.75, torch.float32, POS + 149),  # [2^-1, 2^0)
    (-3.0, torch.float32, NEG + 151),  # [2^1, 2^2)
    (-0.5, torch.float64, NEG + 149),
    (65504.0, torch.float16, POS + 165),  # float16's largest: 2^15 * (2 - 2^-10)
    (65504.0, torch.float32, POS + 165),
    (2.0**-149, torch.float32, POS + 1),  # float32's smallest subnormal
    (2.0**-127, torch.float32, POS + 23),  # a subnormal: mantissa 0x400000
    (2.0**-126 - 2.0**-149, torch.float32, POS + 23),  # the largest subnormal
    (-(2.0**-140), torch.float32, NEG + 10),
    (2.0**-126, torch.float32, POS + 24),  # float32's smallest normal
    (3.4028234663852886e38, torch.float32, POS + 277),  # float32's largest: [2^127, 2^128)
    (-3.4028234663852886e38, torch.float32, NEG + 277),
    (2.0**-24, torch.float16, POS + 126),  # float16's smallest subnormal
    (2.0**-14 - 2.0**-24, torch.float16, POS + 135),  # its largest subnormal
    (-(2.0**-20), torch.float16, NEG + 130),
    (2.0**-14, torch.float16, POS + 136),  # its smallest normal
    (2.0**-24, torch.float32, POS + 126),
    (2.0**-133, torch.bfloat16, POS + 17),  # bfloat16's smallest subnormal
    (2.0**-126, torch.bfloat16, POS + 24),
    (-(2.0**100), torch.bfloat16, NEG + 250),
    (1e-300, torch.float64, POS + 0),  # below 2^-149: only float64 gets there
    (-1e-300, torch.float64, NEG + 0),
    (5e-324, torch.float64, POS + 0),  # float64's smallest subnormal
    (2.0**-150, torch.float64, POS + 0),
    (2.0**-149, torch.float64, POS + 1),
    (2.0**127, torch.float64, POS + 277),
    (2.0**128 - 2.0**75, torch.float64, POS + 277),  # the largest float64 below 2^128
    (2.0**128, torch.float64, POS + 278),  # at or above 2^128, finite
    (1e300, torch.float64, POS + 278),
    (-1e300, torch.float64, NEG + 278),
    (3.0, torch.int64, POS + 151),
    (-1.0, torch.int32, NEG + 150),
    (2.0**60, torch.int64, POS + 210),
    (255.0, torch.uint8, POS + 157),  # [2^7, 2^8)
    (1.0, torch.bool, POS + 150),
    (0.0, torch.bool, ZERO),
    (0.0, torch.int8, ZERO),
]
for _dtype in FLOATS:
    HAND += [
        (0.0, _dtype, ZERO),
        (-0.0, _dtype, ZERO),  # -0.0 is a zero, not a negative value
        (math.inf, _dtype, POS_INF),
        (-math.inf, _dtype, NEG_INF),
        (math.nan, _dtype, NAN),
        (-math.nan, _dtype, NAN),
    ]
# NaN payloads: quiet and signalling, either sign; the smallest and largest payloads
HAND += [
    (_bits(p, torch.float32), torch.float32, NAN)
    for p in (0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFC00001, 0xFFFFFFFF)
]
HAND += [(_bits(p, torch.float16), torch.float16, NAN) for p in (0x7C01, 0x7E00, 0xFFFF, 0xFC01)]
HAND += [(_bits(p, torch.bfloat16), torch.bfloat16, NAN) for p in (0x7F81, 0xFFC0, 0xFFFF)]
HAND += [
    (torch.tensor([p], dtype=torch.int64).view(torch.float64), torch.float64, NAN)
    for p in (0x7FF0000000000001, 0x7FF8000000000000, -1, -0x000FFFFFFFFFFFFF)
]


@pytest.mark.parametrize(("value", "dtype", "place"), HAND, ids=lambda v: str(v))
def test_a_value_falls_in_the_bin_worked_out_by_hand(
    on_route: str, value: float | torch.Tensor, dtype: torch.dtype, place: int
) -> None:
    tensor = value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=dtype)
    assert tensor.dtype == dtype
    for name, got in zip(("histogram", "many", "staged"), all_three(tensor), strict=True):
        assert got.tolist() == _at({place: 1}), name
    four = tensor.repeat(histogram_kernel._LANES_FROM + 3)  # counted in four counters
    assert histogram_many([four])[0].tolist() == _at({place: four.numel()})


def test_the_bins_agree_with_the_reference_on_the_hand_values() -> None:
    """The hand-worked places are the reference's too: it is the definition the random
    tensors below are checked against."""
    for value, dtype, place in HAND:
        tensor = value if isinstance(value, torch.Tensor) else torch.tensor([value], dtype=dtype)
        assert reference(tensor.double().numpy()).tolist() == _at({place: 1}), (value, dtype)


def spread(n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``n`` values of ``dtype`` over its whole range: random bits (every exponent field,
    subnormals, NaN payloads and infinities of both signs), with zeros of both signs, and for
    float64 as many values again within float32's exponents (random bits seldom fall there)."""
    if dtype == torch.float64:
        bits = torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.int64, generator=generator)
        x = bits.view(torch.float64).clone()
        exponent = torch.randint(-152, 131, (n,), generator=generator)
        mantissa = torch.rand(n, dtype=torch.float64, generator=generator) + 0.5
        within = torch.ldexp(mantissa, exponent) * (torch.rand(n, generator=generator) - 0.5).sign()
        half = torch.rand(n, generator=generator) < 0.5
        x[half] = within[half].double()
    else:
        signed = torch.int16 if torch.finfo(dtype).bits == 16 else torch.int32
        info = torch.iinfo(signed)
        bits = torch.randint(info.min, info.max, (n,), dtype=signed, generator=generator)
        x = bits.view(dtype).clone()
    pick = torch.rand(n, generator=generator)
    x[pick < 0.05] = 0.0
    x[(pick >= 0.05) & (pick < 0.08)] = -0.0
    return x


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_random_tensors_of_every_float_dtype_match_the_reference(
    on_route: str, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(24)
    for n in SIZES:
        x = spread(n, dtype, generator)
        want = reference(x.double().numpy())
        assert want.sum() == n
        for name, got in zip(("histogram", "many", "staged"), all_three(x), strict=True):
            assert got.tolist() == want.tolist(), (name, n)


def views(x: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """Views of ``x`` (1-d, of 24 * k values) as the recorder may meet them: a transposed or
    permuted one (their values lie one after another, in another order), slices with gaps,
    a broadcast, a negated view."""
    k = x.numel() // 24
    grid = x.view(4, 6 * k)
    yield "transposed", grid.t()
    yield "permuted", x.view(2, 3, 4 * k).permute(2, 0, 1)
    yield "every other column", grid[:, ::2]
    yield "a row from the middle", grid[1:3]
    yield "a column", grid[:, 1]
    yield "broadcast", x[: 6 * k].view(1, 6 * k).expand(3, 6 * k)
    yield "negated view", torch._neg_view(grid)
    yield "a size-one dimension", x.view(1, 24 * k, 1)[:, :, 0]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_views_are_histograms_of_the_values_they_show(on_route: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(7)
    for n in (24, 24 * 400):  # one counter, and four
        x = spread(n, dtype, generator)
        for name, view in views(x):
            want = reference(view.resolve_neg().contiguous().double().numpy())
            assert want.sum() == view.numel()
            for function, got in zip(("histogram", "many", "staged"), all_three(view), strict=True):
                assert got.tolist() == want.tolist(), (name, function, n)


def test_dense_views_are_read_in_place_and_others_copied() -> None:
    """A transposed or permuted tensor's values fill a block of memory, in another order,
    which a histogram does not mind: the kernel reads them there, as it reads a contiguous
    tensor. A slice with gaps, a broadcast, a negated view or an integer tensor is copied."""
    x = torch.randn(4, 6, 5)
    for dense in (x, x.transpose(0, 2), x.permute(1, 2, 0), x[1], torch.nn.Parameter(x)):
        assert histogram_kernel._readable(dense)[0] is dense
    for other in (x[:, ::2], x[0].expand(3, 6, 5), torch._neg_view(x), x.to(torch.int32)):
        copy, _ = histogram_kernel._readable(other)
        assert copy is not other and copy.is_contiguous()


@pytest.mark.parametrize("dtype", INTEGERS, ids=str)
def test_integer_and_bool_tensors_are_binned_as_their_float64_values(
    on_route: str, dtype: torch.dtype
) -> None:
    generator = torch.Generator().manual_seed(3)
    for n in (9, histogram_kernel._LANES_FROM + 1):
        if dtype == torch.bool:
            x = torch.rand(n, generator=generator) < 0.5
        else:
            info = torch.iinfo(dtype)
            x = torch.randint(info.min, info.max, (n,), dtype=dtype, generator=generator)
            x[:3] = torch.tensor([info.min, info.max, 0], dtype=dtype)
            shifts = torch.randint(0, info.bits - 1, (n // 2,), dtype=dtype, generator=generator)
            x[3 : 3 + n // 2] >>= shifts  # every magnitude, not only the largest
        want = reference(x.numpy())
        assert want.sum() == n
        for name, got in zip(("histogram", "many", "staged"), all_three(x), strict=True):
            assert got.tolist() == want.tolist(), (name, n)


def test_empty_lists_and_empty_tensors(on_route: str) -> None:
    assert histogram_many([]).shape == (0, WIDTH)
    assert histogram_staged(np.zeros(0), np.zeros(1, dtype=np.int64), []).shape == (0, WIDTH)
    for dtype in (*FLOATS, torch.int64):
        for empty in (torch.zeros(0, dtype=dtype), torch.zeros(3, 0, dtype=dtype)):
            assert histogram(empty).tolist() == [0] * WIDTH
            assert histogram_many([empty, empty]).tolist() == [[0] * WIDTH] * 2


def test_histogram_many_takes_cpu_tensors_only(on_route: str) -> None:
    with pytest.raises(ValueError, match=r"use histogram\(\)"):
        histogram_many([torch.zeros(2, device="meta")])


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_denormals_flushed_to_zero_count_as_zeros_where_the_reference_sees_zeros(
    on_route: str, dtype: torch.dtype
) -> None:
    """``torch.set_flush_denormal(True)`` makes this thread's CPU read float32 and float64
    subnormals as zero: every comparison, the reference's included, and the staged copy of
    a float32 tensor. The histograms count them as zeros then too (float16's subnormals are
    float32 normals: they keep their bins)."""
    x = spread(4 * 400, dtype, torch.Generator().manual_seed(5))
    if dtype == torch.float64:
        x[:200] = torch.ldexp(torch.rand(200, dtype=torch.float64), torch.tensor(-1030))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        want = reference(x.double().numpy())
        got = all_three(x)
    finally:
        torch.set_flush_denormal(False)
    unflushed = reference(x.double().numpy())
    if dtype != torch.float16:
        assert want[ZERO] > unflushed[ZERO]  # there were subnormals to flush
    for name, counts in zip(("histogram", "many", "staged"), got, strict=True):
        assert counts.tolist() == want.tolist(), name


def test_counts_add_up_and_the_layout_is_the_contract() -> None:
    assert WIDTH == 4 + 2 * MAGNITUDE_BINS == 562
    x = torch.tensor([0.0, -0.0, math.nan, math.inf, -math.inf, 1.0, -1.0, 1e-45])
    assert histogram(x).tolist() == _at(
        {ZERO: 2, NAN: 1, POS_INF: 1, NEG_INF: 1, POS + 150: 1, NEG + 150: 1, POS + 1: 1}
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=True, allow_subnormal=True), max_size=700),
    st.sampled_from(FLOATS),
)
def test_any_float32_values(values: list[float], dtype: torch.dtype) -> None:
    """Property: on the compiled route, for any values (hypothesis's edge cases: subnormals,
    the extremes, infinities, NaN, -0.0), cast to any float dtype, the three functions give
    the reference's counts, which add up to the number of values."""
    assert route().one_pass is not None
    x = torch.tensor(values, dtype=torch.float32).to(dtype)
    want = reference(x.double().numpy())
    assert want.sum() == len(values)
    for got in all_three(x):
        assert got.tolist() == want.tolist()


def _routes_agree(make: Callable[[], list[torch.Tensor]], monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = make()
    assert route().one_pass is not None
    by_kernel = histogram_many(tensors)
    monkeypatch.setattr(numba_kernels, "histograms", lambda: None)
    assert histogram_many(tensors).tolist() == by_kernel.tolist()


@pytest.mark.parametrize("dtype", FLOATS + INTEGERS, ids=str)
def test_the_torch_route_of_other_devices_matches_the_reference(dtype: torch.dtype) -> None:
    """The route of tensors on an accelerator (frexp and where, queued there), checked on
    the CPU, where it runs too: the same counts."""
    generator = torch.Generator().manual_seed(11)
    for n in (0, 9, 1000):
        if dtype in FLOATS:
            x = spread(n, dtype, generator)
        else:
            x = torch.randint(-100, 100, (n,), generator=generator).to(dtype)
        want = reference(x.double().numpy() if dtype in FLOATS else x.numpy())
        got = histogram_torch(x.t() if x.dim() == 2 else x)
        assert isinstance(got, np.ndarray) and got.tolist() == want.tolist(), n


def test_the_torch_route_bins_a_large_tensor_a_chunk_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: binning took some ten int64 tensors the size of the input, 10 GB of
    a GPU's memory for a 1 GB gradient. Chunks bound it; the counts are the chunks' sum."""
    from hooktrace.recorder.stats import torch_route as module

    monkeypatch.setattr(module, "TORCH_CHUNK", 7)
    x = spread(100, torch.float32, torch.Generator().manual_seed(3))
    assert histogram_torch(x).tolist() == reference(x.double().numpy()).tolist()
    seen: list[int] = []
    bins = module._bins
    monkeypatch.setattr(module, "_bins", lambda chunk: seen.append(chunk.numel()) or bins(chunk))
    histogram_torch(x)
    assert max(seen) == 7 and sum(seen) == 100


def test_the_two_routes_agree_on_a_models_parameters_and_gradients(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def parameters_and_gradients() -> list[torch.Tensor]:
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.LazyLinear(4)
        )
        model(torch.randn(2, 3, 10, 10)).relu().sum().backward()
        return [p for p in model.parameters()] + [p.grad for p in model.parameters()]  # type: ignore[misc]

    _routes_agree(parameters_and_gradients, monkeypatch)


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.dictionaries(st.integers(0, WIDTH - 1), st.integers(1, 2**40), max_size=12),
        max_size=9,
    ),
    st.data(),
)
def test_the_compiled_spans_are_the_writers_columns(
    occupied: list[dict[int, int]], data: st.DataObject
) -> None:
    """Property: the histogram table's columns that the writer thread makes in one compiled
    pass (``span_columns``, reading each histogram where it lies, in any order) are the ones
    numpy makes from the same rows (``histograms.columns``): empty rows, a bin at either
    end, every bin."""
    from hooktrace.trace.histograms import columns

    assert route().one_pass is not None
    rows = np.zeros((len(occupied) + 2, WIDTH), dtype=np.int64)
    for row, bins in zip(rows, occupied, strict=False):
        for at, count in bins.items():
            row[at] = count
    rows[-2, POS : POS + MAGNITUDE_BINS] = 1  # every bin of one sign
    rows[-1, [POS, NEG + MAGNITUDE_BINS - 1]] = 3  # the two far ends
    order = data.draw(st.permutations(range(len(rows))))
    addresses = rows.ctypes.data + np.array(order, dtype=np.int64) * rows.strides[0]
    got = histogram_kernel.span_columns(addresses)
    want = columns(rows[order])
    assert got.keys() == want.keys()
    for name, column in want.items():
        if isinstance(column, np.ndarray):
            assert got[name].dtype == column.dtype and got[name].tolist() == column.tolist()
        else:
            assert got[name].equals(column), name


def test_histograms_cut_to_their_spans_where_they_are_counted_are_the_reference() -> None:
    """A kind's parameters (or gradients), read in place and cut to their spans by the
    kernel as each is counted (``histograms_at``): every dtype, sizes on both sides of
    the kernel's thresholds, an all-zero tensor (empty spans); the whole rows they stand for
    are the reference's, and so are any rows picked from them (a step cut by a signal)."""
    assert route().one_pass is not None
    generator = torch.Generator().manual_seed(5)
    tensors = [
        spread(n, dtype, generator)
        for dtype in FLOATS
        for n in SIZES
        if 0 < n < histogram_kernel._THREADS_FROM
    ]
    tensors.append(torch.zeros(9))
    places = np.array(
        [(t.data_ptr(), t.numel(), histogram_kernel.CODES[t.dtype], 0) for t in tensors],
        dtype=np.int64,
    )
    spans = histogram_kernel.histograms_at(places)
    want = np.stack([reference(t.double().numpy()) for t in tensors])
    assert spans.rows().tolist() == want.tolist()
    picked = np.arange(len(tensors)) % 3 == 1
    assert spans[picked].rows().tolist() == want[picked].tolist()
    assert len(spans[np.zeros(len(tensors), dtype=bool)]) == 0
