"""Many small tensors on a device summarised in a few launches for all
(hooktrace/recorder/stats/device_batches.py). The batches are torch operations, which run on
the CPU as on a GPU: here they are checked on CPU tensors against values worked out by hand
(REFERENCE_CASES.md, case 1) and against the per-tensor routes they replace on a device, and a
recording whose parameters take them is checked against one whose parameters do not."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn
from torchrun import torchrun

import hooktrace
from hooktrace.recorder.records import params
from hooktrace.recorder.stats import device_batches
from hooktrace.recorder.stats.device_batches import Batches
from hooktrace.recorder.stats.torch_route import histogram_torch, summarize_on_device
from hooktrace.trace.histograms import EXPONENT_MIN, POS, ZERO

_CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh() -> Iterator[None]:
    """Each test proves the batches anew, and none gives them up for the next."""
    saved = list(device_batches._failed), dict(device_batches._proven)
    device_batches._failed.clear()
    device_batches._proven.clear()
    yield
    device_batches._failed[:] = saved[0]
    device_batches._proven.clear()
    device_batches._proven.update(saved[1])


def _batched(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return device_batches.summarize(tensors), device_batches.histograms(tensors)


def _bin(value: float) -> int:
    """A positive value's bin, by hand: 2^e <= value < 2^(e+1) is bin e - EXPONENT_MIN + 1."""
    e = {1.0: 0, 3.0: 1, 7.0: 2, 27.0: 4}[value]
    return POS + e - EXPONENT_MIN + 1


def test_reference_case_one_gradients_by_hand() -> None:
    """fc1.weight.grad, fc1.bias.grad, fc2.weight.grad and fc2.bias.grad in one batch."""
    grads = [
        torch.tensor([[1.0, 1, 1], [0, 0, 0], [3, 3, 3], [0, 0, 0]]),
        torch.tensor([1.0, 0, 3, 0]),
        torch.tensor([[7.0, 0, 27, 0]]),
        torch.tensor([1.0]),
    ]
    rows, counts = _batched(grads)
    # fc1.weight.grad: mean 12 / 12 = 1, squares 30: variance 30 / 12 - 1 = 1.5
    assert rows[0].tolist() == pytest.approx([1, 1.5**0.5, 0, 3, 30**0.5, 6, 0, 0])
    # fc1.bias.grad: mean 1, squares 10: variance 10 / 4 - 1 = 1.5
    assert rows[1].tolist() == pytest.approx([1, 1.5**0.5, 0, 3, 10**0.5, 2, 0, 0])
    # fc2.weight.grad: mean 8.5, deviations -1.5, -8.5, 18.5, -8.5 (squares sum 489)
    assert rows[2].tolist() == pytest.approx([8.5, (489 / 4) ** 0.5, 0, 27, 778**0.5, 2, 0, 0])
    assert rows[3].tolist() == [1, 0, 1, 1, 1, 0, 0, 0]
    assert {i: c for i, c in enumerate(counts[0].tolist()) if c} == {
        ZERO: 6,
        _bin(1.0): 3,
        _bin(3.0): 3,
    }
    assert {i: c for i, c in enumerate(counts[2].tolist()) if c} == {
        ZERO: 2,
        _bin(7.0): 1,
        _bin(27.0): 1,
    }
    assert {i: c for i, c in enumerate(counts[3].tolist()) if c} == {_bin(1.0): 1}


