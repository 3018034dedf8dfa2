"""The committed sample traces: they load with the current reader, every command finds in
them what sample_traces/README.md says (golden outputs in tests/golden/, compared exactly but
for the recording's times, versions and sizes), and the seeded script that made them makes
them again.

HOOKTRACE_UPDATE_GOLDEN=1 rewrites the golden files from the current output (then read the
diff before committing it).
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner

import hooktrace
from hooktrace.cli import cli

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_traces"
GOLDEN = Path(__file__).resolve().parent / "golden"
NAMES = ("healthy", "diverged", "dead", "nan", "exploding", "underflow")
UPDATE = os.environ.get("HOOKTRACE_UPDATE_GOLDEN") == "1"

# golden file -> (the command line, with paths relative to the repository root; exit code)
COMMANDS = {
    "summary_healthy": ("summary sample_traces/healthy", 0),
    "check_healthy": ("check sample_traces/healthy", 0),
    "diff_healthy_diverged": ("diff sample_traces/healthy sample_traces/diverged --top 5", 1),
    "diff_before_step_12": ("diff sample_traces/healthy sample_traces/diverged --steps 0-11", 0),
    "dead_relus_dead": ("dead-relus sample_traces/dead --units", 0),
    "dead_relus_healthy": ("dead-relus sample_traces/healthy --fail", 0),
    "anomalies_nan": ("anomalies sample_traces/nan", 0),
    "anomalies_exploding": ("anomalies sample_traces/exploding --fail", 1),
    "anomalies_dead": ("anomalies sample_traces/dead", 0),
    "anomalies_healthy": ("anomalies sample_traces/healthy --fail", 0),
    "summary_fsdp2": ("summary sample_traces/distributed/fsdp2", 0),
    "diff_one_fsdp2": ("diff sample_traces/distributed/one sample_traces/distributed/fsdp2", 0),
    "diff_one_ddp": ("diff sample_traces/distributed/one sample_traces/distributed/ddp --top 3", 1),
    "anomalies_ddp": ("anomalies sample_traces/distributed/ddp", 0),
}

# what changes when the samples are made again: times, versions, the command, file sizes
_VOLATILE = [
    (re.compile(r"^(status +\w+), [\d.]+ s$", re.M), r"\1, <duration>"),
    (re.compile(r"^format +(\S+); .*$", re.M), r"format    \1; <versions>"),
    (re.compile(r"^command +.*$", re.M), "command   <command>"),
    (re.compile(r"^on disk +.*$", re.M), "on disk   <sizes>"),
]


def normalise(text: str) -> str:
    for pattern, replacement in _VOLATILE:
        text = pattern.sub(replacement, text)
    return text


def run_cli(
    command: str, monkeypatch: pytest.MonkeyPatch, files: Path | None = None
) -> tuple[int, str, str]:
    """Run ``hooktrace COMMAND`` from the repository root, so that paths in the output read
    as in the README (sample_traces/...); the file of ``-o FILE`` goes into ``files``."""
    monkeypatch.chdir(ROOT)
    args = command.split()
    if files is not None and "-o" in args:
        at = args.index("-o") + 1
        args[at] = str(files / args[at])
    if files is not None and args[:2] == ["export", "tensorboard"]:  # LOGDIR, as -o FILE
        args[3] = str(files / args[3])
    result = CliRunner().invoke(cli, args)
    where = f"{files}{os.sep}" if files is not None else None
    if where is not None:  # the output says what the README says: "wrote report.html"
        return result.exit_code, result.stdout, result.stderr.replace(where, "")
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("name", NAMES)
def test_each_sample_loads_whole(name: str) -> None:
    trace = hooktrace.load(SAMPLES / name)
    assert trace.status == "complete" and trace.skipped == []
    assert hooktrace.check(trace).whole
    assert sorted(trace.steps["step"]) == list(range(30))
    assert trace.records.groupby("step").size().min() == 50  # every module, every step
    kinds = set(trace.records["kind"].astype(str))
    assert kinds == {"output", "grad_output", "param", "grad_param"}


def test_samples_stay_small() -> None:
    size = sum(p.stat().st_size for p in SAMPLES.rglob("*") if p.is_file())
    assert size < 2_000_000, f"sample_traces/ holds {size:,} bytes: keep it to a few MB at most"


@pytest.mark.parametrize("golden", sorted(COMMANDS))
def test_cli_output_matches_golden(golden: str, monkeypatch: pytest.MonkeyPatch) -> None:
    command, expected_exit = COMMANDS[golden]
    code, stdout, stderr = run_cli(command, monkeypatch)
    assert code == expected_exit, f"hooktrace {command} exited {code}\n{stdout}{stderr}"
    assert stderr == ""
    path = GOLDEN / f"{golden}.txt"
    text = f"$ hooktrace {command}\n{normalise(stdout)}"
    if UPDATE:
        path.write_text(text)
    assert path.exists(), f"no golden file {path.name}: run with HOOKTRACE_UPDATE_GOLDEN=1"
    assert text == path.read_text(), f"hooktrace {command} changed: see {path}"


def readme_examples(readme: Path) -> list[tuple[str, list[str]]]:
    """Each ``$ hooktrace ...`` line of the console blocks of ``readme`` that reads the
    sample traces, with the output lines quoted under it ("..." marks what was left out)."""
    examples: list[tuple[str, list[str]]] = []
    in_console = False
    for line in (readme.read_text() if readme.exists() else "").splitlines():
        if line.startswith("```"):
            in_console = line.strip() == "```console"
            continue
        if not in_console:
            continue
        if line.startswith("$ "):
            examples.append((line.removeprefix("$ hooktrace "), []))
        elif examples:
            examples[-1][1].append(line)
    return [(command, quoted) for command, quoted in examples if "sample_traces/" in command]


EXAMPLES = [
    (readme, command, quoted)
    for readme in (SAMPLES / "README.md", ROOT / "README.md")
    for command, quoted in readme_examples(readme)
]


def test_readme_shows_a_command_for_every_sample() -> None:
    commands = [command for command, _ in readme_examples(SAMPLES / "README.md")]
    for name in NAMES:
        assert any(f"sample_traces/{name}" in c for c in commands), name


@pytest.mark.parametrize(
    ("readme", "command", "quoted"),
    EXAMPLES,
    ids=[f"{readme.relative_to(ROOT)}: {command}" for readme, command, _ in EXAMPLES],
)
def test_readme_output_is_real(
    readme: Path, command: str, quoted: list[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """What the README quotes is what the command prints today (on stdout, or on stderr for
    the commands that write a file and say so there), line for line, times included (they
    are the committed traces'): a "..." line marks each place where lines were left out,
    and nothing else is left out (blank lines aside)."""
    code, stdout, stderr = run_cli(command, monkeypatch, tmp_path)
    assert code in (0, 1), stderr
    actual = [line.rstrip() for line in (stdout or stderr).splitlines() if line.strip()]
    runs: list[list[str]] = [[]]  # the quoted lines between the "..." marks
    for line in quoted:
        if line.strip() == "...":
            runs.append([])
        elif line.strip():
            runs[-1].append(line.rstrip())
    position = 0
    for i, run in enumerate(runs):
        if not run:
            continue
        found = next(
            (
                at
                for at in range(position, len(actual) - len(run) + 1)
                if actual[at : at + len(run)] == run
            ),
            None,
        )
        assert found is not None, f"`hooktrace {command}` no longer prints:\n" + "\n".join(run)
        assert i > 0 or found == 0, f"`hooktrace {command}`: lines left out above, no '...'"
        position = found + len(run)
    last = runs[-1]
    assert not last or position == len(actual), (
        f"`hooktrace {command}` prints more than the README quotes, and no '...' says so:\n"
        + "\n".join(actual[position:])
    )


def test_the_tour_in_the_readme_runs_as_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``>>>`` examples of README.md, as doctests (from the repository root)."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "README.md").read_text()
    blocks = [b.partition("```")[0] for b in text.split("```python\n")[1:] if ">>> " in b]
    assert blocks, "README.md has no >>> examples"
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    for i, block in enumerate(blocks):
        runner.run(parser.get_doctest(block, {}, f"README.md block {i}", "README.md", 0))
    assert runner.summarize(verbose=False).failed == 0


def test_the_pictures_the_readme_shows_are_there() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in ("grad-norms", "diff"):
        path = SAMPLES / "pictures" / f"{name}.png"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"(sample_traces/pictures/{name}.png)" in readme


def test_the_documented_findings() -> None:
    """What each sample plants, found where sample_traces/README.md says."""
    diff = hooktrace.diff(SAMPLES / "healthy", SAMPLES / "diverged")
    assert diff.first is not None
    assert (diff.first.step, diff.first.module, diff.first.kind) == (12, "blocks.1.norm", "output")
    assert hooktrace.diff(SAMPLES / "healthy", SAMPLES / "diverged", steps=(0, 11)).match

    dead = hooktrace.dead_relus(SAMPLES / "dead")
    flagged = dead.flagged
    assert flagged["module"].tolist() == ["blocks.0.act"]
    assert (flagged["dead"].item(), flagged["since"].item()) == (16, 10)
    assert sorted(dead.units["unit"]) == list(range(16))

    nan = hooktrace.anomalies(SAMPLES / "nan").findings
    origin = nan[nan["kind"] == "nonfinite_forward"]
    assert origin[["module", "step"]].values.tolist() == [["log_probs", 15]]

    exploding = hooktrace.anomalies(SAMPLES / "exploding").findings
    assert set(exploding["kind"]) == {"exploding_gradient", "fp16_overflow"}
    assert exploding["step"].min() == 20
    assert len(hooktrace.anomalies(SAMPLES / "healthy")) == 0


def test_make_samples_makes_the_same_numbers(tmp_path: Path) -> None:
    """Regenerating writes the committed records again, their numbers within float32
    rounding: the committed traces predate the one-pass kernel, whose float64 sums differ
    from theirs in the 8th digit, and another CPU's vector kernels round otherwise too."""
    made = subprocess.run(
        [sys.executable, str(SAMPLES / "make_samples.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert made.returncode == 0, made.stderr
    keys = ["step", "seq", "module", "call", "kind", "slot", "shape", "numel"]
    numbers = ["mean", "std", "min", "max", "norm", "zero_fraction", "nan_count", "inf_count"]
    for name in NAMES:
        committed = hooktrace.load(SAMPLES / name).records
        again = hooktrace.load(tmp_path / name).records
        pd.testing.assert_frame_equal(
            committed[keys].astype(str), again[keys].astype(str), check_categorical=False
        )
        # float32 rounding that another CPU's vector kernels do otherwise grows with the
        # values: each record's numbers are compared at the scale of its own largest value
        # (the exploding sample's gradients differ in the 6th digit on some hosts)
        expected = committed[numbers].to_numpy(dtype=float)
        scale = np.abs(np.nan_to_num(expected[:, :5], posinf=0.0, neginf=0.0)).max(axis=1)[:, None]
        with np.errstate(invalid="ignore"):  # inf - inf: equal infinities compare as 0
            difference = np.abs(again[numbers].to_numpy(dtype=float) - expected)
        np.testing.assert_array_less(
            np.nan_to_num(difference, nan=0.0),
            1e-5 * np.abs(np.nan_to_num(expected)) + 1e-5 * scale + 1e-7,
            err_msg=f"sample {name}: run sample_traces/make_samples.py and commit the traces",
        )
        assert (again[numbers].isna() == committed[numbers].isna()).all().all(), name


def test_an_empty_filter_leaves_the_trace_whole() -> None:
    """query(modules=[]) once failed inside pyarrow (an untyped empty value set), which the
    reader took for a damaged part: it warned and left the part out of every later read."""
    trace = hooktrace.load(SAMPLES / "healthy")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert trace.query(modules=[]).empty
        assert trace.query(kinds=[], steps=[]).empty
    assert trace.skipped == [] and len(trace.records) == 1500
