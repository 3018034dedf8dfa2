"""The one-pass kernel (hooktrace.recorder.stats.kernel) against numpy in float64, and its place in
the recorder: which tensors take it, what falls back to the eager route, what a trace says."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

import hooktrace
from hooktrace.recorder.stats import stats as stats_module
from hooktrace.recorder.stats.kernel import one_pass
from hooktrace.recorder.stats.stats import (
    Route,
    _in_memory_order,
    activity,
    route,
    route_taken,
    summarize,
    summarize_with_activity,
    unit_dim,
)


def _reference(x: np.ndarray, dim: int | None) -> tuple[list[float], np.ndarray | None]:
    """Statistics and per-unit positive counts computed by numpy in float64."""
    x64 = x.astype(np.float64)
    stats = [
        x64.mean(),
        x64.std(),
        x64.min(),
        x64.max(),
        np.sqrt((x64 * x64).sum()),
        float((x64 == 0).sum()),
        0.0,
        0.0,
    ]
    if dim is None:
        return stats, None
    others = tuple(d for d in range(x.ndim) if d != dim)
    return stats, (x64 > 0).sum(axis=others)


def _check(tensor: torch.Tensor, dim: int | None, *, kernel: bool = True) -> None:
    """summarize_with_activity against numpy; ``kernel``: and the one-pass kernel took it."""
    if kernel:  # else a broken kernel could hide behind the eager route's right answers
        one_pass = route().one_pass
        assert one_pass is not None
        assert one_pass(*_in_memory_order(tensor.float(), dim)) is not None
    stats, counts = summarize_with_activity(tensor, dim)
    got = np.asarray(stats)
    want, want_counts = _reference(tensor.float().numpy(), dim)
    scale = float(np.abs(tensor.float().numpy()).max()) or 1.0
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6, atol=1e-7 * scale)  # mean
    # std: of a constant, the two-pass std is the mean's own error, 1e-7 to 1e-6 of it
    np.testing.assert_allclose(got[1], want[1], rtol=1e-4, atol=1e-6 * scale)
    assert got[2] == want[2] and got[3] == want[3]  # extremes are exact
    np.testing.assert_allclose(got[4], want[4], rtol=1e-6)  # norm
    assert list(got[5:]) == want[5:]  # zeros, NaN, Inf: exact
    if dim is None:
        assert counts is None
    else:
        assert counts is not None and counts.tolist() == want_counts.tolist()


def test_the_kernel_is_what_large_cpu_tensors_take_here() -> None:
    # the test set-up installs numba: a broken kernel must fail here, not pass by falling back
    taken = route()
    assert taken.one_pass is not None, taken.description
    assert taken.description.startswith("one-pass (numba ")
    assert route_taken() is taken


@pytest.mark.parametrize(
    ("shape", "dim"),
    [
        ((32, 16, 32, 32), 1),  # conv activation: per-column counting
        ((4, 8, 130, 130), 1),  # long rows (8 x 16,900 > 65,536): counted per row, 5 blocks
        ((16, 64, 128), 2),  # (batch, time, features): units last
        ((16, 12, 700), 1),  # Conv1d-shaped, channels first
        ((700, 33), 1),  # rows folded 100 at a time
        ((16, 64, 10), 2),  # a classifier's logits: 1,024 rows of 10, folded 256 at a time
        ((1009, 10), 1),  # a prime number of rows: none folded
        ((9000,), 0),  # a unit per value
        ((3, 70000), None),  # no units: one row of many blocks
        ((5, 4097), None),  # a block and one value
    ],
)
def test_one_pass_matches_numpy(shape: tuple[int, ...], dim: int | None) -> None:
    torch.manual_seed(0)
    x = torch.randn(shape)
    _check(x, dim)
    _check(torch.relu(x), dim)  # many exact zeros
    _check(-torch.relu(x) - 1.0, dim)  # negative only: keys of negative floats


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(lambda x: x.to(torch.bfloat16), id="bf16"),
        pytest.param(lambda x: x.to(torch.float16), id="fp16"),
        pytest.param(lambda x: x.to(torch.float64) * 1e-3, id="fp64"),
        pytest.param(lambda x: (x * 100).to(torch.int32), id="int32"),
        pytest.param(lambda x: 1000.0 + 1e-3 * x, id="cancellation"),  # std takes two passes
        pytest.param(lambda x: torch.zeros_like(x), id="zeros"),
        pytest.param(lambda x: torch.full_like(x, -2.5), id="constant"),
        # 0.1 is not a float32: equal roundings pile up in a lane's sum instead of cancelling
        # (with blocks of 4,096 values the mean was off by 2.4e-6)
        pytest.param(lambda x: torch.full_like(x, 0.1), id="constant-0.1"),
    ],
)
def test_one_pass_on_other_values(values: object) -> None:
    torch.manual_seed(1)
    x = values(torch.randn(64, 16, 12))  # type: ignore[operator]
    _check(x, 1)
    _check(x, None)
    _check(values(torch.randn(32, 16, 32, 32)), 1)  # type: ignore[operator]


def test_extremes_are_exact_at_the_edges_of_float32() -> None:
    info = torch.finfo(torch.float32)
    x = torch.zeros(20000)
    edges = [info.max, -info.max, info.tiny, -info.tiny, 1e-45, -1e-45, -0.0]
    x[: len(edges)] = torch.tensor(edges)
    stats, _ = summarize_with_activity(x, None)
    assert stats[2] == -info.max and stats[3] == info.max
    y = torch.full((20000,), -0.0)
    y[7] = -1e-45  # the negative subnormal nearest zero is below -0.0
    stats, _ = summarize_with_activity(y, None)
    assert stats[2] == y[7].item() < 0 and stats[3] == 0.0 and stats[5] == 19999


@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_leave_the_kernel_to_the_eager_route(bad: float) -> None:
    x = torch.randn(100, 200)
    x[37, 11] = bad
    assert one_pass(x, 1) is None
    stats, counts = summarize_with_activity(x, 1)
    np.testing.assert_array_equal(np.asarray(stats), np.asarray(summarize(x)))
    assert counts is not None and counts.tolist() == activity(x, 1).tolist()
    assert (stats[6], stats[7]) == ((1, 0) if bad != bad else (0, 1))


def test_a_permuted_tensor_with_nan_is_counted_along_its_own_unit_dimension() -> None:
    # the kernel reads it in memory order and declines (NaN); the eager route must count
    # along the tensor's own dimension, not the one the kernel would have used
    torch.manual_seed(5)
    x = torch.randn(64, 50, 40).relu_().permute(2, 0, 1)  # units: dim 0, 40 of them
    x[3, 7, 11] = float("nan")
    stats, counts = summarize_with_activity(x, 0)
    assert counts is not None and counts.tolist() == (x > 0).sum(dim=(1, 2)).tolist()
    assert stats[6] == 1


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda x: x.to(memory_format=torch.channels_last), id="channels-last"),
        pytest.param(lambda x: x.permute(0, 2, 3, 1).contiguous().permute(0, 3, 1, 2), id="nhwc"),
        pytest.param(lambda x: x.transpose(2, 3), id="transposed"),
    ],
)
def test_the_eager_route_counts_permuted_tensors_right(
    make: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as without numba or with HOOKTRACE_ONE_PASS=0
    monkeypatch.setattr(stats_module, "_route", Route("eager (test)", 0.0, None))
    torch.manual_seed(6)
    x = make(torch.randn(16, 8, 20, 24).relu_())  # type: ignore[operator]
    assert not x.is_contiguous()
    stats, counts = summarize_with_activity(x, 1)
    assert counts is not None and counts.tolist() == (x > 0).sum(dim=(0, 2, 3)).tolist()
    want, _ = _reference(x.numpy(), 1)
    np.testing.assert_allclose(np.asarray(stats), want, rtol=1e-5)


@pytest.mark.parametrize(
    ("make", "dim"),
    [
        pytest.param(lambda x: x.transpose(0, 1), 2, id="time-major"),  # MultiheadAttention's
        pytest.param(lambda x: x.permute(2, 0, 1), 0, id="permuted"),
        pytest.param(lambda x: x.permute(2, 0, 1), 1, id="permuted-other-unit"),
        pytest.param(lambda x: x[:, ::2], 1, id="strided-slice"),  # copied
        pytest.param(lambda x: x[:1].expand(64, 50, 40), 2, id="broadcast"),  # copied
    ],
)
def test_non_contiguous_tensors_take_one_pass_too(make: object, dim: int) -> None:
    torch.manual_seed(4)
    x = make(torch.randn(64, 50, 40).relu_())  # type: ignore[operator]
    assert not x.is_contiguous()
    _check(x, dim)


def test_an_empty_tensor_has_no_statistics_on_any_route() -> None:
    for empty in (torch.empty(0, 5), torch.empty(0, 5, dtype=torch.float64)):
        stats, counts = summarize_with_activity(empty, 1)
        assert stats is None
        assert counts is not None and counts.tolist() == [0] * 5


def test_one_pass_is_deterministic() -> None:
    torch.manual_seed(2)
    x = torch.randn(32, 16, 32, 32)
    first = summarize_with_activity(x, 1)
    summarize_with_activity(torch.randn(7, 9000), None)  # nothing carries over between calls
    again = summarize_with_activity(x.clone(), 1)
    np.testing.assert_array_equal(np.asarray(first[0]), np.asarray(again[0]))
    assert first[1] is not None and again[1] is not None
    assert np.array_equal(first[1], again[1])


def test_keys_and_counts_stay_32_bit_inside_a_block() -> None:
    """numba widens integer arithmetic to int64 unless it is cast back; widened keys filled
    half a vector per instruction, and the kernel read values at half the speed."""
    import numba

    from hooktrace.recorder.stats import kernel

    @numba.njit
    def block(values: np.ndarray) -> object:
        return kernel._block(values, values.view(np.int32))

    @numba.njit
    def block_columns(values: np.ndarray, counts: np.ndarray) -> object:
        return kernel._block_columns(values, values.view(np.int32), counts)

    values = np.array([-1.5, 0.0, 2.0], dtype=np.float32)
    total, squares, lo, hi, zeros, positives = block(values)
    assert (total, squares, zeros, positives) == (0.5, 6.25, 1, 1)
    assert (kernel._float_of(lo), kernel._float_of(hi)) == (-1.5, 2.0)
    counts = np.zeros(3, dtype=np.int32)
    block_columns(values, counts)
    assert counts.tolist() == [0, 0, 1]
    f32, i32 = numba.types.float32, numba.types.int32
    (signature,) = block.nopython_signatures
    assert signature.return_type == numba.types.Tuple((f32, f32, i32, i32, i32, i32))
    (signature,) = block_columns.nopython_signatures
    assert signature.return_type == numba.types.Tuple((f32, f32, i32, i32, i32))


def test_one_pass_agrees_with_the_eager_route() -> None:
    torch.manual_seed(3)
    x = torch.relu(torch.randn(16, 32, 24, 24))
    fused, fused_counts = summarize_with_activity(x, 1)
    eager = np.asarray(summarize(x))
    np.testing.assert_allclose(np.asarray(fused), eager, rtol=2e-6)
    assert fused_counts is not None
    assert fused_counts.tolist() == activity(x, unit_dim(x, channels_first=False) or 1).tolist()


def test_a_trace_says_which_route_summarised_it(tmp_path: Path) -> None:
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3, padding=1)  # (16, 8, 20, 20) outputs: the kernel's
    with hooktrace.record(conv, tmp_path / "run") as rec:
        conv(torch.randn(16, 3, 20, 20)).relu().sum().backward()
        rec.step()
        assert rec._scratch.numel() == 0  # the eager route's counting buffer, never grown
    status = json.loads((tmp_path / "run" / "status" / "rank=0.json").read_text())
    assert status["stats_route"].startswith("one-pass (numba ")
    assert status["stats_warmup_seconds"] >= 0
    assert hooktrace.load(tmp_path / "run").manifest["ranks"]["0"]["stats_route"]


_SCRIPT = """
import json, sys, torch, hooktrace
torch.manual_seed(0)
conv = torch.nn.Conv2d(3, 8, 3, padding=1)
with hooktrace.record(conv, sys.argv[1]) as rec:
    conv(torch.randn(16, 3, 20, 20)).relu().sum().backward()
    rec.step()
