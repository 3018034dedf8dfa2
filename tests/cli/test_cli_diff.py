"""``hooktrace diff`` through CliRunner: the report, the formats and the exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner, Result
from diff_runs import perturb_weight, train

import hooktrace
from hooktrace.analyze.diff import diff as diff_library
from hooktrace.cli import cli
from hooktrace.cli import diff as diff_command
from hooktrace.trace.stream import RecordStream


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cli-diff")
    return {
        "a": train(root / "a"),
        "same": train(root / "same"),
        "perturbed": train(root / "perturbed", before_step=perturb_weight("fc2", 2)),
        "wide": train(root / "wide", hidden=16, extra=True),
    }


def invoke(*args: object) -> Result:
    return CliRunner().invoke(cli, ["diff", *map(str, args)])


def assert_one_line_error(result: Result, expected: str) -> None:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hooktrace: error: "), result.stderr
    assert expected in lines[0]
    assert "Traceback" not in result.output


def test_match_exits_0(runs: dict[str, Path]) -> None:
    result = invoke(runs["a"], runs["same"])
    assert result.exit_code == 0, result.output
    records = len(hooktrace.load(runs["a"]).records)
    assert result.stdout == (
        f"MATCH  {runs['a']} vs {runs['same']}: {records:,} records over 4 steps (0–3) agree "
        "(rtol 1e-05, atol 1e-08)\n"
    )


def test_differ_exits_1_with_first_divergence_and_modules(runs: dict[str, Path]) -> None:
    result = invoke(runs["a"], runs["perturbed"], "--top", "2")
    assert result.exit_code == 1, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"DIFFER  {runs['a']} vs {runs['perturbed']}")
    assert lines[2].startswith(
        "first divergence: step 2, forward pass: param of 'fc2' (slot weight, call 0, micro-step 0,"
    )
    header = lines.index("modules that differ most at step 3 (the last common step):")
    assert lines[header + 1].split() == [
        "module",
        "differing",
        "rel",
        "diff",
        "max",
        "abs",
        "err",
        "since",
        "step",
    ]
    assert len(lines[header + 2 :]) == 2  # --top 2
    listed = {line.split()[0] for line in lines[header + 2 :]}
    assert listed <= {"fc1", "fc2", "act", "scale", "Net"}


def test_different_architectures_exit_1_with_structure(runs: dict[str, Path]) -> None:
    result = invoke(runs["a"], runs["wide"])
    assert result.exit_code == 1, result.output
    assert "structure:" in result.stdout
    assert "  modules only in run B (1): extra" in result.stdout
    assert "changed: param of 'fc1' slot weight from step 0: shape 8,4 -> 16,4" in result.stdout


def test_csv_json_parquet(runs: dict[str, Path], tmp_path: Path) -> None:
    expected = hooktrace.diff(runs["a"], runs["perturbed"]).table
    csv = invoke(runs["a"], runs["perturbed"], "--format", "csv")
    assert csv.exit_code == 1
    frame = pd.read_csv(StringIO(csv.stdout))
    assert len(frame) == len(expected) > 0
    assert list(frame.iloc[0][["step", "module", "kind", "slot"]]) == [2, "fc2", "param", "weight"]
    data = json.loads(invoke(runs["a"], runs["perturbed"], "--format", "json").stdout)
    assert len(data) == len(expected) and data[0]["status"] == "differs"
    assert json.loads(invoke(runs["a"], runs["same"], "--format", "json").stdout) == []
    out = tmp_path / "diff.parquet"
    result = invoke(runs["a"], runs["perturbed"], "--format", "parquet", "--output", out, "--all")
    assert result.exit_code == 1 and result.stdout == ""
    table = pd.read_parquet(out)
    assert len(table) == len(hooktrace.load(runs["a"]).records)
    assert set(table["status"]) == {"equal", "differs"}


def test_output_file_and_filters(runs: dict[str, Path], tmp_path: Path) -> None:
    report = tmp_path / "report.txt"
    result = invoke(
        runs["a"], runs["perturbed"], "--kinds", "grad_param", "--steps", "0-3", "-o", report
    )
    assert result.exit_code == 1 and result.stdout == ""
    assert "first divergence: step 2, backward pass: grad_param of" in report.read_text()
    assert invoke(runs["a"], runs["perturbed"], "--steps", "0-1").exit_code == 0
    assert (
        invoke(runs["a"], runs["perturbed"], "--modules", "^fc1$", "--steps", "0-1").exit_code == 0
    )
    assert invoke(runs["a"], runs["perturbed"], "--atol", "100").exit_code == 0


def test_rank_against_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "ddp"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        train(run)
    result = invoke(run, "--rank", "0", "--against-rank", "1")
    assert result.exit_code == 0, result.output
    records = len(hooktrace.load(run).query(ranks=[0]))
    assert result.stdout.startswith(
        f"MATCH  {run} rank 0 vs rank 1: {records} records over 4 steps"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{missing}", "{a}"], "no run at"),
        (["{a}"], "give RUN_B, or --against-rank"),
        (["{a}", "{a}", "--kinds", "outputs"], "unknown kind(s) outputs"),
        (["{a}", "{a}", "--steps", "x-y"], "bad step range"),
        (["{a}", "{a}", "--ranks", "one"], "bad --ranks"),
        (["{a}", "{a}", "--steps", "50-"], "no records that match"),
        (["{a}", "{a}", "--format", "parquet"], "give --output"),
        (["{a}", "{a}", "--rank", "1"], "--rank goes with --against-rank"),
        (["{a}", "{a}", "--modules", "("], "bad module pattern"),
        (["{a}", "{a}", "--steps", "99999999999999999999-"], "go up to 9,223,372,036"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    runs: dict[str, Path], tmp_path: Path, args: list[str], message: str
) -> None:
    paths = {"a": runs["a"], "missing": tmp_path / "missing"}
    assert_one_line_error(invoke(*(a.format(**paths) for a in args)), message)


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_a_diff_that_fails_leaves_no_file_and_an_earlier_one_as_it_was(
    runs: dict[str, Path], tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / f"out.{fmt}"
    # no step of the window: the diff fails before a row is written
    assert_one_line_error(
        invoke(runs["a"], runs["a"], "--steps", "50-60", "--format", fmt, "-o", out),
        "no records that match",
    )
    assert list(tmp_path.iterdir()) == []
    out.write_text("an earlier answer")
    # the diff fails half way, rows written: the earlier file is left, nothing beside it
    real = diff_library.in_chunks
    monkeypatch.setattr(diff_library, "in_chunks", lambda s, n, budget, first: real(s, n, 40))
    through = RecordStream.through

    def fails_at_step_2(self: object, step: int) -> object:
        if step >= 2:
            raise hooktrace.errors.TraceError("cannot read the records: failed at step 2")
        return through(self, step)  # type: ignore[arg-type]

    monkeypatch.setattr(RecordStream, "through", fails_at_step_2)
    written: list[int] = []
    sink = diff_command.FrameWriter.write
    monkeypatch.setattr(
        diff_command.FrameWriter, "write", lambda w, f: (written.append(len(f)), sink(w, f))[1]
    )
    result = invoke(runs["a"], runs["perturbed"], "--all", "--format", fmt, "-o", out)
    assert_one_line_error(result, "failed at step 2")
    assert sum(written) > 0  # rows were written before it failed
    assert out.read_text() == "an earlier answer"
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_a_diff_that_succeeds_replaces_the_file(runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    out.write_text("an earlier answer")
    assert invoke(runs["a"], runs["perturbed"], "--format", "json", "-o", out).exit_code == 1
    assert {row["status"] for row in json.loads(out.read_text())} == {"differs"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_defaults_are_the_library_defaults() -> None:
    assert diff_command.RTOL == diff_library.DEFAULT_RTOL
    assert diff_command.ATOL == diff_library.DEFAULT_ATOL
    result = CliRunner().invoke(cli, ["diff", "--help"])
    assert result.exit_code == 0 and "Example:" in result.output


def test_works_without_torch(runs: dict[str, Path]) -> None:
    def run(*args: Path) -> subprocess.CompletedProcess[str]:
        code = (
            "import sys; sys.modules['torch'] = None\n"
            "from hooktrace.cli import main\n"
            f"main(['diff', *{[str(a) for a in args]!r}])\n"
        )
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)

    same = run(runs["a"], runs["same"])
    assert same.returncode == 0 and same.stdout.startswith("MATCH"), same.stderr
    differ = run(runs["a"], runs["perturbed"])
    assert differ.returncode == 1 and differ.stdout.startswith("DIFFER"), differ.stderr
    missing = run(runs["a"], runs["a"].parent / "nope")
    assert missing.returncode == 2 and missing.stderr.startswith("hooktrace: error: no run at")


def test_the_command_line_exits_with_its_code_once_all_its_output_is_out(
    runs: dict[str, Path],
) -> None:
    # `python -m hooktrace` ends without the interpreter's teardown (hooktrace.cli.run): what
    # the command wrote to a pipe must all be there, with the command's exit code
    def run(*args: object) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "hooktrace", "diff", *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True)

    differ = run(runs["a"], runs["perturbed"], "--all", "--format", "csv")
    assert differ.returncode == 1, differ.stderr
    written = pd.read_csv(StringIO(differ.stdout))
    expected = hooktrace.diff(runs["a"], runs["perturbed"], rows="all").table
    assert len(written) == len(expected) == hooktrace.load(runs["a"]).record_count
    assert run(runs["a"], runs["same"]).returncode == 0
    missing = run(runs["a"], runs["a"].parent / "nope")
    assert missing.returncode == 2 and missing.stderr.startswith("hooktrace: error: no run at")
