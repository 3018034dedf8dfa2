"""hooktrace.anomalies on real recordings of models with planted faults, and their healthy twin.

Each fault is planted at a known module and step of a seeded SGD run; the test checks that it
is found there, exactly, and that nothing else is reported. Reference numbers (gradient norms)
come from plain torch in the training loop, not from hooktrace.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from nonfinite_runs import Log, Sqrt, record_run, source_line
from recorded_runs import MLP, InfBackward, NaNForward, ZeroFrom, train
from repo import SAMPLES
from scale_runs import generate_trace
from torch import nn

import hooktrace
from hooktrace.errors import ConfigError


def of_kind(found: hooktrace.analyze.checks.anomalies.Anomalies, kind: str) -> pd.DataFrame:
    frame = found.findings
    return frame[frame["kind"] == kind].reset_index(drop=True)


def kinds_and_modules(found: hooktrace.analyze.checks.anomalies.Anomalies) -> set[tuple[str, str]]:
    return set(zip(found.findings["kind"], found.findings["module"], strict=True))


# --- 6. the healthy baseline -----------------------------------------------------------------


def test_healthy_run_has_no_findings(tmp_path: Path) -> None:
    train(MLP(), tmp_path / "run", steps=40)
    found = hooktrace.anomalies(tmp_path / "run")
    assert len(found) == 0, found.findings.to_string()
    assert found.steps == 40 and found.notes == []
    assert list(found.findings.columns)[:6] == [
        "kind",
        "severity",
        "module",
        "slot",
        "rank",
        "step",
    ]


# --- 2. NaN born in a forward pass -----------------------------------------------------------


@pytest.mark.parametrize("inputs", [False, True])
def test_forward_nan_origin_is_the_module_that_made_it(tmp_path: Path, inputs: bool) -> None:
    train(MLP(NaNForward()), tmp_path / "run", steps=12, arm_at=5, inputs=inputs)
    found = hooktrace.anomalies(tmp_path / "run")

    forward = of_kind(found, "nonfinite_forward")
    assert forward[["module", "step", "last_step", "micro_step", "slot"]].values.tolist() == [
        ["fault", 5, 5, 0, "0"]
    ]
    assert forward["severity"][0] == "error"
    evidence = forward["evidence"][0]
    assert evidence.startswith("fault output 0:") and " NaN" in evidence
    assert (
        "after fault input 0 (finite)" if inputs else "after relu1 output 0 (finite)"
    ) in evidence
    assert "non-finite record(s) followed" in evidence  # fc2, relu2, fc3 and the root
    # the update of step 5 wrote NaN into every parameter: from step 6 the forward starts there
    params = of_kind(found, "nonfinite_param")
    assert params[["module", "slot", "step", "last_step"]].values.tolist() == [
        ["fc1", "weight", 6, 11]
    ]
    # the backward of a NaN loss and the NaN forwards that NaN weights explain are not repeated
    assert set(found.findings["kind"]) == {"nonfinite_forward", "nonfinite_param"}


def test_forward_nan_in_a_later_micro_step(tmp_path: Path) -> None:
    model = MLP(NaNForward())
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        for step in range(6):
            for micro_step in range(2):
                model.fault.armed = (step, micro_step) == (3, 1)
                F.cross_entropy(model(torch.randn(8, 16)), torch.randint(0, 4, (8,))).backward()
            opt.step()
            opt.zero_grad()
    forward = of_kind(hooktrace.anomalies(tmp_path / "run"), "nonfinite_forward")
    assert forward[["module", "step", "micro_step"]].values.tolist() == [["fault", 3, 1]]


# --- 3. Inf born in a backward pass ----------------------------------------------------------


def test_backward_inf_origin_is_the_module_whose_backward_made_it(tmp_path: Path) -> None:
    train(MLP(InfBackward()), tmp_path / "run", steps=10, arm_at=4)
    found = hooktrace.anomalies(tmp_path / "run")

    backward = of_kind(found, "nonfinite_backward")
    assert backward[["module", "step", "last_step", "micro_step"]].values.tolist() == [
        ["fault", 4, 4, 0]
    ]
    # the gradient at fault's output was finite; fault's backward made the one at its input
    # (relu1's output) infinite
    assert backward["evidence"][0].startswith("relu1 grad_output 0:")
    assert (
        "Inf" in backward["evidence"][0]
        and "after fault grad_output 0 (finite)" in backward["evidence"][0]
    )
    assert "the backward of fault" in backward["explanation"][0]
    assert of_kind(found, "nonfinite_forward").empty  # step 4's forward was finite
    params = of_kind(found, "nonfinite_param")
    assert params[["module", "step"]].values.tolist() == [["fc1", 5]]


# --- 4. a learning rate far too high ---------------------------------------------------------


def first_step_above(norms: list[float], factor: float = 10.0) -> int | None:
    """The documented start, computed here from torch's norms: the first step whose norm is
    ``factor`` x the median (in log scale) of the ones before, moved back over the steps just
    before it that were already sqrt(factor) x that median."""
    for step in range(1, len(norms)):
        baseline = 10 ** np.median(np.log10([n for n in norms[:step] if n > 0]))
        if norms[step] > factor * baseline:
            while step > 1 and norms[step - 1] >= np.sqrt(factor) * baseline:
                step -= 1
            return step
    return None


def test_learning_rate_far_too_high_explodes(tmp_path: Path) -> None:
    norms = train(MLP(), tmp_path / "run", steps=20, lr=50.0)
    found = hooktrace.anomalies(tmp_path / "run")

    exploding = of_kind(found, "exploding_gradient").set_index("module")
    assert sorted(exploding.index) == ["fc1", "fc2", "fc3"]
    for module in ("fc1", "fc2", "fc3"):
        start = first_step_above(norms[module])
        assert start is not None and start <= 2
        assert exploding.loc[module, "step"] == start, module
        assert exploding.loc[module, "severity"] == "error"
        peak, baseline = exploding.loc[module, "value"], exploding.loc[module, "reference"]
        assert peak / baseline >= 100
        last = exploding.loc[module, "last_step"]
        assert peak == pytest.approx(max(norms[module][start : last + 1]), rel=1e-4)
        assert baseline == pytest.approx(norms[module][0], rel=1e-4)


def test_a_one_step_jump_is_a_spike_not_an_explosion(tmp_path: Path) -> None:
    def jump(step: int, x: torch.Tensor) -> torch.Tensor:
        return x * 1000 if step == 20 else x

    # the update of that step is skipped: the jump stays one step, as a bad batch would be
    norms = train(MLP(), tmp_path / "run", steps=30, before_step=jump, frozen_at=20)
    found = hooktrace.anomalies(tmp_path / "run")
    # every Linear's gradient and every module's output jumped at that step, and only then;
    # the root's output (fc3's) and the Identity's (relu1's) are not reported twice
    assert kinds_and_modules(found) - {("fp16_underflow", "fc2"), ("fp16_underflow", "fc3")} == {
        *(("gradient_spike", m) for m in ("fc1", "fc2", "fc3")),
        *(("activation_spike", m) for m in ("fc1", "relu1", "fc2", "relu2", "fc3")),
    }
    # the jump saturates the softmax: at that step, and only then, a few percent of the last
    # layers' gradients fall below 2^-24, which float16 would flush to zero
    underflow = of_kind(found, "fp16_underflow")
    assert sorted(underflow["module"]) == ["fc2", "fc3"]
    assert set(found.findings["step"]) == {20} and set(found.findings["last_step"]) == {20}
    assert set(underflow["severity"]) == {"info"}  # under a tenth of them
    assert set(found.findings["severity"]) - {"info"} == {"warning"}
    fc1 = of_kind(found, "gradient_spike").set_index("module").loc["fc1"]
    assert fc1["value"] == pytest.approx(norms["fc1"][20], rel=1e-4)
    assert fc1["reference"] == pytest.approx(
        10 ** np.median(np.log10(norms["fc1"][:20])), rel=1e-4
    )  # the baseline: the median of the 20 steps before


def test_vanishing_gradients_below_the_bound(tmp_path: Path) -> None:
    train(MLP(), tmp_path / "run", steps=10, loss_scale=1e-9)
    found = hooktrace.anomalies(tmp_path / "run")
    vanishing = of_kind(found, "vanishing_gradient")
    assert sorted(vanishing["module"]) == ["fc1", "fc2", "fc3"]
    assert set(vanishing["step"]) == {0} and set(vanishing["count"]) == {10}
    # gradients that small are below float16's smallest subnormal too (2^-24, about 6e-8)
    assert set(found.findings["kind"]) == {"vanishing_gradient", "fp16_underflow"}
    assert sorted(of_kind(found, "fp16_underflow")["module"]) == ["fc1", "fc2", "fc3"]
    # the same run against a lower bound: nothing vanishes
    lower = hooktrace.anomalies(tmp_path / "run", vanishing_below=1e-12)
    assert set(lower.findings["kind"]) == {"fp16_underflow"}


# --- 5. parameters that never get a gradient, and zero gradients -----------------------------


class FrozenAndUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(16, 32).requires_grad_(False)
        self.relu = nn.ReLU()
        self.fc = nn.Linear(32, 4)
        self.unused = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.relu(self.frozen(x)))


def test_unused_parameters_never_get_a_gradient_and_frozen_ones_are_not_asked_for_one(
    tmp_path: Path,
) -> None:
    """A parameter that requires a gradient and never gets one is a finding; a frozen one
    (requires_grad False) gets none by design: no grad_param record, no finding."""
    train(FrozenAndUnused(), tmp_path / "run", steps=8)
    found = hooktrace.anomalies(tmp_path / "run")
    assert kinds_and_modules(found) == {("no_gradient", "unused")}
    rows = of_kind(found, "no_gradient")
    assert set(rows["slot"]) == {"bias, weight"} and set(rows["count"]) == {8}
    assert set(rows["severity"]) == {"warning"}
    assert "never gets a gradient" in rows["explanation"][0]
    records = hooktrace.load(tmp_path / "run").query(columns=["module", "kind"])
    kinds = records.groupby("module")["kind"].agg(set)
    assert kinds["frozen"] == {"output", "param"}  # its output needs no gradient either
    assert "grad_param" in kinds["fc"] and "grad_param" in kinds["unused"]


def test_an_ema_copy_evaluated_each_step_is_healthy(tmp_path: Path) -> None:
    """The EMA pattern: a deep copy whose parameters require no gradient, updated from the
    model's and evaluated after every step. Its parameters are recorded, never a gradient
    of theirs, and nothing is reported."""
    torch.manual_seed(0)
    model = MLP()
    ema = copy.deepcopy(model).requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    with hooktrace.record({"model": model, "ema": ema}, tmp_path / "run"):
        for _ in range(4):
            x = torch.randn(32, 16, generator=generator)
            F.cross_entropy(model(x), x[:, :4].argmax(dim=1)).backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for averaged, current in zip(ema.parameters(), model.parameters(), strict=True):
                    averaged.lerp_(current, 0.1)
                ema(x)
    found = hooktrace.anomalies(tmp_path / "run")
    assert found.findings.empty, found.findings[["kind", "module"]]
    records = hooktrace.load(tmp_path / "run").query(columns=["module", "kind", "phase"])
    ema_records = records[records["module"].str.startswith("ema")]
    assert set(ema_records["kind"]) == {"output", "param"}
    assert set(ema_records.loc[ema_records["kind"] == "output", "phase"]) == {"eval"}
    assert (records["kind"] == "grad_param").sum() == 4 * 6  # the model's 6, each step


def test_gradients_exactly_zero(tmp_path: Path) -> None:
    train(MLP(ZeroFrom()), tmp_path / "run", steps=12, arm_at=7)
    found = hooktrace.anomalies(tmp_path / "run")
    zero = of_kind(found, "zero_gradient").set_index("module")
    # fc1 gets nothing; fc2's weight sees a zero input, its bias still gets a gradient
    assert zero.loc[["fc1", "fc2"], "slot"].tolist() == ["bias, weight", "weight"]
    assert zero["step"].tolist() == [7, 7] and zero["count"].tolist() == [5, 5]
    assert set(zero["severity"]) == {"info"}


# --- saturated tanh and sigmoid --------------------------------------------------------------


@pytest.mark.parametrize("act", [nn.Tanh, nn.Sigmoid])
def test_saturated_activations(tmp_path: Path, act: type[nn.Module]) -> None:
    model = MLP(act=act)
    with torch.no_grad():
        model.fc1.weight.mul_(100)
    train(model, tmp_path / "run", steps=6, lr=0.01)
    found = hooktrace.anomalies(tmp_path / "run")
    saturated = of_kind(found, "saturated")
    assert saturated[["module", "step", "count"]].values.tolist() == [["relu1", 0, 6]]
    assert saturated["value"][0] >= 0.95


@pytest.mark.parametrize("act", [nn.Tanh, nn.Sigmoid])
def test_healthy_tanh_and_sigmoid_are_not_saturated(tmp_path: Path, act: type[nn.Module]) -> None:
    train(MLP(act=act), tmp_path / "run", steps=6)
    assert of_kind(hooktrace.anomalies(tmp_path / "run"), "saturated").empty


# --- options, chunks, errors ------------------------------------------------------------------


def test_chunks_and_step_ranges(tmp_path: Path) -> None:
    train(MLP(NaNForward()), tmp_path / "run", steps=12, arm_at=5)
    whole = hooktrace.anomalies(tmp_path / "run").findings
    chunked = hooktrace.anomalies(tmp_path / "run", chunk_rows=25).findings  # ~1 step a chunk
    pd.testing.assert_frame_equal(whole, chunked)
    assert len(hooktrace.anomalies(tmp_path / "run", steps="0-4")) == 0
    later = hooktrace.anomalies(hooktrace.load(tmp_path / "run"), steps=(5, 11)).findings
    assert later["kind"].tolist() == ["nonfinite_forward", "nonfinite_param"]
    as_numpy = hooktrace.anomalies(tmp_path / "run", steps=(np.int64(5), np.int64(11))).findings
    pd.testing.assert_frame_equal(as_numpy, later)
    assert len(hooktrace.anomalies(tmp_path / "run", steps=[5])) == 1


def test_a_step_of_two_ranks_is_counted_once(tmp_path: Path) -> None:
    """A 2-rank run of 10 steps was said to span 20 steps, where ``summary`` said 10."""
    for rank in (0, 1):
        generate_trace(tmp_path / "run", steps=10, modules=4, rank=rank, world_size=2)
    assert hooktrace.anomalies(tmp_path / "run").steps == 10
    assert hooktrace.anomalies(tmp_path / "run", chunk_rows=8).steps == 10  # a chunk a step
    assert hooktrace.anomalies(tmp_path / "run", steps="2-4").steps == 3


@pytest.mark.parametrize(
    "options",
    [
        {"window": 1},
        {"spike_factor": 1.0},
        {"explode_factor": 2.0},
        {"saturation": 0.0},
        {"steps": "a-b"},
    ],
)
def test_bad_options_raise_config_error(tmp_path: Path, options: dict[str, Any]) -> None:
    train(MLP(), tmp_path / "run", steps=2)
    with pytest.raises(ConfigError):
        hooktrace.anomalies(tmp_path / "run", **options)


def test_without_a_steps_table_everything_is_still_read(tmp_path: Path) -> None:
    """The chunk plan comes from the steps table; a trace whose steps parts are lost (a crash
    between two files of a flush) is still read whole, in one chunk."""
    train(MLP(NaNForward()), tmp_path / "run", steps=12, arm_at=5)
    expected = hooktrace.anomalies(tmp_path / "run", chunk_rows=25).findings
    for part in (tmp_path / "run" / "steps").rglob("*.parquet"):
        part.unlink()
    assert hooktrace.load(tmp_path / "run").steps.empty
    pd.testing.assert_frame_equal(
        hooktrace.anomalies(tmp_path / "run", chunk_rows=25).findings, expected
    )
    assert len(hooktrace.dead_relus(tmp_path / "run").layers) == 2


# --- 7. what the recorder captured where a NaN or Inf began ---------------------------------


def test_a_forward_origin_names_the_captured_operation_and_line(tmp_path: Path) -> None:
    run = record_run(Log(), tmp_path / "run")
    found = hooktrace.anomalies(run)
    file, line = source_line("LOG_LINE")
    forward = of_kind(found, "nonfinite_forward")
    assert forward[["module", "step"]].values.tolist() == [["fault", 0]]
    assert forward["capture"][0] == (
        f"captured: aten::log at {file}:{line} (capture 0); hooktrace replay {run} --nonfinite"
    )
    others = found.findings[found.findings["kind"] != "nonfinite_forward"]
    assert not others.empty and (others["capture"] == "").all()  # nonfinite_param: its own
    pd.testing.assert_frame_equal(found.captures, hooktrace.load(run).nonfinite_captures())
    assert found.notes == []


def test_a_backward_origin_over_steps_takes_their_first_capture(tmp_path: Path) -> None:
    run = record_run(Sqrt(), tmp_path / "run")
    found = hooktrace.anomalies(run)
    file, line = source_line("SQRT_LINE")
    backward = of_kind(found, "nonfinite_backward")
    assert backward[["module", "step", "last_step"]].values.tolist() == [["fault", 0, 2]]
    assert backward["capture"][0] == (
        f"captured: aten::div.Tensor in SqrtBackward0 at {file}:{line} (capture 0, and 2 more "
        f"in these steps); hooktrace replay {run} --nonfinite"
    )


def test_captures_at_other_steps_are_still_pointed_at(tmp_path: Path) -> None:
    run = record_run(Sqrt(), tmp_path / "run", capture_limit=1)  # step 0 only
    found = hooktrace.anomalies(run, steps="1-2")
    file, line = source_line("SQRT_LINE")
    assert of_kind(found, "nonfinite_backward")["capture"].tolist() == [
        f"not captured in steps 1–2; captured at step 0 in fault (backward): aten::div.Tensor "
        f"in SqrtBackward0 at {file}:{line} (capture 0); hooktrace replay {run} --nonfinite"
    ]
    # no finding to hang it on: a note says the run holds one
    later = record_run(Log(), tmp_path / "log")
    found = hooktrace.anomalies(later, steps="2-2")
    assert set(found.findings["kind"]) == {"nonfinite_param"}
    assert found.notes == [
        f"the run holds 1 non-finite capture (step(s) 0): hooktrace replay {later} --nonfinite"
    ]


def test_failed_captures_and_traces_without_captures(tmp_path: Path) -> None:
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "captures").mkdir()  # a file where this rank's captures' directory goes
    (failed / "captures" / "rank=0").write_text("in the way")
    with pytest.warns(RuntimeWarning, match="could not capture"):
        record_run(Log(), failed)
    found = hooktrace.anomalies(failed)
    assert (found.findings["capture"] == "").all()
    assert found.notes == [
        "1 non-finite capture(s) failed while the run was recorded (its warnings say why)"
    ]
    # a trace from before captures: the findings as they were, with an empty capture column
    old = _before_captures(SAMPLES / "nan", tmp_path)
    assert "nonfinite_forward" in set(old.findings["kind"])
    assert (old.findings["capture"] == "").all() and old.notes == [] and old.captures.empty


def _before_captures(run: Path, tmp_path: Path) -> Any:
    """The anomalies of a copy of ``run`` as a recorder before format 1.2 wrote it: no
    captures, no capture settings, no capture counts."""
    old = tmp_path / "before-captures"
    shutil.copytree(run, old)
    shutil.rmtree(old / "captures", ignore_errors=True)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["format_version"] = "1.1"
    for key in ("capture_nonfinite", "capture_limit", "capture_max_mb"):
        manifest["config"].pop(key, None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    for status_file in (old / "status").glob("*.json"):
        status = json.loads(status_file.read_text())
        status.pop("nonfinite_captures", None)
        status.pop("nonfinite_captures_failed", None)
        status_file.write_text(json.dumps(status))
    return hooktrace.anomalies(old)