"""


def test_switched_off_the_eager_route_records_the_same_statistics(tmp_path: Path) -> None:
    runs = {}
    for switch in ("wait", "0"):
        out = tmp_path / f"run{switch}"
        env = {**os.environ, "HOOKTRACE_ONE_PASS": switch}
        subprocess.run([sys.executable, "-c", _SCRIPT, str(out)], env=env, check=True)
        runs[switch] = hooktrace.load(out)
    assert runs["0"].manifest["ranks"]["0"]["stats_route"] == "eager (HOOKTRACE_ONE_PASS=0)"
    assert runs["wait"].manifest["ranks"]["0"]["stats_route"].startswith("one-pass")
    one, eager = runs["wait"].records, runs["0"].records
    assert one["numel"].max() > 8192  # the kernel's tensors, not only staged ones
    columns = ["mean", "std", "min", "max", "norm", "zero_fraction"]
    np.testing.assert_allclose(one[columns].to_numpy(), eager[columns].to_numpy(), rtol=2e-6)
    np.testing.assert_array_equal(
        runs["wait"].activity("Conv2d", step=0), runs["0"].activity("Conv2d", step=0)
    )


_OFF_CPU = """
import os, sys, torch, hooktrace
lin = torch.nn.Linear(256, 256, device="meta")
rec = hooktrace.record(lin, sys.argv[1])
lin(torch.randn(64, 256, device="meta"))  # 16,384 values, but not on the CPU
print("numba" in sys.modules, flush=True)
os._exit(0)  # the writer has nothing to prove here
"""


def test_a_run_with_no_cpu_tensor_never_loads_numba(tmp_path: Path) -> None:
    """Large tensors off the CPU (a GPU's; here the meta device) take no kernel: loading it
    (compiling it, the first time on a machine) would stall the first recorded step."""
    done = subprocess.run(
        [sys.executable, "-c", _OFF_CPU, str(tmp_path / "run")], capture_output=True, text=True
    )
    assert done.stdout.split() == ["False"], done.stderr


_LAZY = """
import sys, torch, hooktrace
conv = torch.nn.Conv2d(3, 8, 3, padding=1)
with hooktrace.record(conv, sys.argv[1]) as rec:
    print("numba" in sys.modules)
    conv(torch.randn(1, 3, 4, 4)).sum().backward()  # 128 values: read in place, by a kernel
    rec.step()
    print("numba" in sys.modules)
trace = hooktrace.load(sys.argv[1])
print(trace.manifest["ranks"]["0"]["stats_route"].split(" ")[0])
"""


def test_numba_is_imported_at_the_first_cpu_tensor(tmp_path: Path) -> None:
    """A small CPU tensor read in place costs a fifth of a staged copy (and its NaN check and
    histogram come from the same pass): the first one loads the kernels. The analyzer never
    imports numba."""
    done = subprocess.run(
        [sys.executable, "-c", _LAZY, str(tmp_path / "run")], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "True", "one-pass"]
    analyzer = subprocess.run(
        [sys.executable, "-c", "import sys, hooktrace; "
         f"t = hooktrace.load({str(tmp_path / 'run')!r}); hooktrace.summary(t); "
         "print('numba' in sys.modules)"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert analyzer.stdout.strip() == "False", analyzer.stderr


# --- the writer's kernels: a step's small tensors, all in one call ---------------------------


def _segments_of(rng: np.random.Generator, lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Float64 segments of the given lengths, each of a different scale and kind: some with
    a NaN, an infinity, many zeros, or one value repeated."""
    parts = []
    for i, n in enumerate(lengths):
        a = rng.standard_normal(n) * 10.0 ** rng.uniform(-6, 6)
        kind = i % 6
        if kind == 1:
            a[rng.integers(0, n)] = np.nan
        elif kind == 2:
            a[rng.integers(0, n)] = -np.inf if i % 4 else np.inf
        elif kind == 3:
            a[rng.random(n) < 0.6] = 0.0
        elif kind == 4:
            a[:] = 0.1  # a constant that float64 cannot hold exactly
        parts.append(a)
    bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=bounds[1:])
    return np.concatenate(parts), bounds


