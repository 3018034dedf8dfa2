"""Non-finite captures (issue 25): the call where a NaN or Inf began, saved in full, run again,
and the operation and line named. Each planted fault (tests/planted.py) is known by
construction: the module, the aten operation and the line marked ``# planted:``."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import planted
import pytest
import torch
from repo import TESTS
from torch import nn

import hooktrace
from hooktrace.errors import ConfigError, TensorNotRecorded


def _record(name: str, out: Path, steps: int = 3, **options: object) -> tuple[nn.Module, list]:
    _, scale, _ = planted.CASES.get(name, (None, 1.0, None))
    model = planted.make(name)
    with hooktrace.record(model, out, **options) as rec:
        losses = planted.train(model, steps, scale=scale)
    assert rec.error is None
    return model, losses


@pytest.mark.parametrize("name", sorted(planted.CASES))
def test_each_planted_fault_is_captured_with_its_operation_and_line(name: str, tmp_path: Path):
    want = planted.CASES[name][2]
    _record(name, tmp_path / "run")
    trace = hooktrace.load(tmp_path / "run")
    captures = trace.nonfinite_captures()

    assert len(captures) == 1  # the first origin; later steps only carry it on
    row = captures.iloc[0]
    assert (row["step"], row["micro_step"], row["module"], row["pass"]) == (
        0,
        0,
        want.module,
        want.pass_,
    )
    assert row["op"] == want.op
    assert row["node"] == want.node
    assert Path(row["file"]).name == "planted.py"
    assert row["line"] == want.line
    assert row["reproduces"] and row["analysis"] == "found"
    assert f"planted.py:{want.line}" in row["explanation"]
    assert trace.manifest["ranks"]["0"]["nonfinite_captures"] == 1

    tensors = trace.capture_tensors(0)
    model = planted.make(name)
    fresh = model if want.module == type(model).__name__ else model.get_submodule(want.module)
    assert set(tensors["state"]) == {n for n, _ in fresh.named_parameters()} | {
        n for n, _ in fresh.named_buffers()
    }
    assert tensors["inputs"]
    if want.pass_ == "backward":
        assert tensors["grad_outputs"] and all(
            np.isfinite(g).all() for g in tensors["grad_outputs"].values()
        )
    else:  # the inputs finite, the output not: the forward origin
        assert all(
            np.isfinite(np.asarray(t, dtype=np.float64)).all() for t in tensors["inputs"].values()
        )
        assert not all(
            np.isfinite(np.asarray(t, dtype=np.float64)).all() for t in tensors["outputs"].values()
        )

    replay = hooktrace.replay_module(tmp_path / "run", want.module, module=fresh, capture=0)
    assert replay.finding.op == want.op and replay.finding.line == want.line
    assert replay.finding.reproduces and replay.same
    assert f"{want.op}" in repr(replay) and "as in the recording" in repr(replay)


def test_the_inputs_statistics_explain_the_operation(tmp_path: Path):
    _record("log", tmp_path / "run")
    inputs = hooktrace.load(tmp_path / "run").capture_info(0)["analysis"]["op_inputs"]
    assert len(inputs) == 1
    assert inputs[0]["zeros"] > 0 and inputs[0]["negatives"] == 0 and inputs[0]["nan"] == 0


@pytest.mark.parametrize("name", sorted(planted.CASES))
def test_training_is_bit_identical_with_a_capture_and_its_replay(name: str, tmp_path: Path):
    """The capture deep-copies the module and runs it again inside the step, with dropout in
    the log case: the RNG, the parameters and the losses must not move by a bit."""
    _, scale, _ = planted.CASES[name]
    plain = planted.make(name)
    plain_losses = planted.train(plain, 4, scale=scale)
    recorded, recorded_losses = _record(name, tmp_path / "run", steps=4)

    assert planted.same_bits(plain_losses, recorded_losses)
    for (n, a), (_, b) in zip(plain.named_parameters(), recorded.named_parameters(), strict=True):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), n
    assert torch.equal(torch.get_rng_state(), _rng_after(name))


def _rng_after(name: str) -> torch.Tensor:
    _, scale, _ = planted.CASES[name]
    model = planted.make(name)
    planted.train(model, 4, scale=scale)
    return torch.get_rng_state()


def test_a_healthy_run_has_no_capture_and_the_same_trace_as_with_capture_off(tmp_path: Path):
    _record("healthy", tmp_path / "on", steps=4)
    _record("healthy", tmp_path / "off", steps=4, capture_nonfinite=False)
    on, off = hooktrace.load(tmp_path / "on"), hooktrace.load(tmp_path / "off")

    assert on.nonfinite_captures().empty and not (tmp_path / "on" / "captures").exists()
    pd.testing.assert_frame_equal(on.records, off.records)
    timeless = ["step", "micro_steps", "skipped", "records", "full_tensors", "dropped"]
    pd.testing.assert_frame_equal(on.steps[timeless], off.steps[timeless])
    assert on.manifest["config"]["capture_nonfinite"] is True
    assert off.manifest["config"]["capture_nonfinite"] is False


def test_capture_off_keeps_none(tmp_path: Path):
    _record("log", tmp_path / "run", capture_nonfinite=False)
    trace = hooktrace.load(tmp_path / "run")
    assert trace.nonfinite_captures().empty
    assert trace.manifest["ranks"]["0"]["nonfinite_captures"] == 0


def test_captures_stop_at_the_limit(tmp_path: Path):
    """Evaluation without gradients: every step makes a fresh origin (the parameters stay
    finite), and only the first ``capture_limit`` are kept."""
    model = planted.make("log")
    model.eval()
    with hooktrace.record(model, tmp_path / "run", capture_limit=2) as rec, torch.no_grad():
        for _ in range(4):
            model(torch.randn(16, 6))
            rec.step()
    captures = hooktrace.load(tmp_path / "run").nonfinite_captures()
    assert captures["step"].tolist() == [0, 1]
    assert (captures["phase"] == "eval").all() and (captures["op"] == "aten::log").all()


def test_a_capture_over_its_size_limit_names_what_it_left_out(tmp_path: Path):
    _record("log", tmp_path / "run", capture_max_mb=200 / (1 << 20))  # 200 bytes
    trace = hooktrace.load(tmp_path / "run")
    row = trace.nonfinite_captures().iloc[0]
    assert row["op"] == "aten::log" and row["left_out"] > 0  # named from the live tensors
    left = trace.capture_info(0)["left_out"]
    assert {"group", "name", "shape", "dtype", "bytes", "why"} <= set(left[0])
    with pytest.raises(TensorNotRecorded, match="--capture-max-mb"):
        hooktrace.replay_module(tmp_path / "run", "log", module=planted.LogFeatures(), capture=0)


def test_a_capture_that_fails_is_a_warning_and_a_count_and_the_recording_goes_on(tmp_path: Path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "captures").mkdir()  # the capture cannot make its directory
    (out / "captures" / "rank=0").write_text("in the way")
    model = planted.make("log")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hooktrace.record(model, out, overwrite=True) as rec:
            losses = planted.train(model, 3)
    assert len(losses) == 3 and rec.error is None
    assert any("could not capture the non-finite value" in str(w.message) for w in caught)
    trace = hooktrace.load(out)
    assert trace.status == "complete" and len(trace.steps) == 3
    assert trace.manifest["ranks"]["0"]["nonfinite_captures_failed"] >= 1


def test_the_users_hooks_never_see_the_replay(tmp_path: Path):
    calls: list[str] = []

    def run(record: bool) -> list[str]:
        calls.clear()
        model = planted.make("log")
        model.log.register_forward_hook(lambda m, a, o: calls.append("module hook"))
        handle = nn.modules.module.register_module_forward_hook(
            lambda m, a, o: calls.append(type(m).__name__)
        )
        try:
            if record:
                with hooktrace.record(model, tmp_path / "run", overwrite=True):
                    planted.train(model, 2)
            else:
                planted.train(model, 2)
        finally:
            handle.remove()
        return list(calls)

    assert run(record=True) == run(record=False)
    assert hooktrace.load(tmp_path / "run").nonfinite_captures()["module"].tolist() == ["log"]


def test_replay_module_checks_what_it_is_given(tmp_path: Path):
    _record("log", tmp_path / "run")
    with pytest.raises(ConfigError, match="capture 0 is of 'log', not 'fc'"):
        hooktrace.replay_module(tmp_path / "run", "fc", module=nn.Linear(6, 8), capture=0)
    with pytest.raises(ConfigError, match="the module given is a"):
        hooktrace.replay_module(tmp_path / "run", "log", module=nn.Identity(), capture=0)
    with pytest.raises(TensorNotRecorded, match="no non-finite capture 4"):
        hooktrace.replay_module(tmp_path / "run", "log", module=planted.LogFeatures(), capture=4)
    with pytest.raises(ConfigError, match="not both"):
        hooktrace.replay_module(
            tmp_path / "run", "log", module=planted.LogFeatures(), capture=0, step=0
        )


def test_the_capture_file_is_plain_hdf5(tmp_path: Path):
    """What a notebook reads without hooktrace: h5py, the JSON attribute and the datasets."""
    import h5py

    _record("sqrt_backward", tmp_path / "run")
    path = tmp_path / "run" / "captures" / "rank=0" / "capture-000.h5"
    with h5py.File(path, "r") as f:
        meta = json.loads(f.attrs["capture"])
        assert meta["analysis"]["op"] == "aten::div.Tensor"
        assert set(f) == {"inputs", "outputs", "grad_outputs", "state"}
        assert f["grad_outputs/0"].attrs["dtype"] == "float32"
        assert f["grad_outputs/0"].attrs["name"] == "0"
        assert f["inputs/0"].shape == (16, 4)


def test_record_command_says_where_the_nan_began_and_takes_the_options(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import planted
            planted.train(planted.make("log"), 3)
            """
        )
    )
    config = tmp_path / "hooktrace.toml"
    config.write_text("capture_limit = 1\ncapture_max_mb = 16\n")
    command = [sys.executable, "-m", "hooktrace", "record", "--config", str(config)]
    done = subprocess.run(
        [*command, "-o", str(tmp_path / "on"), str(script)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "a non-finite value began at step 0 in log (forward)" in done.stderr
    assert "aten::log at " in done.stderr and "hooktrace replay" in done.stderr
    config_seen = hooktrace.load(tmp_path / "on").manifest["config"]
    assert (config_seen["capture_limit"], config_seen["capture_max_mb"]) == (1, 16)

    done = subprocess.run(
        [*command, "--no-capture-nonfinite", "-o", str(tmp_path / "off"), str(script)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "non-finite value began" not in done.stderr
    assert hooktrace.load(tmp_path / "off").nonfinite_captures().empty


@pytest.mark.parametrize("name", sorted(planted.CASES))
def test_the_record_command_captures_each_planted_fault_as_the_library_does(
    name: str, tmp_path: Path
):
    """``hooktrace record`` finds the model and its optimizer itself (ScriptRecorder): its
    captures must be the library's, the origins found at the optimizer step included (a
    parameter's gradient non-finite on its own: ``sqrt_param``, ``sqrt_second_call``). It
    once replaced that check instead of extending it, and captured neither."""
    want = planted.CASES[name][2]
    scale = planted.CASES[name][1]
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {str(TESTS)!r})
            import planted
            planted.train(planted.make({name!r}), 3, scale={scale!r})
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "hooktrace", "record", "-o", str(tmp_path / "run"), str(script)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert f"began at step 0 in {want.module} ({want.pass_})" in done.stderr
    row = hooktrace.load(tmp_path / "run").nonfinite_captures().iloc[0]
    assert (row["module"], row["pass"], row["op"]) == (want.module, want.pass_, want.op)
    assert row["line"] == want.line


@pytest.mark.parametrize(("name", "seen"), [("log", True), ("healthy", False)])
def test_the_writer_tells_when_a_step_held_a_nonfinite_value(name: str, seen: bool, tmp_path: Path):
    """What arms the checks that wait for a GPU (docs/PERFORMANCE.md): the writer's copy of
    the statistics, the first place a device's NaN is known without waiting for it."""
    model = planted.make(name)
    with hooktrace.record(model, tmp_path / "run") as rec:
        planted.train(model, 2)
    assert rec._writer.nonfinite_seen is seen


class _HandLogSoftmax(nn.Module):
    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(logits, dim=-1))  # underflows to log(0) for an outlier


def test_what_follows_the_first_origin_is_not_captured(tmp_path: Path):
    """nll_loss's gradient stays finite when the log-probabilities are not: each later step's
    backward meets a finite gradient at the output of a module whose forward was already
    non-finite (or whose inputs were). Those carry the NaN on: only the origin is kept."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), _HandLogSoftmax())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        for step in range(5):
            x = torch.randn(8, 6) * (1000.0 if step == 1 else 1.0)
            loss = nn.functional.nll_loss(model(x), torch.zeros(8, dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
    captures = hooktrace.load(tmp_path / "run").nonfinite_captures()
    assert captures[["step", "pass", "module", "op"]].values.tolist() == [
        [1, "forward", "1", "aten::log"]
    ]


def test_check_reads_every_capture_against_its_checksums(tmp_path: Path):
    import h5py

    _record("log", tmp_path / "run")
    report = hooktrace.check(tmp_path / "run")
    assert report.whole and any("1 non-finite capture(s), each whole" in n for n in report.notes)

    path = tmp_path / "run" / "captures" / "rank=0" / "capture-000.h5"
    with h5py.File(path, "r+") as f:  # a changed value, its stored CRC-32 left as it was
        f["inputs/0"][0, 0] += 1.0
    report = hooktrace.check(tmp_path / "run")
    assert not report.whole
    assert report.problems == [
        "capture captures/rank=0/capture-000.h5: 1 tensor(s) no longer match their checksum "
        "(inputs/0): it cannot be replayed"
    ]

    path.unlink()
    report = hooktrace.check(tmp_path / "run")
    assert report.problems == [
        "rank 0: 1 non-finite capture(s) written, 0 readable: the others are lost"
    ]


def test_a_backward_capture_recomputes_the_inputs_the_call_had(tmp_path: Path):
    """The recorder holds no activation through a step: the inputs of the module whose
    backward made the NaN are made again from the model's inputs. They must be the very
    values the call had: fc's output on step 0's batch, bit for bit."""
    _record("sqrt_backward", tmp_path / "run")
    trace = hooktrace.load(tmp_path / "run")
    assert trace.capture_info(0)["recomputed"] is True
    inputs = trace.capture_tensors(0)["inputs"]

    model = planted.make("sqrt_backward")
    x = torch.randn(16, 6, generator=torch.Generator().manual_seed(1))  # planted.train's first
    with torch.no_grad():
        expected = model.fc(x).numpy()
    assert np.array_equal(inputs["0"], expected) and np.array_equal(inputs["1"], expected)
    grads = trace.capture_tensors(0)["grad_outputs"]["0"]
    assert grads.shape == (16, 1) and np.isfinite(grads).all()


# --- what a capture must get right beyond a leaf module fed its neighbour's output ---------


def test_the_call_of_a_module_called_twice_is_the_one_whose_backward_made_it(tmp_path: Path):
    _record("sqrt_second_call", tmp_path / "run")
    row = hooktrace.load(tmp_path / "run").nonfinite_captures().iloc[0]
    assert (row["module"], row["call"], row["reproduces"]) == ("gain", 1, True)


def test_gradient_accumulation_captures_once_from_the_last_micro_step(tmp_path: Path):
    """A parameter's gradient is looked at once a step, at the optimizer's step, before its
    update (the records the step keeps anyway say it): w's gradient, accumulated over three
    micro-steps, is non-finite, and the last micro-step's forward and backward run again.
    Each micro-step makes it here, so the last one reproduces it."""
    model = planted.make("sqrt_param")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with hooktrace.record(model, tmp_path / "run"):
        for _ in range(2):
            for _ in range(3):
                model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    captures = hooktrace.load(tmp_path / "run").nonfinite_captures()
    assert captures[["step", "micro_step", "module", "reproduces"]].values.tolist() == [
        [0, 2, "gain", True]
    ]


class _Monitor:
    """A user's hook bound to an object that cannot be copied."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.calls = 0

    def hook(self, module: nn.Module, args: object, output: object) -> None:
        with self.lock:
            self.calls += 1


def test_a_users_hook_object_is_neither_copied_nor_called_by_the_rerun(tmp_path: Path):
    model = planted.make("log")
    monitor = _Monitor()
    model.log.register_forward_hook(monitor.hook)
    with hooktrace.record(model, tmp_path / "run"):
        planted.train(model, 2)
    row = hooktrace.load(tmp_path / "run").nonfinite_captures().iloc[0]
    assert row["analysis"] == "found" and row["op"] == "aten::log"
    assert monitor.calls == 2  # the two training forwards, not the capture's re-run


def test_an_overflow_made_outside_the_model_is_not_captured(tmp_path: Path):
    """A GradScaler whose scale overflows float16 where the loss meets the model's output:
    no module made it, and the re-run is not even tried."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    with hooktrace.record(model, tmp_path / "run"):
        for _ in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 16)).float().pow(2).mean()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    trace = hooktrace.load(tmp_path / "run")
    assert trace.nonfinite_captures().empty
    assert trace.manifest["ranks"]["0"]["nonfinite_captures_failed"] == 0


class _LogAfterLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.relu(self.fc(x)))  # zeros under autocast too


def test_a_capture_under_autocast_replays_under_it(tmp_path: Path):
    torch.manual_seed(0)
    model = nn.Sequential(_LogAfterLinear(), nn.Linear(6, 1))
    with hooktrace.record(model, tmp_path / "run") as rec, torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(torch.randn(8, 6))
        rec.step()
    trace = hooktrace.load(tmp_path / "run")
    assert trace.capture_info(0)["autocast"] == [["cpu", "bfloat16"]]
    fresh = _LogAfterLinear()
    replay = hooktrace.replay_module(tmp_path / "run", "0", module=fresh, capture=0)
    assert replay.finding.op == "aten::log" and replay.finding.reproduces and replay.same


class _EMACentre(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return x - self.mean


def test_a_recomputed_capture_names_the_buffers_its_forward_changed(tmp_path: Path):
    """A buffer the forward updates (an EMA's) is past its value when the step runs again:
    the capture says which, as the inputs it holds may differ from the call's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), _EMACentre())
    model.add_module("dist", planted.Distance())

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = model
            self.head = nn.Linear(1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.body[1](self.body[0](x))
            return self.head(self.body.dist(h, h.detach()))

    net = Net()
    with hooktrace.record(net, tmp_path / "run"):
        net(torch.randn(8, 6)).pow(2).mean().backward()
    info = hooktrace.load(tmp_path / "run").capture_info(0)
    assert info["module"] == "body.dist" and info["buffers_changed"] == ["body.1.mean"]


class _DivideInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.div_(x.std(0) * 0)  # planted: in place, by zero


def test_a_module_that_changes_its_input_in_place_is_captured_around_it(tmp_path: Path):
    """Its post-hook sees the input already changed: the module around it is the innermost
    call whose inputs were finite, and its re-run still names the operation and the line."""
    model = nn.Sequential(nn.Linear(6, 6), _DivideInPlace())
    with hooktrace.record(model, tmp_path / "run") as rec, torch.no_grad():
        model(torch.randn(8, 6))
        rec.step()
    row = hooktrace.load(tmp_path / "run").nonfinite_captures().iloc[0]
    assert row["module"] == "Sequential" and row["op"] == "aten::div_.Tensor"
    assert row["line"] == planted.line_of("planted: in place, by zero", Path(__file__))


class _MultiplyInto(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.into = torch.full((8, 6), float("nan"))  # a buffer's old contents: anything

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mul(x, 1e38, out=self.into)  # planted: Inf, into a buffer


def test_an_out_buffer_is_no_input_of_the_operation_that_writes_it() -> None:
    """An ``out=`` buffer is written, not read: what it held (uninitialised memory, as
    often as not) neither hides the Inf the operation makes nor stands among its inputs."""
    from hooktrace.recorder.nonfinite.first_nonfinite import run_forward

    finding = run_forward(_MultiplyInto(), (torch.full((8, 6), 10.0),), {})
    assert (finding.status, finding.op, finding.reproduces) == ("found", "aten::mul.out", True)
    assert finding.line == planted.line_of("planted: Inf, into a buffer", Path(__file__))
    assert [i["shape"] for i in finding.op_inputs] == [[8, 6]] and finding.op_inputs[0]["nan"] == 0


def test_hooktrace_frames_are_told_apart_from_the_users() -> None:
    """The frames a captured operation's source line skips are all of hooktrace's, wherever
    the module that names them sits in the package (found when it moved a floor down)."""
    from hooktrace.recorder.nonfinite import first_nonfinite

    assert str(Path(hooktrace.__file__).resolve().parent) == first_nonfinite._HOOKTRACE_DIR
