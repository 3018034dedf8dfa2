"""The background writer: backpressure and what is dropped, through real recordings."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from click.testing import CliRunner
from torch import nn

import hooktrace
from hooktrace.cli import cli
from hooktrace.trace import crash_safe
from hooktrace.trace.crash_safe import _Sink
from hooktrace.trace.step_data import StepData, _concat
from hooktrace.trace.writer import HOLD_BYTES, TraceWriter


def _train(run: Path, steps: int = 6, **options: object) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hooktrace.record(model, run, **options):
        for _ in range(steps):
            model(torch.randn(256, 256)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_a_writer_that_falls_behind_makes_training_wait_and_loses_nothing(tmp_path: Path) -> None:
    # gzip on full tensors is slow; a buffer of one byte admits one step at a time
    _train(tmp_path / "run", full_every=1, compression="gzip", buffer_mb=1e-6)
    trace = hooktrace.load(tmp_path / "run")
    status = json.loads((tmp_path / "run" / "status" / "rank=0.json").read_text())
    assert status["writer_blocked_seconds"] > 0
    assert status["steps_lost"] == 0
    assert list(trace.steps["step"]) == list(range(6))
    assert (trace.steps["full_tensors"] == trace.steps["records"]).all()


def test_tensors_over_the_size_limit_are_counted_and_reported(tmp_path: Path) -> None:
    _train(tmp_path / "run", steps=2, full_every=1, max_tensor_mb=0.3)  # 256x512 floats = 0.5 MB
    trace = hooktrace.load(tmp_path / "run")
    assert (trace.steps["dropped"] > 0).all()
    records = trace.records
    big = records[(records["module"] == "0") & (records["kind"] == "output")]
    assert (big["tensor_key"] == "").all() and big["mean"].notna().all()  # statistics kept
    small = records[
        (records["module"] == "2") & (records["kind"] == "param") & (records["slot"] == "bias")
    ]
    assert (small["tensor_key"] != "").all()
    result = CliRunner().invoke(cli, ["check", str(tmp_path / "run")])
    assert result.exit_code == 0
    assert "full tensor(s) were not saved: larger than max_tensor_mb" in result.output


class _Step:
    """A minimal PendingStep: one record, one full tensor of ``size`` bytes."""

    def __init__(self, step: int, size: int = 1 << 16) -> None:
        self.step, self.nbytes, self.size = step, size, size

    def materialize(self) -> StepData:
        columns: dict[str, object] = {
            "step": np.array([self.step]), "micro_step": np.zeros(1, np.int32), "phase": ["train"],
            "seq": np.zeros(1, np.int64), "module": ["m"], "call": np.zeros(1, np.int32),
            "kind": ["output"], "slot": ["0"], "dtype": ["uint8"], "shape": [str(self.size)],
            "numel": np.array([self.size]), "mean": np.zeros(1), "std": np.zeros(1), "min": np.zeros(1),
            "max": np.zeros(1), "norm": np.zeros(1), "zero_fraction": np.ones(1),
            "nan_count": np.zeros(1, np.int64), "inf_count": np.zeros(1, np.int64),
            "units": np.zeros(1, np.int32), "unit_size": np.zeros(1, np.int64),
        }  # fmt: skip
        data = np.zeros(self.size, np.uint8)
        return StepData(self.step, 1, False, 0.0, 0.0, columns, tensors=[(0, data, "uint8")])


def test_a_blocked_submit_wakes_the_writer_instead_of_waiting_for_its_timer(tmp_path: Path) -> None:
    # with a timer of an hour, only the wake-up (or the byte threshold) can flush
    writer = TraceWriter(
        tmp_path / "run", flush_seconds=3600, max_buffer_bytes=1, flush_bytes=1 << 40
    )
    submitter = threading.Thread(
        target=lambda: [writer.submit(_Step(i)) for i in range(4)], daemon=True
    )
    submitter.start()
    submitter.join(timeout=60)  # hang detection, not a timing assertion
    assert not submitter.is_alive(), "submit() waited for the flush timer"
    writer.close("complete")
    assert writer.steps_written == 4 and writer.blocked_seconds > 0


def test_full_tensors_are_flushed_by_size_before_the_timer(tmp_path: Path) -> None:
    writer = TraceWriter(tmp_path / "run", flush_seconds=3600, flush_bytes=1 << 17)
    parts = tmp_path / "run" / "records" / "rank=0"
    for flushes in (1, 2):
        for i in range(2):
            writer.submit(_Step(2 * flushes + i))  # 64 kB each: a flush every second step
        deadline = time.monotonic() + 60  # hang detection, not a timing assertion
        while len(list(parts.glob("part-*.parquet"))) < flushes and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(list(parts.glob("part-*.parquet"))) == flushes  # while the run goes on
    writer.close("complete")
    assert writer.steps_written == 4


class _Weighed(_Step):
    """A step submitted as ``nbytes`` (what it holds in the recorder: a step's histograms are
    megabytes of counts there) that holds little once materialised (their spans)."""

    def __init__(self, step: int, nbytes: int, made: list[int]) -> None:
        super().__init__(step, size=16)
        self.nbytes, self.made = nbytes, made

    def materialize(self) -> StepData:
        self.made.append(self.step)
        return super().materialize()


def test_a_flush_by_size_weighs_what_the_steps_hold_once_materialised(tmp_path: Path) -> None:
    """Steps submitted as megabytes that hold bytes once in the writer are not flushed by
    size, nor do they weigh on the back-pressure once taken (found measuring: the 200-layer
    model's histograms, 3.6 MB a step in the pool, flushed every ninth step, a few
    milliseconds of fixed cost a flush, where the timer would have flushed every
    thirtieth)."""
    writer = TraceWriter(tmp_path / "run", flush_seconds=3600, flush_bytes=1 << 19)
    made: list[int] = []
    for i in range(8):
        writer.submit(_Weighed(i, nbytes=1 << 20, made=made))  # wakes the writer: 1 MB
        deadline = time.monotonic() + 60  # hang detection, not a timing assertion
        while len(made) <= i and time.monotonic() < deadline:
            time.sleep(0.001)
    deadline = time.monotonic() + 60  # hang detection, not a timing assertion
    while writer._pending_bytes >= 1 << 20 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert writer._pending_bytes < 1 << 20  # 8 MB submitted, a few hundred bytes held
    writer.close("complete")
    parts = list((tmp_path / "run" / "records" / "rank=0").glob("part-*.parquet"))
    assert len(parts) == 1  # the flush at close
    assert writer.steps_written == 8 and _steps_on_disk(tmp_path / "run") == list(range(8))


class _Failing(_Step):
    def materialize(self) -> StepData:
        raise ValueError("cannot read this step")


class _Counted(_Step):
    """A small step that notes, in ``made``, when the writer materialises it."""

    def __init__(self, step: int, made: list[int], size: int = 16) -> None:
        super().__init__(step, size)
        self.made = made

    def materialize(self) -> StepData:
        self.made.append(self.step)
        return super().materialize()


def test_steps_are_taken_a_few_at_a_time_and_all_written_in_order(tmp_path: Path) -> None:
    """The training thread wakes the writer once for every few steps, not once a step."""
    made: list[int] = []
    writer = TraceWriter(tmp_path / "run", flush_seconds=3600, hold_steps=3, flush_bytes=1 << 40)
    wakes: list[object] = []  # what the training thread puts on the writer's queue
    put = writer._queue.put

    def counted_put(item: object, *args: Any, **kwargs: Any) -> None:
        wakes.append(item)
        put(item, *args, **kwargs)

    writer._queue.put = counted_put
    for i in range(2):
        writer.submit(_Counted(i, made))
    assert wakes == [] and made == [] and len(writer._incoming) == 2
    writer.submit(_Counted(2, made))  # the third wakes it
    assert len(wakes) == 1
    deadline = time.monotonic() + 60  # hang detection, not a timing assertion
    while len(made) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made == [0, 1, 2]
    for i in range(3, 7):
        writer.submit(_Counted(i, made))
    writer.close("complete")  # takes what is left
    assert made == list(range(7)) and writer.steps_written == 7 and writer.steps_lost == 0
    assert _steps_on_disk(tmp_path / "run") == list(range(7))


def test_a_large_step_is_materialised_without_waiting_for_others(tmp_path: Path) -> None:
    """Holding steps saves time on small ones; a step of full tensors is not held."""
    made: list[int] = []
    writer = TraceWriter(tmp_path / "run", flush_seconds=3600, hold_steps=100, flush_bytes=1 << 40)
    writer.submit(_Counted(0, made))
    writer.submit(_Counted(1, made, size=HOLD_BYTES))
    deadline = time.monotonic() + 60  # hang detection, not a timing assertion
    while len(made) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert made == [0, 1] and not writer._incoming
    writer.close("complete")
    assert writer.steps_written == 2


def test_a_step_that_cannot_be_materialised_is_counted_lost_with_those_after_it(
    tmp_path: Path,
) -> None:
    # 16 bytes a step, a flush every 32: the first two reach the disk before the failure
    writer = TraceWriter(tmp_path / "run", flush_seconds=3600, hold_steps=2, flush_bytes=32)
    writer.submit(_Step(0, 16))
    writer.submit(_Step(1, 16))
    deadline = time.monotonic() + 60  # hang detection, not a timing assertion
    while writer.steps_written < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    writer.submit(_Failing(2, 16))
    writer.submit(_Step(3, 16))
    problem = writer.close("complete", warn=False)
    assert isinstance(writer.error, ValueError)
    assert writer.steps_written == 2 and writer.steps_lost == 2
    assert problem is not None and "2 step(s) were not written" in problem
    assert _steps_on_disk(tmp_path / "run") == [0, 1]


def _steps_on_disk(run: Path) -> list[int]:
    parts = sorted((run / "steps" / "rank=0").glob("part-*.parquet"))
    return [step for part in parts for step in pq.read_table(part).column("step").to_pylist()]


class _ShortWrites(io.FileIO):
    """A file whose writes take at most 1,000 bytes at a time, as an unbuffered write may."""

    def write(self, data: Any) -> int:
        return super().write(memoryview(data).cast("B")[:1000])


def test_a_segment_written_in_short_writes_is_whole(tmp_path: Path) -> None:
    values = np.arange(100_000, dtype=np.float32).reshape(250, 400)
    path = tmp_path / "segment.h5"
    with (
        _ShortWrites(path, "w+b") as raw,
        _Sink(raw) as sink,
        h5py.File(sink, "w", libver=("v110", "latest")) as f,
    ):
        f.create_dataset("t/0", data=values)
    with h5py.File(path, "r") as f:
        np.testing.assert_array_equal(f["t/0"][()], values)


def test_columns_shared_by_steps_are_repeated_whole() -> None:
    """A layout's column is one object that many steps point to: repeated as a whole, it
    must read back as the steps' values one after the other, lists and arrays alike."""
    names = pa.array(["a", "b"], type=pa.dictionary(pa.int32(), pa.string()))
    other = pa.array(["c"], type=pa.dictionary(pa.int32(), pa.string()))
    parts = [names, names, other, ["d", "a"], names]
    assert _concat(parts).to_pylist() == ["a", "b", "a", "b", "c", "d", "a", "a", "b"]
    numbers = np.array([1, 2])
    assert _concat([numbers, numbers, np.array([3]), numbers]).tolist() == [1, 2, 1, 2, 3, 1, 2]
    assert _concat([["x"], ["x"], ["y"]]) == ["x", "x", "y"]