def test_the_writers_kernel_sums_exactly_as_numpy_does() -> None:
    """Bit for bit, NaN where numpy has NaN: so which of the two summarises a step's small
    tensors never shows in a trace. The lengths cross each branch of numpy's pairwise
    summation (8 values, 128, a split)."""
    from hooktrace.recorder.stats.staged_kernels import summarize_segments
    from hooktrace.recorder.stats.stats import summarize_staged

    rng = np.random.default_rng(0)
    edges = [1, 2, 7, 8, 9, 15, 16, 17, 128, 129, 130, 255, 256, 257, 1000, 8191, 8192]
    for trial in range(40):
        lengths = edges if trial == 0 else rng.integers(1, 3000, rng.integers(1, 30)).tolist()
        values, bounds = _segments_of(rng, lengths)
        want = summarize_staged(values, np.diff(bounds))
        got = summarize_segments(values, bounds)
        assert np.array_equal(got, want, equal_nan=True), trial
        assert np.isnan(got[1::6, 2]).all()  # each segment with a NaN has NaN extremes


def test_tensors_read_in_place_sum_exactly_as_their_float64_copies() -> None:
    """The parameters' route: float32, float64 and int64 tensors read where they lie, each
    value widened as it is read, give the rows numpy gives their float64 copies, bit for bit,
    with the dtypes mixed in one call."""
    from hooktrace.recorder.stats.staged_kernels import summarize_tensors
    from hooktrace.recorder.stats.stats import summarize_staged

    rng = np.random.default_rng(2)
    edges = [1, 2, 7, 8, 9, 15, 16, 17, 128, 129, 130, 255, 256, 257, 1000, 8191, 8192]
    dtypes = [torch.float32, torch.float64, torch.int64]
    for trial in range(20):
        lengths = edges if trial == 0 else rng.integers(1, 3000, rng.integers(1, 30)).tolist()
        values, bounds = _segments_of(rng, lengths)
        tensors = []
        for k, (lo, hi) in enumerate(itertools.pairwise(bounds.tolist())):
            dtype = dtypes[(k + trial) % 3]
            if dtype is torch.int64:  # magnitudes past 2**53 round as they widen
                part = np.clip(np.nan_to_num(values[lo:hi]), -1e3, 1e3) * 2.0**52
                tensors.append(torch.from_numpy(np.round(part).astype(np.int64)))
            else:
                tensors.append(torch.from_numpy(values[lo:hi]).to(dtype))
        copies = np.concatenate([t.double().numpy() for t in tensors])
        want = summarize_staged(copies, np.diff(bounds))
        got = summarize_tensors(tensors)
        assert all(row is not None for row in got), trial
        assert np.array_equal(np.stack(got), want, equal_nan=True), trial


