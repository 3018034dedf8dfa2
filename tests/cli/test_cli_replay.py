"""``hooktrace replay`` through CliRunner: the printed timeline, its filters and formats, and
one-line errors with exit code 2."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner
from models import default_loss, make_batch, make_model
from nonfinite_runs import Log, Sqrt, record_run, source_line
from repo import GOLDEN, ROOT
from torch import nn

import hooktrace
from hooktrace.cli import cli, main


@pytest.fixture
def run(run_dir: Path) -> Path:
    """ReferenceBlock, the hand-checked model, one step with inputs recorded."""
    model = make_model("ReferenceBlock")
    batch = make_batch("ReferenceBlock")
    with hooktrace.record(model, run_dir, inputs=True) as rec:
        default_loss(batch.run(model), batch.target).backward()
        rec.step()
    return run_dir


def _replay(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["replay", *args])
    return result.exit_code, result.output


def test_the_timeline_reads_top_to_bottom(run: Path) -> None:
    code, out = _replay(str(run), "--step", "0")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"{run}  step 0, rank 0: 23 events, micro-step(s) 0, train"
    assert lines[1].startswith("params: 4 parameters and 0 buffers of 2 modules")
    assert "all finite" in lines[1]
    events = [line.split()[1:3] for line in lines if line[:7].strip().isdigit()]
    # (module, kind) in execution order; names are indented by depth
    assert events[:10] == [
        ["ReferenceBlock", "input"],
        ["block", "input"],
        ["block.fc1", "input"],
        ["block.fc1", "output"],
        ["block.relu1", "input"],
        ["block.relu1", "output"],
        ["block.fc2", "input"],
        ["block.fc2", "output"],
        ["block", "output"],
        ["ReferenceBlock", "output"],
    ]
    assert events[10:] == [
        ["block.fc2", "grad_output"],
        ["block", "grad_output"],
        ["ReferenceBlock", "grad_output"],
        ["block.relu1", "grad_output"],
        ["block.fc1", "grad_output"],
        ["block.fc1", "grad_param"],
        ["block.fc1", "grad_param"],
        ["block.fc2", "grad_param"],
        ["block.fc2", "grad_param"],
    ]
    fc1 = next(line for line in lines if "block.fc1 output" in line)
    # depth 2: four spaces of indent; statistics of [[7, -13, 27, -29]]; the largest jump
    assert "      block.fc1 output" in fc1
    assert fc1.split()[4:8] == ["-2", "21.05", "-29", "27"]
    assert "<< jump x21.1" in fc1
    assert "forward, micro-step 0 (train)" in lines and "backward, micro-step 0 (train)" in lines
    assert "first non-finite: none (every value of the step is finite)" in lines
    assert lines[-1].startswith("largest jumps: seq 7 block.fc1 output x21.1; seq 11 block.fc2")


def test_filters_params_and_jumps(run: Path) -> None:
    _, out = _replay(str(run), "--step", "0", "--depth", "1", "--jumps", "0")
    names = {line.split()[1] for line in out.splitlines() if line[:7].strip().isdigit()}
    assert names == {"ReferenceBlock", "block"}
    assert "<< jump" not in out and "largest jumps" not in out

    _, out = _replay(str(run), "--step", "0", "--modules", r"fc1$", "--params")
    rows = [line.split()[1:4] for line in out.splitlines() if line[:7].strip().isdigit()]
    assert rows[:2] == [["block.fc1", "param", "weight"], ["block.fc1", "param", "bias"]]
    assert {r[0] for r in rows} == {"block.fc1"}
    assert "parameters and buffers, micro-step 0 (train)" in out

    _, out = _replay(str(run), "--step", "0", "--modules", "nothing-matches")
    assert "no events match --modules/--depth" in out


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_machine_readable_formats_are_the_timeline_table(run: Path, fmt: str) -> None:
    code, out = _replay(str(run), "--step", "0", "--format", fmt, "--depth", "0")
    assert code == 0, out
    frame = pd.read_csv(io.StringIO(out)) if fmt == "csv" else pd.DataFrame(json.loads(out))
    expected = hooktrace.load(run).timeline(0).query("depth == 0")
    assert frame["seq"].tolist() == expected["seq"].tolist()
    assert list(frame.columns) == list(expected.columns)


def test_the_first_nonfinite_value_is_marked(run_dir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    with hooktrace.record(model, run_dir) as rec:
        with torch.no_grad():
            model[1].weight[0, 0] = float("inf")
        model(torch.randn(2, 3)).sum().backward()
        rec.step()
    code, out = _replay(str(run_dir), "--step", "0")
    assert code == 0, out
    assert "NON-FINITE in 1.weight" in out.splitlines()[1]
    assert out.count("<< first non-finite") == 0  # collapsed with the parameters
    assert "first non-finite: seq 2, param weight of '1'" in out
    assert "Inf 1 of 3 values" in out
    _, out = _replay(str(run_dir), "--step", "0", "--params")
    marked = [line for line in out.splitlines() if "<< first non-finite" in line]
    assert len(marked) == 1 and "1 param weight" in marked[0] and "Inf 1/3" in marked[0]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", "9"], "step 9 was not recorded in {run} (rank 0): it has steps 0"),
        (["--step", "0", "--micro-step", "2"], "step 0 (rank 0) has no micro-step 2"),
        (["--step", "0", "--rank", "3"], "has no records at rank 3 (ranks: 0)"),
        (["--step", "0", "--modules", "("], "--modules '(' is not a valid regex"),
        (["--step", "0", "--format", "parquet"], "--format parquet writes a binary file"),
    ],
)
def test_errors_are_one_line_with_exit_2(run: Path, args: list[str], message: str) -> None:
    code, out = _replay(str(run), *args)
    assert code == 2, out
    assert message.format(run=run) in out
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out


def test_a_missing_run_is_one_line_with_exit_2(tmp_path: Path) -> None:
    code, out = _replay(str(tmp_path / "nope"), "--step", "0")
    assert code == 2 and "no run at" in out and len(out.strip().splitlines()) == 1


def test_a_usage_error_is_one_line_with_exit_2(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["replay", str(run)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.strip() == (
        "hooktrace: error: Missing option '--step'. (see `hooktrace replay --help`)"
    )


def test_help_has_an_example() -> None:
    code, out = _replay("--help")
    assert code == 0 and "Example:" in out and "hooktrace replay runs/mlp --step 7" in out


GOLDEN = GOLDEN / "replay_nan_step15.txt"


def test_golden_timeline_of_the_nan_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """sample_traces/nan: the step where log(softmax) first gives -inf (see its README).
    HOOKTRACE_UPDATE_GOLDEN=1 rewrites the golden file."""
    monkeypatch.chdir(ROOT)
    code, out = _replay("sample_traces/nan", "--step", "15")
    assert code == 0, out
    if os.environ.get("HOOKTRACE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(out)
    assert out == GOLDEN.read_text()
    assert "<< first non-finite  Inf 3/128" in next(
        line for line in out.splitlines() if "log_probs output" in line
    )


# --- replay --nonfinite: the calls where a NaN or Inf began, as the recorder captured them ----


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A forward origin (log of a ReLU's zeros) and a backward one (sqrt's backward divides
    by the zeros), each at every step of three."""
    base = tmp_path_factory.mktemp("captured")
    return {
        "log": record_run(Log(), base / "log"),
        "sqrt": record_run(Sqrt(), base / "sqrt"),
    }


