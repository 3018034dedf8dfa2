"""Where a step begins and ends: a trace counts the steps that trained, as the script's own
log does, and an evaluation after a step's optimizer step is that step's (phase eval)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import torch
from torch import nn

import hooktrace
from hooktrace.analyze.summary import summary


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _batch(i: int) -> torch.Tensor:
    return torch.randn(6, 4, generator=torch.Generator().manual_seed(i))


def _evaluate(model: nn.Module, batches: int = 2) -> None:
    model.eval()
    with torch.no_grad():
        for j in range(batches):
            model(_batch(1000 + j))
    model.train()


def _records(run: Path) -> pd.DataFrame:
    return hooktrace.load(run).records


def test_a_trainer_loop_with_accumulation_and_evaluation(tmp_path: Path) -> None:
    """What transformers' Trainer and Lightning's loop do: two micro-steps per optimizer
    step, six optimizer steps, an evaluation right after every second optimizer step and
    one at the end. A step runs from one optimizer step to the next: an evaluation after an
    optimizer step opens the next step, and the one after the last opens a step that never
    trains, which summary shows apart from the six that trained."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with hooktrace.record(model, tmp_path / "run") as rec:
        for update in range(6):
            for micro in range(2):
                (model(_batch(10 * update + micro)).pow(2).mean() / 2).backward()
            opt.step()
            opt.zero_grad()
            if update % 2 == 1:
                _evaluate(model)
        _evaluate(model)
        assert rec.error is None
    steps = hooktrace.load(tmp_path / "run").steps
    assert list(steps["step"]) == [0, 1, 2, 3, 4, 5, 6]
    assert list(steps["micro_steps"]) == [2] * 6 + [0]
    found = summary(tmp_path / "run")
    assert (found.steps, found.first_step, found.last_step) == (6, 0, 5)
    assert found.evaluation_only == [6]
    assert found.micro_steps == 12
    records = _records(tmp_path / "run")
    evals = records[records["phase"] == "eval"]
    per_step = evals[(evals["module"] == "0") & (evals["kind"] == "output")]
    assert per_step.groupby("step").size().to_dict() == {2: 2, 4: 2, 6: 4}
    # parameters belong to the step they are trained in, though an evaluation found them
    params = records[records["kind"] == "param"]
    phases = params.groupby("step")["phase"].agg(lambda p: set(map(str, p))).to_dict()
    assert phases == {**{s: {"train"} for s in range(6)}, 6: {"eval"}}


def test_an_evaluation_at_the_start_files_parameters_under_train(tmp_path: Path) -> None:
    """Parameters belong to the step they are trained in: an evaluation before the first
    training forward records them, and they are filed under phase train."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        _evaluate(model)  # before any training: step 0's
        for i in range(2):
            model(_batch(i)).sum().backward()
            opt.step()
            opt.zero_grad()
    records = _records(tmp_path / "run")
    params = records[records["kind"] == "param"]
    assert list(params.groupby("step").size()) == [4, 4]
    assert set(params["phase"]) == {"train"}
    first = records[records["step"] == 0]
    # the evaluation's records came first, in execution order, and kept their phase
    assert list(first.loc[first["kind"] == "output", "phase"])[:3] == ["eval"] * 3


def test_inference_steps_end_at_once(tmp_path: Path) -> None:
    """A step that did not train (no backward pass) ends when marked: forwards after it are
    the next step's."""
    model = _model()
    with hooktrace.record(model, tmp_path / "run") as rec, torch.no_grad():
        for i in range(3):
            model(_batch(i))
            rec.step()
    records = _records(tmp_path / "run")
    assert sorted(records["step"].unique()) == [0, 1, 2]
    outputs = records[records["kind"] == "output"]
    assert list(outputs.groupby("step").size()) == [4, 4, 4]
    assert set(outputs["phase"]) == {"eval"}


def test_a_recording_that_saw_training_but_wrote_no_step_is_not_complete(tmp_path: Path) -> None:
    recorded, trained = _model(), _model()
    opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    with hooktrace.record(recorded, tmp_path / "run"):
        for i in range(3):
            trained(_batch(i)).sum().backward()
            opt.step()
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "incomplete"
    assert trace.manifest["ranks"]["0"]["error"] == (
        "an optimizer stepped 3 time(s), but no recorded model holds its parameters: "
        "nothing was recorded"
    )