def test_integers_read_in_place_at_the_ends_of_int64() -> None:
    """Values no float64 holds exactly: the extremes and the sums are of the widened values,
    as numpy makes them of a float64 copy. Checked against the copy, and by hand."""
    from hooktrace.recorder.stats.staged_kernels import summarize_tensors
    from hooktrace.recorder.stats.stats import summarize_staged

    tensor = torch.tensor([2**63 - 1, -(2**63), 2**53 + 1, 0, 7])
    (row,) = summarize_tensors([tensor])
    want = summarize_staged(tensor.double().numpy(), np.array([5]))[0]
    assert row is not None and np.array_equal(row, want)
    assert row[2] == -(2.0**63) and row[3] == 2.0**63  # 2**63 - 1 widens to 2**63
    assert row[5] == 1  # one zero
    (scalar,) = summarize_tensors([torch.tensor(3)])  # num_batches_tracked, 0-dimensional
    assert scalar is not None and scalar.tolist() == [3.0, 0.0, 3.0, 3.0, 3.0, 0, 0, 0]


def test_only_plain_contiguous_cpu_tensors_of_three_dtypes_are_read_in_place() -> None:
    """The kernel reads raw memory: a tensor it could misread is left to the staged route
    (None in its place) and not read; the others in the same call still are."""
    from hooktrace.recorder.stats.staged_kernels import summarize_tensors
    from hooktrace.recorder.stats.stats import summarize_staged

    class Tagged(torch.Tensor):
        pass

    good = torch.randn(4, 3)
    want = summarize_staged(good.double().numpy().ravel(), np.array([12]))[0]
    bad = [
        good.t(),  # not contiguous
        good.to(torch.bfloat16),
        good.half(),
        torch.ones(3, dtype=torch.int32),
        torch.ones(3, dtype=torch.bool),
        torch.ones(3, dtype=torch.int64).t().expand(2, 3),  # not contiguous either
        torch.ones(0),
        good.as_subclass(Tagged),
        good.to_sparse(),
        torch.empty(3, device="meta"),
        # contiguous, but its memory holds the values before negation (a real parameter's
        # gradient through complex conj() is one)
        torch._neg_view(torch.tensor([2.0])),
    ]
    if hasattr(torch, "_to_functional_tensor"):
        bad.append(torch._to_functional_tensor(torch.randn(3)))  # no memory of its own
    for tensor in bad:
        rows = summarize_tensors([good, tensor, torch.nn.Parameter(good.clone())])
        assert rows[1] is None, tensor
        assert rows[0] is not None and rows[2] is not None
        assert np.array_equal(rows[0], want) and np.array_equal(rows[2], want)


