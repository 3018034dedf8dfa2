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


ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).resolve().parent / "golden" / "replay_nan_step15.txt"


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