def test_training_evaluation_and_full_steps_read_back_record_by_record(tmp_path: Path) -> None:
    """Steps of two layouts (training, and training after an evaluation pass) in one flush,
    and full steps whose call specs are their own: every record where it belongs."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    outputs = {}
    with hooktrace.record(model, tmp_path / "run", full_steps=[1, 4], inputs=True):
        for step in range(6):
            if step % 2:
                model.eval()
                with torch.no_grad():
                    model(x)
                model.train()
            out = model(x)
            outputs[step] = out.detach().numpy().astype(np.float64)
            out.pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    records = hooktrace.load(tmp_path / "run").records
    for step in range(6):
        rows = records[records["step"] == step].sort_values("seq")
        assert rows["seq"].tolist() == list(range(len(rows)))
        phases = set(rows.loc[rows["kind"] == "output", "phase"])
        assert phases == ({"eval", "train"} if step % 2 else {"train"}), step
        head = rows[(rows["module"] == "2") & (rows["kind"] == "output")]
        assert head["phase"].tolist()[-1] == "train" and head["shape"].tolist()[-1] == "5,2"
        np.testing.assert_allclose(head["mean"].tolist()[-1], outputs[step].mean(), rtol=1e-6)
        specs = rows.loc[rows["call_spec"] != "", "module"].tolist()
        assert bool(specs) == (step in (1, 4)), step


def test_a_write_whose_directory_is_moved_away_mid_write_leaves_no_temporary_file(
    tmp_path: Path,
) -> None:
    """Found by CI (tests/reliability/test_disk.py, now and then): the records directory
    moved away and replaced by a file while a part was written left the part's temporary
    file in the moved directory, where its path no longer led."""
    folder, moved = tmp_path / "rank=0", tmp_path / "moved"
    folder.mkdir()
    tmp = folder / ".part-000001.parquet.tmp"
    with pytest.raises(NotADirectoryError), crash_safe.removed_on_failure(tmp):
        tmp.write_bytes(b"half a part")
        os.rename(folder, moved)
        folder.write_text("not a directory\n")
        os.replace(tmp, folder / "part-000001.parquet")  # as the write's last act
    assert list(moved.iterdir()) == []