def _fields(block: list[str]) -> dict[str, str]:
    """The labelled lines of one capture's block (continuation lines joined with '|')."""
    fields: dict[str, str] = {}
    label = ""
    for line in block[1:]:
        label = line[2:13].strip() or label
        text = line[14:]
        fields[label] = f"{fields[label]}|{text}" if label in fields else text
    return fields


def test_nonfinite_shows_the_forward_capture(captured: dict[str, Path]) -> None:
    run = captured["log"]
    code, out = _replay(str(run), "--nonfinite")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"{run}: 1 non-finite capture"
    assert lines[2] == "capture 0, rank 0: step 0, micro-step 0, train, forward pass"
    fields = _fields(lines[2:])
    file, line = source_line("LOG_LINE")
    assert fields["module"] == "fault (nonfinite_runs.Log), call 0"
    assert fields["trigger"].startswith("output 0 holds 0 NaN and ")
    assert fields["operation"] == "aten::log"
    assert fields["line"] == f"{file}:{line}, in forward|  return torch.log(x)  # LOG_LINE"
    assert fields["standalone"].startswith("reproduces")
    # the statistics of log's input, against the captured tensor itself
    x = hooktrace.load(run).capture_tensors(0)["inputs"]["0"]
    zeros = int((x == 0).sum())
    assert zeros > 0  # the ReLU's zeros are what log turned into -inf
    assert fields["op inputs"] == (
        f"0: float32 8x4, range 0 to {x.max():.4g}, smallest nonzero {x[x > 0].min():.4g}, "
        f"zeros {zeros}/32, negatives 0/32"
    )
    assert fields["trigger"].startswith(f"output 0 holds 0 NaN and {zeros} Inf of 32")
    assert fields["left out"] == "none: every tensor of the call was saved"
    assert fields["in Python"] == (
        f"hooktrace.replay_module({str(run)!r}, 'fault', module=<your module>, capture=0)"
    )