def _cases() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(5000, 3, generator=g) * 3 + 1,
        torch.relu(torch.randn(4, 8, 9, 9, generator=g)).to(memory_format=torch.channels_last),
        torch.randn(30, 50, generator=g).t(),
        torch.tensor([1.0, float("nan"), -2.0, 0.0]),
        torch.tensor([1.0, float("-inf"), -2.0, 0.0, -0.0]),
        torch.tensor([1e-40, -3e-45, 1e-30, 5.0, -1e38, 0.0]),
        torch.full((1000,), 1.0) + torch.randn(1000, generator=g) * 1e-4,  # small spread
        torch.tensor([7.0]),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_batches_give_each_tensors_own_route_numbers(dtype: torch.dtype) -> None:
    """Equal to torch's per-tensor route to float32 rounding, the histograms bin for bin,
    whatever the layout; the mean of values holding an Inf is that Inf (the CPU's rule)."""
    tensors = [t.to(dtype) for t in _cases()]
    rows, counts = _batched(tensors)
    assert rows.dtype == torch.float64 and rows.shape == (len(tensors), 8)
    for i, t in enumerate(tensors):
        expected = summarize_on_device(t.float())
        if t.isinf().any():  # torch's var_mean says NaN; the mean is the Inf (-inf here)
            expected[0] = t.double().mean()
        torch.testing.assert_close(rows[i], expected, rtol=1e-5, atol=1e-6, equal_nan=True)
        assert torch.equal(counts[i], torch.as_tensor(histogram_torch(t))), i
    again, _ = _batched(tensors)
    assert torch.equal(again.nan_to_num(), rows.nan_to_num())  # bit for bit, every time


def test_both_at_once_give_each_alone() -> None:
    """Statistics and histograms made together, from one copy of the values: the same."""
    tensors = _cases()
    rows, counts = device_batches.both(tensors)
    torch.testing.assert_close(
        rows, device_batches.summarize(tensors), rtol=0, atol=0, equal_nan=True
    )
    assert torch.equal(counts, device_batches.histograms(tensors))


def test_a_small_spread_far_from_zero_keeps_its_std() -> None:
    """Two passes, not the sum of squares less the squared mean (which cancels to noise)."""
    x = torch.full((1000,), 1000.0)
    x[::2] += 0.5
    rows, _ = _batched([x])
    assert rows[0, 1].item() == pytest.approx(0.25, rel=1e-6)


def test_batches_split_where_their_values_run_over(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensors split into several batches (one larger than a batch alone in one) give the
    numbers of one batch."""
    tensors = _cases()
    whole_rows, whole_counts = _batched(tensors)
    monkeypatch.setattr(device_batches, "BATCH_VALUES", 1000)
    batches = Batches([t.numel() for t in tensors], _CPU)
    assert [run[:2] for run in batches.runs] == [(0, 1), (1, 2), (2, 3), (3, 6), (6, 7), (7, 8)]
    monkeypatch.setattr(Batches, "_made", {})  # none made before at the real size
    rows, counts = _batched(tensors)
    torch.testing.assert_close(rows, whole_rows, rtol=1e-12, atol=0, equal_nan=True)
    assert torch.equal(counts, whole_counts)


def test_batches_follow_the_sizes_the_tensors_have_now() -> None:
    """The device is told the tensors' sizes once per list of sizes, kept and used again;
    tensors whose sizes change (a shard resized, a parameter given new data) are summarised
    by their sizes now, never by sizes told before (which would read past the values)."""
    g = torch.Generator().manual_seed(1)
    before = [torch.randn(5, generator=g), torch.randn(3, 4, generator=g)]
    after = [torch.randn(7, generator=g), torch.randn(2, generator=g)]  # 17 values, then 9
    for tensors in (before, after, before):
        rows, counts = _batched(tensors)
        for i, t in enumerate(tensors):
            torch.testing.assert_close(rows[i], summarize_on_device(t), rtol=1e-5, atol=1e-6)
            assert torch.equal(counts[i], torch.as_tensor(histogram_torch(t)))
    assert Batches.of((5, 12), _CPU) is Batches.of((5, 12), _CPU)


def test_what_is_batched() -> None:
    """Plain float tensors of some values on a device, of at most MAX_VALUES each; none on
    the CPU, whose small tensors have their own kernels (a test machine has no other device
    than the CPU and meta: the route is checked on CPU tensors, routed as a device's)."""
    from torch.nn.parameter import UninitializedParameter

    assert not device_batches.batchable(torch.ones(3))  # the CPU
    on_meta = [torch.ones(3, device="meta"), torch.ones(3, dtype=torch.int64, device="meta")]
    assert not any(device_batches.batchable(t) for t in on_meta)
    assert not device_batches.batchable(UninitializedParameter())
    assert not device_batches.batchable(None)


def test_a_probe_that_disagrees_gives_the_batches_up_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = device_batches._summarize
    monkeypatch.setattr(device_batches, "_summarize", lambda *a: real(*a) + 1)  # wrong numbers
    with pytest.warns(RuntimeWarning, match="summarised one by one") as said:
        assert not device_batches.usable(_CPU, torch.float32)
    assert len(said) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not device_batches.usable(_CPU, torch.float64)  # given up: no second warning


def test_a_warning_made_an_error_does_not_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    """``-W error`` makes the give-up's warning an exception: the batches are given up all
    the same, and nothing reaches the training."""
    real = device_batches._summarize
    monkeypatch.setattr(device_batches, "_summarize", lambda *a: real(*a) + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not device_batches.usable(_CPU, torch.float32)
    assert device_batches._failed


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16)
        self.norm = nn.LayerNorm(16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.norm(self.fc1(x))))


def _record(where: Path) -> pd.DataFrame:
    torch.manual_seed(0)
    model = _Net()
    model.fc1.weight = nn.Parameter(model.fc1.weight.detach().t().contiguous().t())  # transposed
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, where):  # histograms of parameters and gradients, each step
        for _ in range(3):
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(where)
    records = trace.records
    return records[records["kind"].isin(["param", "grad_param"])].reset_index(drop=True)


