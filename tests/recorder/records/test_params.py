"""Parameter, buffer and gradient records (hooktrace.recorder.records.params)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import hooktrace
from hooktrace.recorder.records.observe import Reads
from hooktrace.recorder.records.params import Entry, param_records
from hooktrace.recorder.records.staging import Staged, Staging
from hooktrace.recorder.stats import numba_kernels
from hooktrace.recorder.stats.stats import route, summarize_staged


def _entries(*names: str) -> list[Entry]:
    return [Entry(*name.split("."), {}, name.split(".")[1], None) for name in names]


def test_small_values_are_staged_by_dtype_and_the_rest_left_to_the_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(numba_kernels, "staged", lambda: None)  # as before the kernels are ready
    entries = _entries("a.weight", "a.bias", "b.weight", "b.bias", "c.weight")
    values = [
        torch.ones(3, 2),
        torch.ones(3, dtype=torch.float64),
        torch.ones(9000),  # too large to stage
        None,  # no gradient
        torch.ones(2),  # saved whole this step
    ]
    records = param_records(
        entries, values, kind="grad_param", phase="train", micro_step=1, saved_whole={"c"}
    )
    assert records.together == ((0,), (1,))  # float32, then float64, in entry order
    assert records.observed == (2, 4)
    assert [m.module for m in records.metas] == ["a", "a", "b", "b", "c"]
    assert records.metas[3].dtype is None and records.metas[3].shape == ()
    assert records.metas[0].shape == (3, 2) and records.metas[0].micro_step == 1

    staging = Staging()
    stats = records.stage(values, staging, Reads())
    assert stats == [Staged(0), Staged(1), None, None, None]
    assert staging.lengths == [6, 3]


def test_values_are_summarised_in_place_once_the_kernels_are_loaded() -> None:
    """No copy: float32, float64 and int64 rows come back now, equal bit for bit to what the
    writer makes of the staged copies; other dtypes are still staged."""
    route()  # loads numba, as the first large tensor of a run does
    assert numba_kernels.staged() is not None
    entries = _entries("a.weight", "a.bias", "b.weight", "b.count", "b.scale", "b.mask")
    generator = torch.Generator().manual_seed(0)
    values = [
        torch.randn(30, 20, generator=generator),
        torch.tensor([0.0, -0.0, float("inf"), 1e30]),
        torch.randn(7, generator=generator) * 1e-20,
        torch.tensor(3, dtype=torch.int64),
        torch.randn(5, generator=generator, dtype=torch.float64),
        torch.tensor([True, False, True]),
    ]
    records = param_records(
        entries, values, kind="param", phase="train", micro_step=0, saved_whole=()
    )
    staging = Staging()
    stats = records.stage(values, staging, Reads())
    assert [type(s).__name__ for s in stats] == ["ndarray"] * 5 + ["Staged"]
    assert staging.lengths == [3]

    copies = [v.double().numpy().ravel() for v in values]
    want = summarize_staged(np.concatenate(copies), np.array([c.size for c in copies]))
    assert np.array_equal(np.stack(stats[:5]), want[:5], equal_nan=True)


def test_values_read_in_place_step_after_step_are_found_where_they_lie_now() -> None:
    """A kind's places are kept from step to step (TensorsInPlace): a value updated in place
    is read where it was, one replaced (a new gradient) where the new one lies, and one no
    longer contiguous is left to the staged route; every read equals a fresh one."""
    route()
    kernels = numba_kernels.staged()
    assert kernels is not None
    reads = kernels.TensorsInPlace()
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(4, 3, generator=generator)
    b = torch.randn(5, generator=generator, dtype=torch.float64)
    c = torch.arange(6)

    def read(tensors: list[torch.Tensor]) -> list[np.ndarray | None]:
        got, want = reads.summarize(tensors), kernels.summarize_tensors(tensors)
        for x, y in zip(got, want, strict=True):
            assert (x is None and y is None) or np.array_equal(x, y, equal_nan=True)
        return got

    assert read([a, b, c])[0][3] == a.max().item()
    a.mul_(-2)  # the optimizer's update: where it was
    assert read([a, b, c])[0][3] == a.max().item()
    b = torch.randn(5, generator=generator, dtype=torch.float64) + 10  # replaced
    assert read([a, b, c])[1][0] == b.mean().item()
    rows = read([torch.randn(3, 4, generator=generator).t(), b, c])  # not contiguous
    assert rows[0] is None and rows[1] is not None


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


def _expected(model: nn.Module, kind: str) -> dict[str, np.ndarray | None]:
    if kind == "buffer":
        return {name: b.double().numpy().copy() for name, b in model.named_buffers()}
    if kind == "param":
        return {name: p.detach().double().numpy().copy() for name, p in model.named_parameters()}
    return {  # the gradients of the parameters that require one (a frozen one has none)
        name: None if p.grad is None else p.grad.double().numpy().copy()
        for name, p in model.named_parameters()
        if p.requires_grad
    }


def test_records_follow_the_values_when_their_layout_changes(run_dir: Path) -> None:
    """Each record holds its own step's values, when a dtype changes (``double()``, which
    replaces the buffers) and when a parameter is frozen (its gradient no longer recorded)."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    want: dict[int, dict[tuple[str, str], np.ndarray | None]] = {}
    dtypes = {}
    with hooktrace.record(model, run_dir):
        for step in range(6):
            if step == 3:
                model.double()
            if step == 4:
                model.fc.weight.requires_grad_(False)
            dtype = torch.float64 if step >= 3 else torch.float32
            dtypes[step] = "float64" if step >= 3 else "float32"
            want[step] = {
                (kind, name): value
                for kind in ("param", "buffer")
                for name, value in _expected(model, kind).items()
            }
            model(torch.randn(8, 4, dtype=dtype)).sum().backward()
            want[step] |= {("grad_param", n): v for n, v in _expected(model, "grad_param").items()}
            opt.step()
            opt.zero_grad(set_to_none=True)

    records = hooktrace.load(run_dir).records
    records = records[records["kind"].isin(["param", "buffer", "grad_param"])]
    for step, expected in want.items():
        rows = records[records["step"] == step]
        assert len(rows) == len(expected), step
        for row in rows.itertuples():
            key = (row.kind, f"{row.module.removeprefix('_Net.')}.{row.slot}")
            value = expected[key]
            if value is None:
                assert row.dtype == "None" and np.isnan(row.mean), (step, key)
                continue
            if row.kind != "buffer" or row.slot != "num_batches_tracked":
                assert row.dtype == dtypes[step], (step, key)
            assert row.shape == ",".join(map(str, value.shape)), (step, key)
            assert row.min == value.min() and row.max == value.max(), (step, key)
            np.testing.assert_allclose(row.mean, value.mean(), rtol=1e-6, err_msg=str(key))


