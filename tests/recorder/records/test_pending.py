"""hooktrace.recorder.records.pending: staging small tensors into reused buffers, and a step's
statistics computed from them in the writer thread."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import default_loss, make_batch, make_model

import hooktrace
from hooktrace.recorder.records.layout import Layouts, Meta
from hooktrace.recorder.records.pending import PendingStep
from hooktrace.recorder.records.staging import Staging, StagingPool
from hooktrace.recorder.stats.stats import route, route_taken
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
    whole_rows,
)


def _stage_all(step: PendingStep, tensors: list[torch.Tensor]) -> None:
    """What the recorder's hooks do for small tensors: a record each, its values staged."""
    for i, t in enumerate(tensors):
        step.meta.append(Meta(0, "train", f"m{i}", 0, "output", "0", t.dtype, tuple(t.shape), 0, 0))
        step.stats.append(step.stage(t))


def test_a_buffer_grows_and_keeps_what_was_staged_before() -> None:
    staging = Staging(StagingPool())
    tensors = [torch.full((700,), float(i)) for i in range(5)]  # 3,500 values: past 1,024
    for t in tensors:
        staging.add(t)
    np.testing.assert_array_equal(staging.values(), np.repeat(np.arange(5.0), 700))
    assert staging.bounds().tolist() == [0, 700, 1400, 2100, 2800, 3500]


class PoisoningPool(StagingPool):
    """Fills each buffer given back with NaN: a step that still read from its buffer after
    giving it back would show NaN."""

    def give_back(self, buffer: torch.Tensor) -> None:
        buffer.fill_(float("nan"))
        super().give_back(buffer)


def test_steps_reuse_one_buffer_and_never_see_each_others_values() -> None:
    pool = PoisoningPool()
    first = PendingStep(0, 0.0, staging=Staging(pool))
    _stage_all(first, [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[4.0, -4.0]])])
    buffer = first.staging.buffer
    assert buffer is not None
    data = first.materialize()
    assert data.columns["mean"].tolist() == [2.0, 0.0]
    assert first.staging.buffer is None  # given back

    second = PendingStep(1, 0.0, staging=Staging(pool))
    _stage_all(second, [torch.tensor([10.0])])
    assert second.staging.buffer is buffer  # the same storage, not a new allocation
    data = second.materialize()
    assert data.columns["mean"].tolist() == [10.0]
    assert data.columns["max"].tolist() == [10.0]  # nothing left over from the first step
    assert pool.allocated == 1


def test_the_pool_keeps_few_buffers_and_none_too_large() -> None:
    pool = StagingPool(keep=2, keep_values=4096)
    buffers = [pool.take(100) for _ in range(3)]
    assert pool.allocated == 3
    for b in buffers:
        pool.give_back(b)
    pool.give_back(buffers[0])  # given back twice: still held once
    assert {id(pool.take(100)), id(pool.take(100))} == {id(buffers[0]), id(buffers[1])}
    assert pool.allocated == 3  # two were kept
    pool.take(100)
    assert pool.allocated == 4  # the third was not


def test_the_pool_hands_out_no_buffer_smaller_than_steps_need() -> None:
    pool = StagingPool(keep_values=1 << 20)
    small = pool.take(100)  # 1,024 values, the least the pool makes
    pool.give_back(small)
    bigger = pool.take(5000)  # a step needed more
    assert bigger is not small and bigger.numel() >= 5000
    pool.give_back(small)  # too small for the steps now: not kept
    assert pool.take(10).numel() >= 5000
    big = pool.take(2 << 20)
    pool.give_back(big)  # larger than the pool holds between steps: freed
    assert pool.take(10) is not big


def test_a_step_counts_its_whole_buffer_against_the_writers_memory_bound() -> None:
    step = PendingStep(0, 0.0, staging=Staging(StagingPool()))
    step.stage(torch.tensor(1.0))
    assert step.staging.nbytes == 1024 * 8  # the buffer held, not the 8 bytes staged


