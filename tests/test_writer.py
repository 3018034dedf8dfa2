"""The background writer: backpressure and what is dropped, through real recordings."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner
from torch import nn

import hooktrace
from hooktrace.cli import cli


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