def test_nonfinite_shows_the_backward_capture_and_takes_a_step(captured: dict[str, Path]) -> None:
    run = captured["sqrt"]
    code, out = _replay(str(run), "--nonfinite")
    assert code == 0, out
    assert out.splitlines()[0] == f"{run}: 3 non-finite captures"
    assert [line for line in out.splitlines() if line.startswith("capture ")] == [
        f"capture {s}, rank 0: step {s}, micro-step 0, train, backward pass" for s in range(3)
    ]
    code, out = _replay(str(run), "--nonfinite", "--step", "1", "--rank", "0")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0] == f"{run}: 1 non-finite capture on rank 0 at step 1"
    fields = _fields(lines[2:])
    file, line = source_line("SQRT_LINE")
    assert fields["operation"] == "aten::div.Tensor in SqrtBackward0"
    assert fields["line"].startswith(f"{file}:{line}, in forward (its backward ran the operation)")
    assert fields["trigger"].startswith("the gradient at its input 0 holds 0 NaN and ")
    assert fields["op inputs"].count("|") == 1  # div's two inputs
    # div(grad, 2 * sqrt(x)): its second input is zero where sqrt's input was
    zeros = int((hooktrace.load(run).capture_tensors(1)["inputs"]["0"] == 0).sum())
    assert zeros > 0 and f"zeros {zeros}/32" in fields["op inputs"].split("|")[1]

    code, out = _replay(str(run), "--nonfinite", "--step", "7")
    assert code == 0
    assert out == (
        f"{run} holds no non-finite capture at step 7 (it holds some at step(s) 0, 1, 2): "
        "leave --step out to see them\n"
    )


def test_the_step_view_points_at_the_capture(captured: dict[str, Path]) -> None:
    run = captured["log"]
    _, out = _replay(str(run), "--step", "0", "--jumps", "0")
    file, line = source_line("LOG_LINE")
    assert out.splitlines()[-1] == (
        f"captured: forward of 'fault' (call 0, micro-step 0): aten::log at {file}:{line}; "
        f"hooktrace replay {run} --nonfinite --step 0"
    )
    _, out = _replay(str(run), "--step", "1")
    assert "captured:" not in out  # the parameters were already non-finite: no capture