def _as_on_a_device(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """Parameters on the CPU routed as a device's are (the route is torch's operations, the
    same on either); returns the sizes of the values batched, for statistics and histograms."""
    assert device_batches.usable(_CPU, torch.float32)  # proved first: the probes not counted
    batched: dict[str, list[int]] = {"summarize": [], "histograms": [], "both": []}
    for name, sizes in batched.items():
        real = getattr(device_batches, name)

        def counting(
            tensors: list[torch.Tensor],
            real: Callable[..., torch.Tensor] = real,
            sizes: list[int] = sizes,
        ) -> torch.Tensor:
            sizes.extend(t.numel() for t in tensors)
            return real(tensors)

        monkeypatch.setattr(device_batches, name, counting)
    monkeypatch.setattr(params, "stageable", lambda value: False)
    monkeypatch.setattr(device_batches, "batchable", lambda value: value is not None)
    return batched


def test_parameters_batched_are_recorded_as_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same training recorded with its parameters and gradients batched and without:
    the same records, statistics equal to float32 rounding, histograms equal."""
    plain = _record(tmp_path / "plain")
    batched = _as_on_a_device(monkeypatch)
    got = _record(tmp_path / "batched")
    # 6 parameters, their gradients, 3 steps: histogrammed each step, with their statistics
    assert len(batched["both"]) == 3 * 2 * 6
    assert batched["summarize"] == batched["histograms"] == []
    keys = ["step", "module", "kind", "slot", "dtype", "shape"]
    pd.testing.assert_frame_equal(got[keys], plain[keys])
    stats = ["mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count"]
    pd.testing.assert_frame_equal(got[stats], plain[stats], rtol=1e-5, atol=1e-7)
    hists = {name: hooktrace.load(tmp_path / name).histograms() for name in ("plain", "batched")}
    assert len(hists["plain"]) == 3 * 2 * 6
    pd.testing.assert_frame_equal(hists["batched"], hists["plain"])


def test_batches_that_fail_leave_each_parameter_its_own_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failure inside the batches (a device without an operation) costs a warning; every
    record is made one by one, nothing is lost, the recording goes on."""
    plain = _record(tmp_path / "plain")
    _as_on_a_device(monkeypatch)

    def failing(*args: object) -> torch.Tensor:
        raise RuntimeError("segment_reduce: not implemented for this device")

    monkeypatch.setattr(device_batches, "both", failing)
    with pytest.warns(RuntimeWarning, match="one by one .RuntimeError: segment_reduce"):
        got = _record(tmp_path / "failed")
    stats = ["mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count"]
    pd.testing.assert_frame_equal(got[stats], plain[stats], rtol=1e-5, atol=1e-7)
    assert hooktrace.load(tmp_path / "failed").status == "complete"


def test_a_group_out_of_memory_takes_its_own_route_while_its_records_hold(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch that does not fit on the device: no warning, the same records made one by
    one, and the allocation is not tried again at every step (on a GPU each failed one
    empties the allocator's cache)."""
    plain = _record(tmp_path / "plain")
    batched = _as_on_a_device(monkeypatch)
    tried: list[int] = []

    def out_of_memory(tensors: list[torch.Tensor]) -> torch.Tensor:
        tried.append(len(tensors))
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (as a GPU says it)")

    monkeypatch.setattr(device_batches, "both", out_of_memory)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _record(tmp_path / "oom")
    assert tried == [6, 6]  # the parameters' group and the gradients', once each
    assert batched["summarize"] == batched["histograms"] == []  # all of them one by one
    stats = ["mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count"]
    pd.testing.assert_frame_equal(got[stats], plain[stats], rtol=1e-5, atol=1e-7)


_FSDP2 = """
import sys
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import hooktrace
from hooktrace.recorder.records import params
from hooktrace.recorder.stats import device_batches

dist.init_process_group("gloo")
rank = dist.get_rank()
batched = []  # the local shards summarised in batches
if sys.argv[2] == "batched":  # the CPU's local shards routed as a device's are
    params.stageable = lambda value: False
    device_batches.batchable = lambda value: value is not None and value.numel() > 0
    assert device_batches.usable(torch.device("cpu"), torch.float32)  # its probes not counted
    real = device_batches.both  # (parameters and gradients are histogrammed every step)
    def counting(tensors):
        batched.extend(type(t).__name__ for t in tensors)
        return real(tensors)
    device_batches.both = counting
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))  # 5 rows: uneven
for layer in (model[0], model[2]):
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
data = torch.Generator().manual_seed(rank)
with hooktrace.record(model, sys.argv[1]):
    for step in range(3):
        model(torch.randn(8, 16, generator=data)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
with open(f"{sys.argv[1]}.batched{rank}", "w") as out:
    out.write(" ".join(batched))
dist.barrier()
dist.destroy_process_group()
"""


def test_fsdp2_shards_batched_are_recorded_as_one_by_one(tmp_path: Path) -> None:
    """FSDP2's parameters and gradients are DTensors: their local shards are batched, each
    record placed by its shard columns as one made one by one is (2 ranks, torchrun)."""
    script = tmp_path / "fsdp2.py"
    script.write_text(_FSDP2)
    for name in ("plain", "batched"):
        done = torchrun(tmp_path, str(script), str(tmp_path / name), name)
        assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):  # 4 parameters, their gradients, 3 steps: their local shards
        assert (tmp_path / f"batched.batched{rank}").read_text().split() == ["Tensor"] * 24
    plain, batched = (hooktrace.load(tmp_path / name) for name in ("plain", "batched"))
    columns = ["rank", "step", "module", "kind", "slot", "dtype", "shape", "units", "unit_size",
               "logical_shape", "mesh_shape", "mesh_coord", "placements", "shard_offset"]  # fmt: skip
    stats = ["mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count"]
    want = ["param", "grad_param"]
    expected = plain.query(kinds=want, columns=columns + stats, logical=False)
    got = batched.query(kinds=want, columns=columns + stats, logical=False)
    assert len(expected) == 2 * 3 * 2 * 4  # ranks, steps, kinds, parameters
    assert set(expected["placements"]) == {"S(0)"}
    pd.testing.assert_frame_equal(got[columns], expected[columns])
    pd.testing.assert_frame_equal(got[stats], expected[stats], rtol=1e-5, atol=1e-7)
    hists = [t.histograms(logical=False) for t in (plain, batched)]
    assert len(hists[0]) == len(expected)
    pd.testing.assert_frame_equal(hists[1], hists[0])


def test_the_batches_switch_off_with_an_environment_variable() -> None:
    check = (
        "import torch; from hooktrace.recorder.stats import device_batches as b; "
        "print(b.usable(torch.device('cpu'), torch.float32))"
    )
    said = {}
    for value in ("0", "1"):
        env = {**os.environ, "HOOKTRACE_DEVICE_BATCHES": value}
        done = subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, env=env
        )
        said[value] = done.stdout.strip()
    assert said == {"0": "False", "1": "True"}
