"""``hooktrace anomalies`` and ``hooktrace dead-relus`` through CliRunner: output, formats,
exit codes (0 found nothing or no --fail, 1 with --fail and findings, 2 on bad input), and
both commands in a process where torch cannot be imported."""

from __future__ import annotations

import inspect
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest
import torch
from click.testing import CliRunner, Result
from nonfinite_runs import shown
from recorded_runs import MLP, NaNForward, train
from repo import ROOT

import hooktrace
from hooktrace.cli import cli


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("runs")
    train(MLP(NaNForward()), base / "nan", steps=12, arm_at=5)
    dead = MLP()
    with torch.no_grad():
        dead.fc2.bias[:12] = -50.0
    train(dead, base / "dead", steps=20)
    train(MLP(), base / "healthy", steps=30)
    return {name: base / name for name in ("nan", "dead", "healthy")}


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, [str(a) for a in args])


# --- anomalies -------------------------------------------------------------------------------


def test_anomalies_table(runs: dict[str, Path]) -> None:
    result = invoke("anomalies", runs["nan"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == f"2 findings in {runs['nan']} (2 errors; 12 steps, 7 modules)"
    assert lines[2] == "ERROR   nonfinite_forward (1)"
    assert lines[3].split()[:4] == ["step", "5", "fault", "fault"]
    assert "produced the first NaN of the forward pass" in lines[4]
    # the recorder captured the call: the operation and the line of NaNForward that made it
    source = Path(inspect.getsourcefile(NaNForward) or "")
    line = next(
        i
        for i, text in enumerate(source.read_text().splitlines(), 1)
        if "return torch.sqrt(x - x.mean())" in text
    )
    assert lines[5].strip() == (
        f"captured: aten::sqrt at {shown(source)}:{line} (capture 0); "
        f"hooktrace replay {runs['nan']} --nonfinite"
    )
    assert lines[7] == "ERROR   nonfinite_param (1)"
    assert lines[8].split()[:3] == ["step", "6–11", "fc1"]


def test_anomalies_fail_exit_codes(runs: dict[str, Path]) -> None:
    assert invoke("anomalies", runs["nan"], "--fail").exit_code == 1
    healthy = invoke("anomalies", runs["healthy"], "--fail")
    assert healthy.exit_code == 0, healthy.output
    assert healthy.output == f"no anomalies in {runs['healthy']} (30 steps, 7 modules)\n"
    before = invoke("anomalies", runs["nan"], "--fail", "--steps", "0-4")
    assert before.exit_code == 0 and before.output.startswith("no anomalies")


@pytest.mark.parametrize(
    "command",
    [
        ["anomalies", "--fail"],
        ["dead-relus", "--fail"],
        ["precision"],
        ["plot", "--output", "{tmp}/p.png"],
        ["export", "tensorboard", "{run}", "{tmp}/tb"],
    ],
)
def test_steps_that_select_no_recorded_step_are_an_error(
    runs: dict[str, Path], tmp_path: Path, command: list[str]
) -> None:
    """A mistyped range was answered about no steps: "no anomalies", exit 0, which a CI guard
    with --fail took for a healthy run (diff and hist said so already)."""
    run = runs["healthy"]
    args = [a.format(tmp=tmp_path, run=run) for a in command]
    if "{run}" not in command:
        args.insert(1, str(run))
    result = invoke(*args, "--steps", "500-600")
    assert result.exit_code == 2, result.output
    assert result.output == (
        f"hooktrace: error: --steps 500-600 selects no recorded step: {run} holds steps 30 "
        "steps from 0 to 29\n"
    )
    assert not (tmp_path / "p.png").exists() and not (tmp_path / "tb").exists()


def test_steps_between_the_recorded_ones_name_those_and_a_damaged_steps_table_is_no_proof(
    tmp_path: Path,
) -> None:
    """A run recorded every 3rd step was said to hold "steps 0–6"; a steps table with a
    damaged part lost steps that still hold records, and the command was refused."""
    model = MLP()
    with hooktrace.record(model, tmp_path / "every3", every=3) as rec:
        for _ in range(7):
            model(torch.randn(4, 16)).sum().backward()
            rec.step()
    result = invoke("anomalies", tmp_path / "every3", "--steps", "4")
    assert result.exit_code == 2
    assert result.output.endswith("holds steps 0, 3, 6\n"), result.output
    damaged = tmp_path / "damaged"
    shutil.copytree(ROOT / "sample_traces" / "distributed" / "ddp", damaged)
    for part in damaged.glob("steps/rank=*/part-000001.parquet"):  # steps 2-5's rows
        part.write_bytes(b"not parquet")
    answered = invoke("anomalies", damaged, "--steps", "4-5")
    assert answered.exit_code == 1, answered.output  # an answer, leaving the damage out
    assert "replicas_differ" in answered.output and "left out steps/" in answered.output


def test_anomalies_formats(runs: dict[str, Path], tmp_path: Path) -> None:
    expected = hooktrace.anomalies(runs["nan"]).findings
    csv = pd.read_csv(io.StringIO(invoke("anomalies", runs["nan"], "--format", "csv").output))
    assert csv["kind"].tolist() == expected["kind"].tolist()
    assert csv["step"].tolist() == [5, 6]
    records = json.loads(invoke("anomalies", runs["nan"], "--format", "json").output)
    assert [r["module"] for r in records] == ["fault", "fc1"]
    assert records[0]["micro_step"] == 0 and records[0]["reference"] is None
    assert set(records[0]) == set(expected.columns)

    out = tmp_path / "findings.parquet"
    result = invoke("anomalies", runs["nan"], "--format", "parquet", "-o", out)
    assert result.exit_code == 0 and result.output == ""
    pd.testing.assert_frame_equal(pd.read_parquet(out), expected)
    no_file = invoke("anomalies", runs["nan"], "--format", "parquet")
    assert no_file.exit_code == 2 and "give --output" in no_file.output


# --- dead-relus ------------------------------------------------------------------------------


def test_dead_relus_table_worst_first(runs: dict[str, Path]) -> None:
    result = invoke("dead-relus", runs["dead"], "--units")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith(f"1 of 2 ReLU layers flagged in {runs['dead']}")
    assert lines[2].split() == ["layer", "type", "units", "dead", "dead", "%", "since", "activity"]
    relu2 = lines[3].split()
    assert relu2[:5] == ["relu2", "FLAGGED", "ReLU", "32", str(relu2[4])]
    assert int(relu2[4]) >= 12 and relu2[6] == "0"  # since step 0
    assert lines[4].split()[:5] == ["since", "step", "0:", "units", "0–11,"]
    assert lines[5].split()[:6] == ["relu1", "ReLU", "32", "0", "0.0%", "-"]


def test_dead_relus_fail_and_formats(runs: dict[str, Path]) -> None:
    assert invoke("dead-relus", runs["dead"], "--fail").exit_code == 1
    healthy = invoke("dead-relus", runs["healthy"], "--fail")
    assert healthy.exit_code == 0 and "0 of 2 ReLU layers flagged" in healthy.output
    assert "FLAGGED" not in healthy.output
    layers = pd.read_csv(io.StringIO(invoke("dead-relus", runs["dead"], "--format", "csv").output))
    assert layers["module"].tolist() == ["relu2", "relu1"]
    assert layers["flagged"].tolist() == [True, False]
    units = json.loads(invoke("dead-relus", runs["dead"], "--units", "--format", "json").output)
    assert {u["unit"] for u in units if u["module"] == "relu2"} >= set(range(12))
    assert {u["since"] for u in units} == {0}


# --- bad input: one line, exit 2 -------------------------------------------------------------


def test_dead_relus_says_whether_layers_or_their_activity_are_missing(
    runs: dict[str, Path],
) -> None:
    """ReLU layers with no activity in the phase read were reported as "no ReLU layers"."""
    evaluated = invoke("dead-relus", runs["healthy"], "--phase", "eval")
    assert evaluated.exit_code == 0, evaluated.output
    assert evaluated.output == (
        f"no ReLU activity to analyse in {runs['healthy']}\n"
        "no per-unit activity was recorded for the ReLU outputs in the steps read\n"
    )


@pytest.mark.parametrize("command", ["anomalies", "dead-relus"])
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}"], "no run at"),
        (["{run}", "--steps", "ten"], "bad steps 'ten'"),
        (["{run}", "--steps", "9-2"], "a range goes upwards"),
        (["{notarun}"], "is not a hooktrace run"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    runs: dict[str, Path], tmp_path: Path, command: str, args: list[str], message: str
) -> None:
    paths = {"missing": tmp_path / "missing", "run": runs["nan"], "notarun": tmp_path}
    result = invoke(command, *[a.format(**paths) for a in args])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("hooktrace: error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize(
    "args",
    [
        ["anomalies", "{run}", "--spike-factor", "1"],
        ["anomalies", "{run}", "--window", "1"],
        ["dead-relus", "{run}", "--threshold", "0"],
        ["dead-relus", "{run}", "--layer-threshold", "1.5"],
    ],
)
def test_bad_options_are_one_line_and_exit_2(runs: dict[str, Path], args: list[str]) -> None:
    result = invoke(*[a.format(run=runs["nan"]) for a in args])
    assert result.exit_code == 2 and result.output.startswith("hooktrace: error: ")
    assert len(result.output.strip().splitlines()) == 1


# --- never imports torch ---------------------------------------------------------------------


def test_the_commands_work_where_torch_cannot_be_imported(runs: dict[str, Path]) -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torch"] = None  # any `import torch` now fails
        from hooktrace.cli import main
        try:
            main(sys.argv[1:])
        finally:
            assert "torch" not in sys.modules or sys.modules["torch"] is None
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", code, *map(str, args)],
            capture_output=True, text=True, cwd=ROOT, env=env,
        )  # fmt: skip

    found = run("anomalies", runs["nan"], "--fail")
    assert found.returncode == 1, found.stderr
    assert "nonfinite_forward" in found.stdout and found.stderr == ""
    assert "captured: aten::sqrt at " in found.stdout  # read from the capture, without torch
    captured = run("replay", runs["nan"], "--nonfinite")
    assert captured.returncode == 0, captured.stderr
    assert "  operation   aten::sqrt" in captured.stdout.splitlines()
    dead = run("dead-relus", runs["dead"], "--format", "json")
    assert dead.returncode == 0, dead.stderr
    assert json.loads(dead.stdout)[0]["module"] == "relu2"
    assert run("anomalies", runs["healthy"], "--fail").returncode == 0