def test_the_writers_kernel_counts_units_as_numpy_does() -> None:
    from hooktrace.recorder.stats.staged_kernels import unit_counts
    from hooktrace.recorder.stats.stats import activity_staged

    rng = np.random.default_rng(1)
    shapes = [((3, 4, 2, 2), 1), ((2, 5, 6), 2), ((7,), 0), ((4, 3), 0), ((2, 3, 1), 1)]
    tensors = [rng.standard_normal(int(np.prod(s))) for s, _ in shapes]
    for t in tensors:
        t[rng.random(t.size) < 0.3] = 0.0  # zero is not positive
    values = np.concatenate(tensors)
    starts = np.cumsum([0] + [t.size for t in tensors])[:-1]
    segments = np.array(
        [(start, int(np.prod(s[:d])), s[d], int(np.prod(s[d + 1 :])))
         for start, (s, d) in zip(starts, shapes, strict=True)],
        dtype=np.int64,
    )  # fmt: skip
    want = np.concatenate(
        [activity_staged(t, s, d) for t, (s, d) in zip(tensors, shapes, strict=True)]
    )
    assert unit_counts(values, segments).tolist() == want.tolist()


def test_a_step_materialises_the_same_with_and_without_the_writers_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real training step's small tensors, taken once by the kernel (this process took
    the one-pass route) and once by numpy: the same statistics and activity, bit for bit."""
    from hooktrace.recorder.records import pending, staging
    from hooktrace.recorder.stats import numba_kernels

    route()  # the one-pass route is taken: the writer's kernels can be loaded
    ready = numba_kernels.staged
    assert ready() is not None
    # hooks stage their small tensors (as before the kernels are ready), for the writer
    monkeypatch.setattr(numba_kernels, "staged", lambda: None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 36, 5)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    kept: list[pending.PendingStep] = []
    with hooktrace.record(model, tmp_path / "run") as rec:
        rec._writer.submit = kept.append  # the steps, before the writer takes them
        for _ in range(2):
            model(torch.randn(2, 3, 8, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
    step = kept[-1]
    assert sum(type(s) is staging.Staged for s in step.stats) >= 10
    assert any(isinstance(a, staging.StagedUnits) for _, a in step.activity)
    monkeypatch.setattr(numba_kernels, "staged", ready)
    by_kernel = (step._statistics(), step._activity())
    monkeypatch.setattr(numba_kernels, "staged", lambda: None)
    plain = (step._statistics(), step._activity())
    assert np.array_equal(by_kernel[0], plain[0], equal_nan=True)
    assert [r for r, _ in by_kernel[1]] == [r for r, _ in plain[1]]
    for (_, got), (_, want) in zip(by_kernel[1], plain[1], strict=True):
        assert got.dtype == want.dtype == np.int64 and got.tolist() == want.tolist()


def _small_outputs_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(4 * 36, 5),
        torch.nn.Tanh(),
    )


def test_small_outputs_read_in_place_are_recorded_as_staged_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the kernels are loaded, a hook reads a small output or gradient where it lies
    (statistics and per-unit counts) instead of copying it for the writer. The same training
    recorded both ways (staged, the writer takes them with numpy): every record and every
    activity count equal, bit for bit."""
    from hooktrace.recorder.stats import numba_kernels, staged_kernels

    route()
    read: list[int] = []
    real = staged_kernels.InPlace.read  # the hooks' route, and summarize()'s

    def counting(self: object, *args: Any) -> object:
        summed = real(self, *args)  # type: ignore[arg-type]
        read.append(summed is not None)
        return summed

    traces = {}
    for name in ("in_place", "staged"):
        if name == "in_place":
            monkeypatch.setattr(staged_kernels.InPlace, "read", counting)
        else:
            monkeypatch.setattr(numba_kernels, "staged", lambda: None)
        torch.manual_seed(0)
        model = _small_outputs_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hooktrace.record(model, tmp_path / name, params=False):
            for step in range(3):
                x = torch.randn(2, 3, 8, 8)
                if step == 2:  # the last: the weights stay finite until then
                    x[0, 0, 0, :3] = torch.tensor([0.0, float("inf"), float("nan")])
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        traces[name] = hooktrace.load(tmp_path / name)
    # a step: 5 outputs and their 5 gradients, all small (the Sequential's are Tanh's)
    assert len(read) == 3 * 10 and all(read)
    records = {
        n: t.records.sort_values(["step", "seq"]).reset_index(drop=True) for n, t in traces.items()
    }
    assert records["staged"]["nan_count"].iloc[-10:].gt(0).any()
    columns = ["step", "module", "kind", "slot", "shape", "mean", "std", "min", "max", "norm"]
    columns += ["zero_fraction", "nan_count", "inf_count", "units", "unit_size"]
    pd.testing.assert_frame_equal(
        records["in_place"][columns], records["staged"][columns], check_exact=True
    )
    with_units = records["staged"][records["staged"]["units"] > 0]
    assert len(with_units) >= 3 * 5
    for row in with_units.itertuples():
        got, want = (
            traces[n].activity(row.module, row.kind, step=row.step, slot=row.slot)
            for n in ("in_place", "staged")
        )
        assert got.dtype == want.dtype == np.int64 and got.tolist() == want.tolist()


