"""``hooktrace summary`` and ``hooktrace check`` through CliRunner, and the help texts."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import h5py
import pytest
import torch
from click.testing import CliRunner
from repo import ROOT
from torch import nn

import hooktrace
from hooktrace.cli import COMMANDS, cli
from hooktrace.trace import check_segments


@pytest.fixture
def run(run_dir: Path) -> Path:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, run_dir):
        for _ in range(3):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return run_dir


def test_summary(run: Path) -> None:
    result = CliRunner().invoke(cli, ["summary", str(run)])
    assert result.exit_code == 0, result.output
    assert "status    complete" in result.output
    assert "3 trained (steps 0–2), 3 micro-steps, 0 skipped" in result.output
    assert "modules   4 (roots: Sequential)" in result.output
    data = json.loads(CliRunner().invoke(cli, ["summary", "--json", str(run)]).output)
    assert data["steps"] == 3 and data["kinds"]["grad_output"] == 12  # root + 3 children, 3 steps


def test_check_whole_and_broken(run: Path) -> None:
    result = CliRunner().invoke(cli, ["check", str(run)])
    assert (result.exit_code, result.output.split(":")[1].split()[0]) == (0, "whole")

    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])  # truncated
    result = CliRunner().invoke(cli, ["check", str(run)])
    assert result.exit_code == 1
    assert "unreadable, left out: records/rank=0/part-000000.parquet" in result.output


def test_a_damaged_file_is_a_trace_warning_from_python(run: Path) -> None:
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:100])
    with pytest.warns(hooktrace.TraceWarning, match="left out records/rank=0/part-000000"):
        trace = hooktrace.load(run)
        assert trace.skipped
    assert issubclass(hooktrace.TraceWarning, UserWarning)


@pytest.mark.parametrize("block", [1 << 26, 40, 8, 4], ids=["whole", "row", "2 values", "1"])
def test_check_reads_every_full_tensor_against_its_checksum(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with hooktrace.record(model, run_dir, full_every=1):
        model(torch.randn(5, 4)).sum().backward()
    # (5, 8) float32 outputs: rows of 32 bytes, read whole, a row, 2 values or 1 at a time
    monkeypatch.setattr(check_segments, "_BLOCK_BYTES", block)
    assert CliRunner().invoke(cli, ["check", str(run_dir)]).exit_code == 0

    segment = next((run_dir / "tensors" / "rank=0").glob("seg-*.h5"))
    with h5py.File(segment, "r") as f:  # the last row of the first layer's output
        dataset = f[hooktrace.load(run_dir).record("0", "output", step=0)["tensor_key"]]
        offset = dataset.id.get_offset() + dataset.id.get_storage_size() - 1
    data = bytearray(segment.read_bytes())
    data[offset] ^= 0x01
    segment.write_bytes(bytes(data))
    result = CliRunner().invoke(cli, ["check", str(run_dir)])
    assert result.exit_code == 1
    assert "1 full tensor(s) cannot be read (t/" in result.output
    assert "no longer matches its checksum): those are lost" in result.output


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing", "no run at"),
        (lambda p: p, "is not a hooktrace run"),
        (lambda p: (p / "f").write_text("x") and p / "f", "is a file"),
    ],
)
def test_bad_runs_get_one_line_and_exit_2(tmp_path: Path, make, message: str) -> None:  # type: ignore[no-untyped-def]
    for command in ("summary", "check"):
        result = CliRunner().invoke(cli, [command, str(make(tmp_path))])
        assert result.exit_code == 2, result.output
        assert message in result.output
        assert len(result.output.strip().splitlines()) == 1
        assert "Traceback" not in result.output


def test_future_format_version_is_refused(run: Path) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["format_version"] = "9.0"
    (run / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(cli, ["summary", str(run)])
    assert result.exit_code == 2 and "upgrade hooktrace" in result.output


def test_every_command_has_help_with_an_example() -> None:
    for name in COMMANDS:
        result = CliRunner().invoke(cli, [name, "--help"])
        assert result.exit_code == 0, name
        assert "Example:" in result.output, name
        assert f"hooktrace {name}" in result.output, name


def test_every_command_is_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in COMMANDS:
        assert f"hooktrace {name}" in readme, name


def test_python_m_hooktrace(run: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hooktrace", "summary", str(run)], capture_output=True, text=True
    )
    assert result.returncode == 0 and "status    complete" in result.stdout


def test_the_command_line_runs_atexit_handlers_before_its_quick_exit(run: Path) -> None:
    # hooktrace.cli.run skips the interpreter's teardown after an analyzer command, not the
    # handlers registered to run at exit, nor the flush of what was printed
    code = (
        "import atexit, sys\n"
        "atexit.register(print, 'handler ran')\n"
        "class Loud:\n"
        "    def __del__(self):\n"
        "        print('torn down')\n"
        "keep = Loud()  # freed by the teardown, which prints\n"
        f"sys.argv = ['hooktrace', 'summary', {str(run)!r}]\n"
        "from hooktrace.cli import run\n"
        "run()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "status    complete" in done.stdout and done.stdout.endswith("handler ran\n")
    assert "torn down" not in done.stdout  # no teardown: the quick exit was taken
    stopped = code.replace("'summary', ", "'summary', '--nope', ")
    done = subprocess.run([sys.executable, "-c", stopped], capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("hooktrace: error: No such option")
    assert done.stdout == "handler ran\n"


def test_a_recorded_script_stays_main_until_the_interpreter_ends(tmp_path: Path) -> None:
    """As under ``python train.py``, the script's module is ``__main__`` to the end: its
    ``atexit`` handlers find it, and the teardown empties it name by name. Run by
    ``runpy.run_path``, it was a namespace left in a reference cycle, which the garbage
    collector could free raw stream first: an unclosed file lost its last writes, now and
    then (found when the package's layout changed when collections happened)."""
    script = tmp_path / "train.py"
    script.write_text(
        "import atexit, sys\n"
        "import torch\n"
        "MARK = 'the script'\n"
        "atexit.register(lambda: print('main is', sys.modules['__main__'].__dict__.get('MARK')))\n"
        "torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum().backward()\n"
    )
    for command in ([], ["-m", "hooktrace", "record", "-q", "-o", str(tmp_path / "run")]):
        done = subprocess.run(
            [sys.executable, *command, str(script)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == "main is the script\n", command


def test_a_recorded_script_gets_the_interpreters_whole_exit(tmp_path: Path) -> None:
    # record hands the script its own argv; what the script left to the teardown (a file
    # it never closed, an object's __del__) still happens after hooktrace record
    script = tmp_path / "train.py"
    script.write_text(
        "import sys\n"
        "import torch\n"
        "from torch import nn\n"
        f"log = open({str(tmp_path / 'log.txt')!r}, 'w')  # never closed: flushed at exit\n"
        "class Loud:\n"
        "    def __del__(self):\n"
        "        print('torn down')\n"
        "keep = Loud()\n"
        "model = nn.Linear(2, 1)\n"
        "for step in range(2):\n"
        "    model(torch.randn(3, 2)).sum().backward()\n"
        "    log.write(f'step {step} {sys.argv[1:]}\\n')\n"
    )
    for args in ([], ["--", "--epochs", "1"]):
        done = subprocess.run(
            [sys.executable, "-m", "hooktrace", "record", "-q", "--overwrite",
             "-o", str(tmp_path / "run"), str(script), *args],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert "torn down" in done.stdout, args
        expected = "['--epochs', '1']" if args else "[]"
        assert (tmp_path / "log.txt").read_text() == (f"step 0 {expected}\nstep 1 {expected}\n"), (
            args
        )


def _healthy_cut(tmp_path: Path, kind_dir: str) -> Path:
    """A copy of sample_traces/healthy with its one ``kind_dir`` part cut to 100 bytes."""
    import shutil

    run = tmp_path / "trunc"
    shutil.copytree(ROOT / "sample_traces" / "healthy", run)
    part = run / kind_dir / "rank=0" / "part-000000.parquet"
    part.write_bytes(part.read_bytes()[:100])
    return run


def invoke(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m hooktrace ARGS``, in a process of its own (exit codes as a shell sees them)."""
    return subprocess.run(
        [sys.executable, "-m", "hooktrace", *args], capture_output=True, text=True
    )


def test_a_filter_that_left_no_module_is_said_so_not_called_damage(tmp_path: Path) -> None:
    """A recording whose ``modules`` matched nothing is told so at once, and its trace holds
    steps and no record: summary and check say so, naming the filter (found in review: the
    recording said nothing, summary said the records were in damaged parts, check nothing)."""
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    run = tmp_path / "run"
    told = "modules=['nope'] selects no module of Sequential (names such as '0', '1')"
    with (
        pytest.warns(RuntimeWarning, match=re.escape(told)),
        hooktrace.record(model, run, modules=["nope"]),
    ):
        for _ in range(3):
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            opt.zero_grad()
    said = (
        "3 step(s) written hold no record: the recording's modules ['nope'] left no module of "
        "its models (names as in [n for n, _ in model.named_modules()])"
    )
    summary = CliRunner().invoke(cli, ["summary", str(run)])
    assert summary.exit_code == 0 and f"\nsteps     {said}\n" in summary.stdout, summary.output
    check = CliRunner().invoke(cli, ["check", str(run)])
    assert check.exit_code == 0 and f"  note: {said}\n" in check.stdout, check.output


def test_a_selected_module_never_called_is_not_blamed_on_the_filter(tmp_path: Path) -> None:
    """The filter selected a module that the forward never called: summary and check say
    so (found in review: they said the filter left no module)."""

    class WithUnused(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.unused = nn.Linear(2, 2), nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x)

    model = WithUnused()
    run = tmp_path / "run"
    with hooktrace.record(model, run, modules="unused", params=False) as rec:
        for _ in range(2):
            model(torch.ones(1, 2)).sum().backward()
            rec.step()
    said = "2 step(s) written hold no record: none of the 1 module(s) it selected was called"
    summary = CliRunner().invoke(cli, ["summary", str(run)])
    assert f"\nsteps     {said}\n" in summary.stdout, summary.output
    check = CliRunner().invoke(cli, ["check", str(run)])
    assert f"  note: {said}\n" in check.stdout, check.output


def test_a_damaged_records_part_is_named_and_the_answer_exits_as_check_does(
    tmp_path: Path,
) -> None:
    """sample_traces/healthy with its one records part cut to 100 bytes: every command that
    answers names the damaged part, says its answer leaves it out, and exits 1 as check
    does; one that cannot answer says why (the damage, not a filter or a missing step)."""
    run = _healthy_cut(tmp_path, "records")

    left_out = f"hooktrace: warning: {run}: left out records/rank=0/part-000000.parquet:"
    for answered in (["summary", str(run)], ["anomalies", str(run)], ["check", str(run)]):
        done = invoke(*answered)
        assert done.returncode == 1, (answered, done.stderr)
        if answered[0] != "check":  # check lists it among what was lost, on stdout
            assert done.stderr.startswith(left_out), done.stderr
            assert done.stderr.rstrip().endswith(
                "the answer leaves out what the damaged parts held; "
                "`hooktrace check RUN` says what was lost"
            )
    summary = invoke("summary", str(run))
    assert (
        "steps     none readable of 30 written (30 micro-steps): their records are in damaged "
        "parts\n" in summary.stdout
    )
    replay = invoke("replay", str(run), "--step", "3")
    assert replay.returncode == 2
    assert replay.stderr.splitlines()[-1] == (
        f"hooktrace: error: step 3 of {run} (rank 0) was recorded, but its records are in a "
        f"damaged part, left out: `hooktrace check {run}` says what was lost"
    )
    diff = invoke("diff", str(ROOT / "sample_traces" / "healthy"), str(run))
    assert diff.returncode == 2
    assert diff.stderr.splitlines()[-1] == (
        f"hooktrace: error: run B ({run}) has no readable records: 1 damaged part(s) were "
        f"left out; `hooktrace check {run}` says what was lost"
    )
    check = invoke("check", str(run))
    assert "rank 0 wrote 1500 records of 30 step(s), but only 0 records, of 0 step(s), are " in (
        check.stdout
    )


def test_a_damaged_histograms_part_is_not_called_missing(tmp_path: Path) -> None:
    """Histograms written and damaged are not 'none recorded: record with --histograms';
    and replay, which reads the trace once, names the damaged part once."""
    run = _healthy_cut(tmp_path, "histograms")

    damaged = f"its 1 histograms part(s) are damaged, left out: `hooktrace check {run}`"
    anomalies = invoke("anomalies", str(run))
    assert anomalies.returncode == 1
    assert f"note: no low-precision check was made: {damaged}" in anomalies.stdout
    assert "--histograms" not in anomalies.stdout
    hist = invoke("hist", str(run))
    assert hist.returncode == 2
    assert hist.stderr.splitlines()[-1] == (
        f"hooktrace: error: {run} holds no histograms: {damaged} says what was lost"
    )
    replay = invoke("replay", str(run), "--step", "3")
    assert replay.returncode == 1
    assert replay.stderr.count("left out histograms/rank=0/part-000000.parquet") == 1


def test_summary_quotes_the_command_as_a_shell_would_take_it(tmp_path: Path) -> None:
    """A path with a space reads as one argument (found in review: it read as two)."""
    model = nn.Linear(2, 2)
    run = tmp_path / "run"
    with hooktrace.record(model, run, command=["python", "my train.py", "--lr", "0.1"]) as rec:
        model(torch.ones(1, 2)).sum().backward()
        rec.step()
    summary = CliRunner().invoke(cli, ["summary", str(run)])
    assert "\ncommand   python 'my train.py' --lr 0.1\n" in summary.stdout, summary.output