def test_notes_say_what_could_not_be_checked(runs: dict[str, Path], tmp_path: Path) -> None:
    empty = hooktrace.anomalies(runs["nan"], steps="500-")  # the command refuses such steps
    assert empty.notes[0] == "the trace holds no records in the steps read"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    with hooktrace.record(model, tmp_path / "run", params=False) as rec:
        model(torch.randn(2, 4)).sum().backward()
        rec.step()
    result = invoke("anomalies", tmp_path / "run")
    assert "no parameter gradients recorded" in result.output
    relus = invoke("dead-relus", tmp_path / "run", "--fail")
    assert relus.exit_code == 0 and relus.output.splitlines()[0].startswith("no ReLU layers")


# --- the committed sample traces (sample_traces/make_samples.py says what each plants) ------

SAMPLES = ROOT / "sample_traces"
_PARAMETERISED = ("embed", "blocks.0.norm", "blocks.0.fc", "blocks.1.norm", "blocks.1.fc", "head")
EXPECTED_ANOMALIES = {
    "healthy": [],
    "diverged": [],  # a changed eps is a divergence for `diff`, not an anomaly
    "dead": [("activation_spike", "blocks.0.fc", 10, 29)],  # the biases pushed down at 10
    "nan": [
        ("nonfinite_forward", "log_probs", 15, 15),  # log(0) of the outlier's softmax
        ("nonfinite_param", "embed", 16, 29),  # step 15's update wrote NaN
        *(("activation_spike", m, 15, 15) for m in ("embed", "blocks.0", "blocks.1", "head")),
    ],
    "exploding": [  # the loss scale grows 10x a step from step 20
        *(("exploding_gradient", m, 20, 29) for m in _PARAMETERISED),
        # from step 25 or 26 the gradients are past float16's range (2^16) as well
        *(("fp16_overflow", m, 25, 29) for m in ("embed", "blocks.0.fc", "head")),
        *(("fp16_overflow", m, 26, 29) for m in ("blocks.0.norm", "blocks.1.norm", "blocks.1.fc")),
    ],
}


@pytest.mark.parametrize("sample", sorted(EXPECTED_ANOMALIES))
def test_sample_traces(sample: str) -> None:
    result = invoke("anomalies", SAMPLES / sample, "--format", "json", "--fail")
    assert result.exit_code == (1 if EXPECTED_ANOMALIES[sample] else 0), result.output
    found = [(r["kind"], r["module"], r["step"], r["last_step"]) for r in json.loads(result.output)]
    assert found == EXPECTED_ANOMALIES[sample]

    layers = json.loads(invoke("dead-relus", SAMPLES / sample, "--format", "json").output)
    flagged = [(r["module"], r["dead"], r["since"]) for r in layers if r["flagged"]]
    assert flagged == ([("blocks.0.act", 16, 10)] if sample == "dead" else [])
    # NaN outputs are not dead units: the nan sample's ReLUs are read up to step 15
    assert all(r["dead"] == 0 for r in layers if r["module"] != "blocks.0.act" or sample != "dead")