def test_denormals_read_in_place_count_as_the_staged_copy_counts_them() -> None:
    """``torch.set_flush_denormal(True)`` makes the CPU treat denormals as zero: the staged
    copy of a float32 tensor then holds zeros for them. The in-place read counts them as
    zeros too (it counted their bits, none zero, while its min said -0.0). Without the flag,
    both count them as the values they are."""
    from hooktrace.recorder.records.staging import Staging
    from hooktrace.recorder.stats.staged_kernels import InPlace, summarize_tensors
    from hooktrace.recorder.stats.stats import activity_staged, summarize_staged

    tensor = torch.tensor([[1e-40, -1e-40, 1.0, 2.0], [0.0, 3e-39, -1.0, 5.0]])
    for flush in (True, False):
        if not torch.set_flush_denormal(flush):
            assert flush, "turning the flag off cannot fail"
            continue  # a CPU without the flag: nothing to check
        try:
            staging = Staging()
            staging.add(tensor)
            copy = staging.values().copy()
            want = summarize_staged(copy, np.array([8]))[0]
            (row,) = summarize_tensors([tensor])
            summed = InPlace().summarize(tensor, 1)
        finally:
            torch.set_flush_denormal(False)
        assert summed is not None and row is not None
        assert want[5] == (4 if flush else 1)  # zeros
        assert np.array_equal(row, want) and np.array_equal(summed[0], want)
        assert summed[1] is not None
        assert summed[1].tolist() == activity_staged(copy, (2, 4), 1).tolist()


