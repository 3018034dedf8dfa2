"""Where a step begins and ends: a trace counts the steps that trained, as the script's own
log does, and an evaluation after a step's optimizer step is that step's (phase eval)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

import hooktrace
from hooktrace.analyze.overview.summary import summary


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
    # each step that trains has the parameters its training used (phase train); one that an
    # evaluation opened also has those the evaluation used (phase eval)
    params = records[records["kind"] == "param"]
    phases = params.groupby("step")["phase"].agg(lambda p: set(map(str, p))).to_dict()
    both = {"eval", "train"}
    assert phases == {
        0: {"train"},
        1: {"train"},
        2: both,
        3: {"train"},
        4: both,
        5: {"train"},
        6: {"eval"},
    }


def test_an_evaluation_at_the_start_records_the_parameters_it_used(tmp_path: Path) -> None:
    """An evaluation before a step's training (a sanity check, or with weights swapped in
    for it, as EMA callbacks do) records the parameters it used, phase eval; the step's
    training records its own, phase train."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        trained = model[0].weight.detach().clone()
        with torch.no_grad():
            model[0].weight.mul_(2)  # the evaluation's weights
        _evaluate(model)
        with torch.no_grad():
            model[0].weight.copy_(trained)
        for i in range(2):
            model(_batch(i)).sum().backward()
            opt.step()
            opt.zero_grad()
    records = _records(tmp_path / "run")
    weight = records[(records["kind"] == "param") & (records["module"] == "0")]
    weight = weight[weight["shape"] == "8,4"]
    by_phase = {(int(r.step), str(r.phase)): r.mean for r in weight.itertuples()}
    assert set(by_phase) == {(0, "eval"), (0, "train"), (1, "train")}
    assert by_phase[(0, "eval")] == pytest.approx(2 * trained.double().mean().item(), rel=1e-6)
    assert by_phase[(0, "train")] == pytest.approx(trained.double().mean().item(), rel=1e-6)


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


def test_an_optimizer_asked_before_its_parameters_are_known_is_owned_once_they_are() -> None:
    """Under ``hooktrace record``, LBFGS steps before its closure's forward makes the model
    known: a no given then must not stand for the rest of the run (it merged every later
    step into the first)."""
    from hooktrace.recorder.hooks.steps import Optimizers

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    param_ids: set[int] = set()
    owners = Optimizers(param_ids)
    assert not owners.owned(opt) and not owners.owned(other)
    param_ids.update(id(p) for p in model.parameters())  # the first forward names the model
    assert owners.owned(opt) and not owners.owned(other)
    param_ids.clear()  # a yes stands
    assert owners.owned(opt)


def test_an_unhashable_optimizer_steps_as_it_would_without_recording(tmp_path: Path) -> None:
    """An optimizer subclass with ``__eq__`` and no ``__hash__`` (a dataclass's) cannot key
    a cache: the recorder asks about it each time instead of failing its step (found in
    review)."""

    class Compared(torch.optim.SGD):
        def __eq__(self, other: object) -> bool:
            return self is other

    assert Compared.__hash__ is None
    model = nn.Linear(3, 2)
    opt = Compared(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        for _ in range(3):
            model(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert list(hooktrace.load(tmp_path / "run").steps["step"]) == [0, 1, 2]