@pytest.mark.parametrize("fmt", ["csv", "json", "parquet"])
def test_nonfinite_formats_are_the_captures_table(
    captured: dict[str, Path], tmp_path: Path, fmt: str
) -> None:
    expected = hooktrace.load(captured["sqrt"]).nonfinite_captures()
    target = tmp_path / f"captures.{fmt}"
    code, out = _replay(str(captured["sqrt"]), "--nonfinite", "--format", fmt, "-o", str(target))
    assert code == 0 and out == "", out
    frame = {"csv": pd.read_csv, "json": pd.read_json, "parquet": pd.read_parquet}[fmt](target)
    assert list(frame.columns) == list(expected.columns)
    assert frame["op"].tolist() == ["aten::div.Tensor"] * 3
    assert frame[["step", "line"]].astype(int).values.tolist() == (
        expected[["step", "line"]].astype(int).values.tolist()
    )


def test_no_capture_is_one_line_saying_why(
    run: Path, captured: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def one_line(path: Path | str) -> str:
        code, out = _replay(str(path), "--nonfinite")
        assert code == 0 and len(out.splitlines()) == 1, out
        return out.strip()

    assert one_line(run) == (
        f"{run} holds no non-finite capture: no NaN or Inf began inside a recorded module "
        "while capture was on"
    )
    off = record_run(Log(), tmp_path / "off", capture_nonfinite=False)
    assert (
        hooktrace.load(off).records["nan_count"].sum()
        + hooktrace.load(off).records["inf_count"].sum()
        > 0
    )  # the run met non-finite values: only the capture was off
    assert one_line(off) == (
        f"{off} holds no non-finite capture: capture was off when it was recorded "
        "(capture_nonfinite=False)"
    )
    limit = record_run(Log(), tmp_path / "limit", capture_limit=0)
    assert one_line(limit).endswith("capture was off when it was recorded (capture_limit=0)")
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "captures").mkdir()  # a file where this rank's captures' directory goes
    (failed / "captures" / "rank=0").write_text("in the way")
    with pytest.warns(RuntimeWarning, match="could not capture the non-finite value"):
        record_run(Log(), failed)
    assert one_line(failed) == (
        f"{failed} holds no non-finite capture: 1 capture failed while it was recorded (the "
        "recording's warnings say why)"
    )
    monkeypatch.chdir(ROOT)
    assert one_line("tests/fixtures/healthy_1_0") == (
        "tests/fixtures/healthy_1_0 holds no non-finite capture: it was recorded before "
        "captures existed (format 1.0); record it again to capture where a NaN or Inf begins"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--rank", "3"], "has no rank 3 (ranks: 0)"),
        (["--depth", "1"], "--depth cuts the step view and does not go with --nonfinite"),
        (["--modules", "fc"], "--modules cuts the step view"),
        (["--micro-step", "0"], "--micro-step cuts the step view"),
        (["--params"], "--params cuts the step view"),
        (["--jumps", "3"], "--jumps cuts the step view"),
        (["--format", "parquet"], "--format parquet writes a binary file"),
    ],
)
def test_nonfinite_errors_are_one_line_with_exit_2(
    captured: dict[str, Path], args: list[str], message: str
) -> None:
    code, out = _replay(str(captured["log"]), "--nonfinite", *args)
    assert code == 2, out
    assert message in out and out.startswith("hooktrace: error: ")
    assert len(out.strip().splitlines()) == 1 and "Traceback" not in out


def test_without_step_a_missing_run_is_told_first(tmp_path: Path) -> None:
    """--step is optional for --nonfinite only: a missing run must still be the error a
    user sees, not the missing option."""
    code, out = _replay(str(tmp_path / "nowhere"))
    assert code == 2 and "no run at" in out
    code, out = _replay(str(ROOT / "sample_traces" / "nan"))
    assert code == 2 and "Missing option '--step'" in out