def test_kernels_that_arrive_mid_run_change_no_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a first run, the small tensors' kernels load once compiled aside
    (recorder/stats/kernel_cache.py): a run sees them arrive at some call, in the hooks or in the
    writer. Whenever that is, the trace is the one numpy alone makes, bit for bit (what makes
    loading them late safe: docs/PERFORMANCE.md)."""
    from hooktrace.recorder.stats import numba_kernels

    route()
    ready = numba_kernels.staged
    records = {}
    for name, arrives_at in (("numpy", None), ("late", 10), ("later", 40)):
        calls = [0]

        def staged(arrives_at: int | None = arrives_at, calls: list[int] = calls) -> object:
            calls[0] += 1
            return ready() if arrives_at is not None and calls[0] > arrives_at else None

        monkeypatch.setattr(numba_kernels, "staged", staged)
        torch.manual_seed(0)
        model = _small_outputs_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hooktrace.record(model, tmp_path / name):
            for _ in range(4):
                model(torch.randn(2, 3, 8, 8)).square().mean().backward()
                opt.step()
                opt.zero_grad()
        if arrives_at is not None:
            assert calls[0] > arrives_at  # the kernels did arrive, mid-run
        loaded = hooktrace.load(tmp_path / name)
        records[name] = (
            loaded.records.drop(columns=["time"], errors="ignore")
            .sort_values(["step", "seq"])
            .reset_index(drop=True),
            [loaded.activity(m, "output", step=3).tolist() for m in ("1", "4")],
        )
    for name in ("late", "later"):
        pd.testing.assert_frame_equal(records[name][0], records["numpy"][0], check_exact=True)
        assert records[name][1] == records["numpy"][1]


def test_float64_denormals_are_not_read_in_place_where_the_thread_flushes_them() -> None:
    """A staged float64 copy keeps denormals (a byte copy), which a flushing thread's
    in-place read would take as zeros: there the tensor is staged, so the trace does not
    depend on when the kernels arrived (found in review)."""
    from hooktrace.recorder.stats.staged_kernels import InPlace, summarize_tensors

    tensor = torch.tensor([[1e-310, 2e-310, 1.0], [0.0, 3e-310, -1.0]], dtype=torch.float64)
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        assert summarize_tensors([tensor]) == [None]
        assert InPlace().summarize(tensor, 1) is None
    finally:
        torch.set_flush_denormal(False)
    (row,) = summarize_tensors([tensor])
    assert row is not None and row[5] == 1  # one zero, the denormals counted as values