def test_a_recording_reuses_its_staging_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before the compiled kernels are ready, the reference CNN stages about forty small
    tensors a step (parameters, gradients, buffers, the head's activations): one buffer a
    step, given back and taken again. (Once they are, most of them are read in place.)"""
    from hooktrace.recorder.stats import numba_kernels

    monkeypatch.setattr(numba_kernels, "staged", lambda: None)
    torch.manual_seed(0)
    model = make_model("SmallCNN")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = make_batch("SmallCNN", seed=0)
    steps = 20
    weights = []  # the BatchNorm's weight as each step's forward finds it, by numpy
    with hooktrace.record(model, tmp_path / "run") as rec:
        for _ in range(steps):
            weights.append(model.features[1].weight.detach().numpy().astype(np.float64).copy())
            default_loss(batch.run(model), batch.target).backward()
            opt.step()
            opt.zero_grad()
        pool = rec._staging_pool
    assert 1 <= pool.allocated < steps
    trace = hooktrace.load(tmp_path / "run")
    staged = trace.records.query("kind == 'param' and module == 'features.1' and slot == 'weight'")
    staged = staged.sort_values("step")
    assert staged["step"].tolist() == list(range(steps))
    np.testing.assert_allclose(staged["mean"], [w.mean() for w in weights], rtol=1e-12)
    np.testing.assert_allclose(staged["std"], [w.std() for w in weights], rtol=1e-9)
    assert staged["max"].tolist() == [w.max() for w in weights]


def test_inference_mode_before_training_does_not_break_staging(tmp_path: Path) -> None:
    """A validation pass under inference_mode made the first staging buffer an inference
    tensor, which training steps could not write: the recording stopped at step 0."""
    torch.manual_seed(0)
    model = make_model("SmallCNN")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = make_batch("SmallCNN", seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fault in the recorder warns
        with hooktrace.record(model, tmp_path / "run"):
            for step in range(4):
                if step in (0, 2):
                    model.eval()
                    with torch.inference_mode():
                        batch.run(model)
                    model.train()
                default_loss(batch.run(model), batch.target).backward()
                opt.step()
                opt.zero_grad()
    trace = hooktrace.load(tmp_path / "run")
    assert trace.steps["step"].tolist() == [0, 1, 2, 3]
    params = trace.records.query("kind == 'param' and phase == 'eval'")
    assert params["step"].unique().tolist() == [0, 2]  # staged inside inference mode


# --- layouts: what a step's records say apart from their values, built once ----------------


def test_steps_whose_records_line_up_share_one_layout() -> None:
    layouts = Layouts()
    made = []
    for step, tensors in enumerate(
        [
            [torch.tensor([1.0, 2.0]), torch.ones(2, 3)],
            [torch.tensor([5.0, 7.0]), torch.zeros(2, 3)],  # same records, other values
            [torch.tensor([1.0, 2.0, 3.0]), torch.ones(2, 3)],  # another shape
        ]
    ):
        pending = PendingStep(step, 0.0, staging=Staging(StagingPool()), layouts=layouts)
        _stage_all(pending, tensors)
        made.append(pending.materialize())
    first, second, third = (data.columns for data in made)
    assert layouts.built == 2
    for name in ("module", "shape", "numel", "seq", "call_spec"):
        assert first[name] is second[name], name  # shared, not rebuilt
        assert first[name] is not third[name], name
    assert second["mean"].tolist() == [6.0, 0.0] and second["step"].tolist() == [1, 1]
    assert third["shape"].to_pylist() == ["3", "2,3"] and third["numel"].tolist() == [3, 6]


def test_layouts_keep_only_the_most_recent() -> None:
    layouts = Layouts(keep=2)
    metas = [
        [Meta(0, "train", f"m{i}", 0, "output", "0", torch.float32, (i + 1,), 0, 0)]
        for i in range(3)
    ]
    built = [layouts.of(m) for m in metas]
    assert layouts.of(metas[2]) is built[2] and layouts.of(metas[1]) is built[1]
    assert layouts.of(metas[0]) is not built[0]  # pushed out by the two after it
    assert layouts.built == 4


@pytest.mark.parametrize("kernels", [True, False], ids=["compiled", "numpy"])
def test_histograms_made_together_and_one_by_one_come_out_in_row_order(
    kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kind's parameters are histogrammed in one call, queued as one block of rows (cut to
    their spans by the compiled kernel, whole rows by numpy); other records' histograms one
    by one (staged, or made in the hook). The step's histograms come out in row order, each
    with its own counts; sealing a step cut by a signal keeps only the whole records'
    histograms, of the blocks too."""
    from hooktrace.recorder.hooks.steps import seal
    from hooktrace.recorder.stats import histogram_kernel, numba_kernels

    route()
    if kernels:
        assert numba_kernels.histograms() is not None
    else:
        monkeypatch.setattr(numba_kernels, "histograms", lambda: None)
    step = PendingStep(0, 0.0, staging=Staging(StagingPool()))
    _stage_all(step, [torch.tensor([1.0, -2.0]), torch.tensor([0.0])] * 2)  # rows 0 to 3
    together = [torch.tensor([0.5, -8.0, 3.0, 0.0]), torch.tensor([2.0**-140, 1e30, -1.0])]
    if kernels:  # counted where they lie, cut to their spans there
        places = [(t.data_ptr(), t.numel(), histogram_kernel.FLOAT32, 0) for t in together]
        block: Any = histogram_kernel.histograms_at(np.array(places, dtype=np.int64))
    else:
        block = np.stack([reference(t.numpy()) for t in together])
    step.histogram_blocks.append((np.array([1, 3]), block))
    step.histograms.append((2, step.stats[2]))  # staged
    one = np.full(WIDTH, 7, dtype=np.int64)
    step.histograms.append((0, one))  # made in the hook
    rows, made = step._histograms()
    counts = whole_rows(made)
    assert rows.tolist() == [0, 1, 2, 3]
    assert counts[0].tolist() == one.tolist()
    assert counts[1].tolist() == reference(together[0].numpy()).tolist()
    assert counts[3].tolist() == reference(together[1].numpy()).tolist()
    assert counts[2].sum() == 2  # row 2, staged: its two values, 1.0 and -2.0

    step.meta.append(Meta(0, "train", "cut", 0, "output", "0", torch.float32, (1,), 0, 0))
    step.histogram_blocks.append((np.array([4, 5]), block))  # their statistics never came
    seal(step, micro_steps=1)
    rows, made = step._histograms()
    assert rows.tolist() == [0, 1, 2, 3] and whole_rows(made).tolist() == counts.tolist()


def test_a_recording_reuses_its_blocks_of_histogram_counts(tmp_path: Path) -> None:
    """The parameters' and the gradients' histograms are counted into a block each a step,
    from a pool the writer gives them back to (new ones each step cost the training thread
    page faults): each step's counts are still that step's, by the numpy definition."""
    torch.manual_seed(0)
    model = make_model("SmallCNN")
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # the weights move: stale counts show
    batch = make_batch("SmallCNN", seed=0)
    steps = 30
    weights = []
    with hooktrace.record(model, tmp_path / "run", histograms="param,grad_param") as rec:
        for _ in range(steps):
            weights.append(model.features[0].weight.detach().numpy().copy())
            default_loss(batch.run(model), batch.target).backward()
            opt.step()
            opt.zero_grad()
        pool = rec._counts_pool
    assert route_taken().description.startswith("one-pass")  # the kernels counted them
    assert 1 <= pool.allocated < 2 * steps  # reused (how often: how far the writer lags)
    trace = hooktrace.load(tmp_path / "run")
    counts = trace.histograms()
    counts = counts[(counts["kind"] == "param") & (counts["module"] == "features.0")]
    counts = counts[counts["slot"] == "weight"].sort_values("step")
    assert counts["step"].tolist() == list(range(steps))
    for weight, row in zip(weights, counts.itertuples(), strict=True):
        assert _flat(row).tolist() == reference(weight.astype(np.float64)).tolist()


def _flat(row: Any) -> np.ndarray:
    """A histogram table's row as the flat counts it was made from."""
    flat = np.zeros(WIDTH, dtype=np.int64)
    flat[[ZERO, NAN, POS_INF, NEG_INF]] = row.zero, row.nan, row.pos_inf, row.neg_inf
    flat[POS : POS + MAGNITUDE_BINS] = row.pos
    flat[NEG : NEG + MAGNITUDE_BINS] = row.neg
    return flat


def test_a_buffer_too_large_to_hold_is_made_to_measure() -> None:
    """It leaves the size the pool makes as it was: the smaller buffers are still reused
    (found in review: one large kind made every later buffer that large, and none kept)."""
    pool = StagingPool(keep_values=4096)
    small = pool.take(100)
    pool.give_back(small)
    large = pool.take(10_000)
    assert large.numel() == 10_000 and pool.capacity == 1024
    pool.give_back(large)  # not held
    assert pool.take(100) is small
    assert pool.allocated == 2


def test_a_script_whose_default_device_is_elsewhere_gets_its_histograms(tmp_path: Path) -> None:
    """torch.set_default_device: hooktrace's buffers are made on the CPU all the same (found
    in review: the pools' torch.empty took the script's default device)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    torch.set_default_device("meta")  # a device no buffer of hooktrace's could be read on
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a fault in the recorder warns
            with hooktrace.record(model, tmp_path / "run", histograms="param,grad_param"):
                for _ in range(3):
                    model(x).sum().backward()
                    opt.step()
                    opt.zero_grad()
    finally:
        torch.set_default_device(None)
    counts = hooktrace.load(tmp_path / "run").histograms()
    assert len(counts) == 3 * 4  # weight, bias and their gradients, at each of 3 steps
    counted = counts[["zero", "nan", "pos_inf", "neg_inf"]].sum(axis=1)
    counted += np.stack(counts["pos"]).sum(axis=1) + np.stack(counts["neg"]).sum(axis=1)
    assert (counted == counts["numel"]).all()