class _Counting(nn.Module):
    """Replaces its buffer with a new tensor on every call, as custom modules often do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.fc(x)


def test_a_buffer_replaced_by_the_model_is_recorded_as_it_is_now(run_dir: Path) -> None:
    """The recorder used to keep the buffer tensor it found when it started: a module that
    assigns a new one recorded the first one's values for ever."""
    model = _Counting()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for _ in range(4):
            model(torch.ones(3, 2)).sum().backward()
            opt.step()
    records = hooktrace.load(run_dir).records
    calls = records[(records["kind"] == "buffer") & (records["slot"] == "calls")]
    # as each step's first forward finds it: before that forward's own call
    assert calls.sort_values("step")["mean"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_parameter_replaced_or_pruned_mid_run_keeps_being_recorded(run_dir: Path) -> None:
    """A new Parameter assigned in place of the old one is recorded from then on; pruning
    moves ``weight`` to ``weight_orig`` (the same parameter), which is recorded still."""
    torch.manual_seed(0)
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for step in range(4):
            if step == 2:
                model.head.bias = nn.Parameter(torch.full((2,), 7.0))
                prune.l1_unstructured(model.fc, "weight", amount=0.5)
            orig = model.fc._parameters.get("weight_orig", model.fc.weight).detach().clone()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    records = hooktrace.load(run_dir).records
    later = records[records["step"] == 3]
    bias = later[(later["kind"] == "param") & (later["module"] == "head")]
    assert bias.loc[bias["slot"] == "bias", "mean"].tolist() == [7.0]
    weight = later[(later["module"] == "fc") & (later["slot"] == "weight")]
    assert set(weight["kind"]) == {"param", "grad_param"}
    param = weight[weight["kind"] == "param"].iloc[0]
    assert param["min"] == orig.min().item() and param["max"] == orig.max().item()
    assert (weight["dtype"] == "float32").all()


class _Extra(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.extra = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.extra.sum()


def test_a_parameter_given_new_data_of_another_shape_is_recorded_with_it(run_dir: Path) -> None:
    """``p.data = ...`` keeps the Parameter and changes what it holds: the records built for
    one step must not be reused for the next (the recorder reuses them while every value's
    dtype, shape, device and layout hold). The last shape is too large to be taken with the
    small values: it takes the hook's route."""
    model = _Extra()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    datas = [torch.zeros(2), torch.arange(5.0), torch.arange(5.0) - 9, torch.arange(10000.0)]
    with hooktrace.record(model, run_dir):
        for data in datas:
            model.extra.data = data
            model(torch.ones(3, 2)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    records = hooktrace.load(run_dir).records
    extra = records[(records["slot"] == "extra") & (records["kind"] == "param")]
    extra = extra.sort_values("step")
    assert extra["shape"].tolist() == ["2", "5", "5", "10000"]
    assert extra["min"].tolist() == [0.0, 0.0, -9.0, 0.0]
    assert extra["max"].tolist() == [0.0, 4.0, -5.0, 9999.0]
    grads = records[(records["slot"] == "extra") & (records["kind"] == "grad_param")]
    assert grads.sort_values("step")["shape"].tolist() == ["2", "5", "5", "10000"]


def test_a_parameter_its_module_sets_to_none_is_recorded_without_a_value(run_dir: Path) -> None:
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for step in range(2):
            if step == 1:
                model.head.bias = None
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    records = hooktrace.load(run_dir).records
    bias = records[(records["module"] == "head") & (records["slot"] == "bias")]
    by_step = bias.set_index(["step", "kind"])
    assert by_step.loc[(0, "param"), "dtype"] == "float32"
    for kind in ("param", "grad_param"):
        assert by_step.loc[(1, kind), "dtype"] == "None" and np.isnan(
            by_step.loc[(1, kind), "mean"]
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parameters_read_in_place_are_recorded_as_staged_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype
) -> None:
    """The same training recorded twice, once with the values read in place and once staged:
    every statistic of every parameter, buffer and gradient record is equal, and every
    histogram. Every one of them is read in place, the int64 ``num_batches_tracked`` too;
    the histograms of the parameters and gradients where the statistics found them, also
    after a parameter moved (``.data`` replaced at step 1)."""
    from hooktrace.recorder.stats import histogram_kernel, numba_kernels, staged_kernels

    route()
    read: list[int] = []
    binned: list[int] = []
    real = staged_kernels.TensorsInPlace.summarize
    real_at = histogram_kernel.histograms_at

    def counting(
        self: object, tensors: list[torch.Tensor], unchanged: bool = False
    ) -> list[np.ndarray | None]:
        rows = real(self, tensors, unchanged)  # type: ignore[arg-type]
        read.extend(1 for row in rows if row is not None)
        return rows

    def counting_at(places: np.ndarray, zeros: Callable[[int], np.ndarray]) -> np.ndarray:
        binned.append(len(places))
        return real_at(places, zeros)

    records, histograms = {}, {}
    for name in ("in_place", "staged"):
        if name == "in_place":
            monkeypatch.setattr(staged_kernels.TensorsInPlace, "summarize", counting)
            monkeypatch.setattr(histogram_kernel, "histograms_at", counting_at)
        else:
            monkeypatch.setattr(numba_kernels, "staged", lambda: None)
        torch.manual_seed(0)
        model = _Net().to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with hooktrace.record(model, tmp_path / name):
            for step in range(3):
                if step == 1:  # the weight moves: found where it lies now
                    model.fc.weight.data = model.fc.weight.data.clone()
                model(torch.randn(8, 4, dtype=dtype)).sum().backward()
                opt.step()
                opt.zero_grad()
        trace = hooktrace.load(tmp_path / name)
        loaded = trace.records
        records[name] = loaded[loaded["kind"].isin(["param", "buffer", "grad_param"])]
        counts = trace.histograms()
        histograms[name] = counts.sort_values(["step", "module", "kind", "slot"])
    assert len(read) == 3 * (6 + 3 + 6)  # parameters, buffers, gradients, a step
    assert binned == [6, 6] * 3  # the parameters' and the gradients' histograms, a step
    got, want = (histograms[n].reset_index(drop=True) for n in ("in_place", "staged"))
    assert len(got) == 3 * (6 + 6)
    for column in ("pos", "neg"):
        assert np.array_equal(np.stack(got.pop(column)), np.stack(want.pop(column)))
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    columns = ["step", "module", "kind", "slot", "dtype", "mean", "std", "min", "max", "norm"]
    columns += ["zero_fraction", "nan_count", "inf_count"]
    in_place, staged = (records[n][columns].reset_index(drop=True) for n in records)
    assert len(in_place) == 3 * (6 + 3 + 6)
    pd.testing.assert_frame_equal(in_place, staged, check_exact=True)


@pytest.mark.parametrize("guard", ["torch's guard", "Python key"])
def test_a_parameter_given_data_of_the_same_shape_laid_out_otherwise_is_read_as_it_lies(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, guard: str
) -> None:
    """A parameter whose ``.data`` becomes a strided slice of the same shape and dtype (its
    rows apart in memory): the records kept from the step before hold for its shape, not for
    its strides, and reading 16 values where it starts would take a row of values that are
    not its own. Each step's record is of the values it holds, by hand: with torch's tensor
    guard, and with the Python key a torch without it is checked by."""
    from hooktrace.recorder.records import params

    if guard == "Python key":
        monkeypatch.setattr(params, "_guard", lambda tensors: None)
    else:  # this torch has it (2.1 to 2.13 take these arguments)
        assert params._guard([torch.zeros(2), torch.ones(3, dtype=torch.int64)]) is not None
    route()
    model = nn.Sequential(nn.Linear(4, 4, bias=False))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    wide = torch.arange(32.0).reshape(4, 8)  # its first four columns: 0-3, 8-11, 16-19, 24-27
    with hooktrace.record(model, run_dir, histograms=None):
        for step in range(3):
            if step == 1:
                model[0].weight.data = wide[:, :4]
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    records = hooktrace.load(run_dir).records
    weight = records[records["kind"] == "param"].sort_values("step")
    columns = wide[:, :4]
    assert weight["max"].tolist()[1:] == [27.0, 27.0]  # not 15: the slice's own values
    assert weight["mean"].tolist()[1:] == [columns.mean().item()] * 2
    assert weight["norm"].tolist()[1:] == pytest.approx([columns.norm().item()] * 2, rel=1e-6)


def test_a_value_with_no_memory_of_its_own_is_not_read_in_place() -> None:
    """An efficient zero tensor (and a functionalized one) says it lies at address 0: read
    there, the process ended with a segmentation fault (found in review). It is left to the
    staged route, on the first step and on a step that finds the others unchanged."""
    from hooktrace.recorder.records import params

    route()
    kernels = numba_kernels.staged()
    assert kernels is not None
    assert params._guards_tell()  # this torch's guard tells other layouts apart
    reads = kernels.TensorsInPlace()
    plain = torch.arange(6.0)
    zero = torch._efficientzerotensor(3)
    assert zero.data_ptr() == 0
    for unchanged in (False, True, True):
        rows = reads.summarize([plain, zero], unchanged)
        assert rows[1] is None and rows[0] is not None and rows[0][3] == 5.0
    rows = reads.summarize([plain, torch.ones(3)], False)  # found in place again
    assert rows[1] is not None and rows[1][0] == 1.0
    rows = reads.summarize([plain, zero], True)  # the same positions, one with no memory
    assert rows[1] is None
