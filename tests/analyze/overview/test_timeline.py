"""Trace.timeline on real recordings, checked against the order and nesting that plain torch
hooks observe while the same step runs."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
import textwrap
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from models import REFERENCE_OUTPUTS, default_loss, make_batch, make_model
from repo import SAMPLES
from torch import nn

import hooktrace
from hooktrace.analyze.overview.timeline import largest_jumps, spans, timeline
from hooktrace.errors import TensorNotRecorded
from hooktrace.trace.reader import Trace


def _tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a nested value, in order: an independent walk, not hooktrace's."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _tensors(getattr(value, f.name))]
    return []


class Observed:
    """What plain torch hooks see during one forward and backward: calls as they start and
    end, with their depth and parent, and gradients of module outputs as they arrive."""

    def __init__(self, model: nn.Module, root: str) -> None:
        self.forward: list[tuple[str, int, str, int, str]] = []  # module, call, kind, depth, parent
        self.backward: list[tuple[str, int]] = []
        self._stack: list[tuple[str, int]] = []
        self._calls: dict[str, int] = {}
        self.handles = []
        for name, module in model.named_modules():
            name = name or root
            self.handles.append(
                module.register_forward_pre_hook(self._enter(name), with_kwargs=True)
            )
            self.handles.append(module.register_forward_hook(self._exit(name)))

    def _enter(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            parent = self._stack[-1][0] if self._stack else ""
            if _tensors((args, kwargs)):
                self.forward.append((name, call, "input", len(self._stack), parent))
            self._stack.append((name, call))

        return hook

    def _exit(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            _, call = self._stack.pop()
            parent = self._stack[-1][0] if self._stack else ""
            if _tensors(output):
                self.forward.append((name, call, "output", len(self._stack), parent))
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, key=(name, call): self.backward.append(key))

        return hook


def _record_one_step(name: str, run: Path, *, inputs: bool) -> tuple[Trace, Observed]:
    model = make_model(name)
    batch = make_batch(name)
    with hooktrace.record(model, run, inputs=inputs) as rec:
        observed = Observed(model, type(model).__name__)
        default_loss(batch.run(model), batch.target).backward()
        rec.step()
    for handle in observed.handles:
        handle.remove()
    return hooktrace.load(run), observed


def _calls(frame: Any) -> list[tuple[str, int, str, int, str]]:
    """Timeline rows as one event per call and kind (a call's slots are consecutive rows)."""
    events: list[tuple[str, int, str, int, str]] = []
    for r in frame.itertuples(index=False):
        event = (r.module, int(r.call), r.kind, int(r.depth), r.parent)
        if not events or events[-1] != event:
            events.append(event)
    return events


ZOO = ["ReferenceBlock", "SharedTwice", "RNNLoop", "DictOutput", "InplaceCNN", "TinyTransformer"]


@pytest.mark.parametrize("inputs", [True, False], ids=["inputs", "outputs-only"])
@pytest.mark.parametrize("name", ZOO)
def test_forward_nests_as_it_ran_then_gradients_in_arrival_order(
    run_dir: Path, name: str, inputs: bool
) -> None:
    trace, observed = _record_one_step(name, run_dir, inputs=inputs)
    frame = trace.timeline(0)
    passes = list(dict.fromkeys(frame["pass"]))
    assert passes == ["params", "forward", "backward"]
    assert frame["seq"].is_monotonic_increasing

    forward = frame[frame["pass"] == "forward"]
    expected = [e for e in observed.forward if inputs or e[2] == "output"]
    assert _calls(forward) == expected

    grads = frame[frame["kind"] == "grad_output"]
    assert list(zip(grads["module"], grads["call"], strict=True)) == observed.backward
    for row in grads.itertuples(index=False):  # a gradient sits where its call sat
        call = forward[(forward["module"] == row.module) & (forward["call"] == row.call)]
        assert (row.depth, row.parent) == (call["depth"].iloc[0], call["parent"].iloc[0])
    tail = frame[frame["seq"] > grads["seq"].max()]
    assert set(tail["kind"]) == {"grad_param"}


def test_nesting_depth_and_parents_of_a_known_model(run_dir: Path) -> None:
    trace, _ = _record_one_step("ReferenceBlock", run_dir, inputs=True)
    forward = trace.timeline(0).query("`pass` == 'forward'")
    assert [(r.module, r.kind, r.depth, r.parent) for r in forward.itertuples()] == [
        ("ReferenceBlock", "input", 0, ""),
        ("block", "input", 1, "ReferenceBlock"),
        ("block.fc1", "input", 2, "block"),
        ("block.fc1", "output", 2, "block"),
        ("block.relu1", "input", 2, "block"),
        ("block.relu1", "output", 2, "block"),
        ("block.fc2", "input", 2, "block"),
        ("block.fc2", "output", 2, "block"),
        ("block", "output", 1, "ReferenceBlock"),
        ("ReferenceBlock", "output", 0, ""),
    ]


class Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * 2


class CrossShared(nn.Module):
    """`a.0` is also called by `b`: its one name says `a`, the call stack says `b`."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Sequential(nn.Linear(4, 4))
        self.b = Wrapper(self.a[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


@pytest.mark.parametrize("inputs", [True, False], ids=["inputs", "outputs-only"])
def test_a_shared_module_nests_under_its_caller_when_inputs_were_recorded(
    run_dir: Path, inputs: bool
) -> None:
    model = CrossShared()
    with hooktrace.record(model, run_dir, inputs=inputs) as rec:
        model(torch.randn(3, 4)).sum().backward()
        rec.step()
    outputs = hooktrace.load(run_dir).timeline(0).query("kind == 'output'")
    where = {(r.module, r.call): (r.depth, r.parent) for r in outputs.itertuples()}
    assert where[("a.0", 0)] == (2, "a")
    # with inputs, the second call nests under `b`, its caller; without, under the root, one
    # level out (the module hierarchy puts `a.0` in `a`, which was not running then)
    assert where[("a.0", 1)] == ((2, "b") if inputs else (1, "CrossShared"))
    assert where[("b", 0)] == (1, "CrossShared")


class Watching(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hooktrace.watch(self.fc(x) * 3, "scaled")


def test_watched_tensors_nest_in_the_call_that_watched_them(run_dir: Path) -> None:
    model = nn.Sequential(Watching())
    with hooktrace.record(model, run_dir, inputs=True) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    frame = hooktrace.load(run_dir).timeline(0)
    tensor = frame[frame["kind"] == "tensor"].iloc[0]
    assert (tensor["depth"], tensor["parent"]) == (2, "0")
    assert tensor["gain"] == pytest.approx(3.0, rel=1e-5)  # fc's output, times 3
    grad = frame[frame["kind"] == "grad_tensor"].iloc[0]
    assert (grad["depth"], grad["parent"]) == (2, "0")


def test_micro_steps_and_an_eval_pass(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for _ in range(2):  # gradient accumulation: two backward passes per step
            model(torch.randn(3, 4)).sum().backward()
        with torch.no_grad():
            model(torch.randn(3, 4))
        opt.step()
    trace = hooktrace.load(run_dir)
    frame = trace.timeline(0)
    keys = zip(frame["pass"], frame["micro_step"], frame["phase"], strict=True)
    sections = [key for key, _ in itertools.groupby(keys)]
    assert sections == [
        ("params", 0, "train"),
        ("forward", 0, "train"),
        ("backward", 0, "train"),
        ("forward", 1, "train"),
        ("backward", 1, "train"),
        ("forward", 2, "eval"),
        ("backward", 1, "train"),  # grad_param: at the step's end, under its last micro-step
    ]
    second = trace.timeline(0, micro_step=1)
    assert set(second["micro_step"]) == {1} and "grad_param" in set(second["kind"])
    assert _calls(second[second["kind"] == "output"]) == [
        ("0", 0, "output", 1, "Sequential"),
        ("1", 0, "output", 1, "Sequential"),
        ("2", 0, "output", 1, "Sequential"),
        ("Sequential", 0, "output", 0, ""),
    ]
    with pytest.raises(TensorNotRecorded, match="has no micro-step 5: it has micro-steps 0–2"):
        trace.timeline(0, micro_step=5)


def test_gains_against_the_hand_worked_reference_values(run_dir: Path) -> None:
    trace, _ = _record_one_step("ReferenceBlock", run_dir, inputs=True)
    outputs = trace.timeline(0).query("kind == 'output'").set_index("module")["gain"]

    def rms(values: list[list[float]]) -> float:
        return float(np.sqrt(np.mean(np.square(values))))

    x = [[1.0, 1.0, 1.0]]
    assert outputs["block.fc1"] == pytest.approx(rms(REFERENCE_OUTPUTS["fc1"]) / rms(x))
    relu = rms(REFERENCE_OUTPUTS["relu1"]) / rms(REFERENCE_OUTPUTS["fc1"])
    assert outputs["block.relu1"] == pytest.approx(relu)
    fc2 = rms(REFERENCE_OUTPUTS["fc2"]) / rms(REFERENCE_OUTPUTS["relu1"])
    assert outputs["block.fc2"] == pytest.approx(fc2)
    # a container's output is its last child's: it changed nothing itself
    assert outputs["block"] == pytest.approx(1.0) and outputs["ReferenceBlock"] == 1.0
    jumps = largest_jumps(trace.timeline(0), top=2)
    assert list(zip(jumps["module"], jumps["kind"], strict=True)) == [
        ("block.fc1", "output"),
        ("block.fc2", "output"),
    ]


class NaNAfter(nn.Module):
    """Adds NaN to its input once `armed` is set."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (float("nan") if self.armed else 0.0)


def test_the_first_nonfinite_event_is_marked(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), NaNAfter(), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for step in range(3):
            model[1].armed = step == 1
            model(torch.randn(2, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(run_dir)
    assert not trace.timeline(0)["first_nonfinite"].any()
    frame = trace.timeline(1)
    first = frame[frame["first_nonfinite"]]
    assert len(first) == 1
    assert (first["module"].iloc[0], first["kind"].iloc[0]) == ("1", "output")
    assert not frame.loc[frame["seq"] < first["seq"].iloc[0], "nan_count"].any()
    later = trace.timeline(2)  # the NaN gradients of step 1 reached the parameters
    assert later[later["first_nonfinite"]]["kind"].tolist() == ["param"]


def test_steps_and_ranks_that_were_not_recorded(run_dir: Path) -> None:
    model = nn.Linear(2, 2)
    with hooktrace.record(model, run_dir, steps="0-2,5") as rec:
        for _ in range(6):
            model(torch.randn(1, 2)).sum().backward()
            rec.step()
    trace = hooktrace.load(run_dir)
    with pytest.raises(TensorNotRecorded, match=r"step 3 was not recorded .*: it has steps 0–2, 5"):
        trace.timeline(3)
    with pytest.raises(TensorNotRecorded, match=r"no records at rank 4 \(ranks: 0\)"):
        timeline(run_dir, 0, rank=4)
    assert spans([7, 1, 2, 3, 9, 10]) == "1–3, 7, 9–10" and spans([]) == "none"


def test_the_timeline_needs_no_torch(run_dir: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with hooktrace.record(model, run_dir, inputs=True) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    code = f"""
        import sys; sys.modules["torch"] = None
        import hooktrace
        frame = hooktrace.load({str(run_dir)!r}).timeline(0)
        print(len(frame), int(frame["depth"].max()))
        from hooktrace.cli import main
        main(["replay", {str(run_dir)!r}, "--step", "0"])
        """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    expected = hooktrace.load(run_dir).timeline(0)
    assert result.stdout.splitlines()[0] == f"{len(expected)} 1"
    assert "forward, micro-step 0 (train)" in result.stdout


@pytest.mark.parametrize(
    ("step", "rank"), [("x", 0), ("3", 0), (3, "0"), (True, 0), (2.5, 0), (float("inf"), 0)]
)
def test_a_step_or_rank_that_is_not_a_number_is_told_so(step: object, rank: object) -> None:
    """Found in review: ``timeline("x")`` was a ValueError of int()'s."""
    trace = hooktrace.load(SAMPLES / "healthy")
    with pytest.raises(hooktrace.TraceError, match=r"takes the (step|rank) as a whole number"):
        trace.timeline(step, rank=rank)  # type: ignore[arg-type]
    assert trace.timeline(3.0).equals(trace.timeline(3))  # (as before)
