"""A script recorded with ``hooktrace record`` behaves exactly as it does unrecorded.

Each script in scripts/ is run twice in child processes, plainly and under
``python -m hooktrace record``, at the same time (they are independent, and this machine has
two cores). The two runs must agree on the exit code, stdout, stderr (less hooktrace's own
``hooktrace:`` lines) and, bit for bit, the parameters the script saves at its end; the
trace must load, be whole, and hold the steps and roots the script's ``# expect:`` line
names. See README.md in this folder.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import hooktrace
from hooktrace.analyze.overview.summary import summary

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TIMEOUT_S = 90  # per child: each takes a few seconds; a hung one fails its test

_EXPECT = re.compile(r"^# expect:(.*)$", re.MULTILINE)
_TERM = re.compile(r"^(exit|steps|roots|modules|status)(>=|=)(\S+)$")


@dataclass(frozen=True)
class Expect:
    """A script's ``# expect:`` line, e.g. ``# expect: exit=0 steps=4 roots=Net,Net#1``.

    Terms, separated by spaces:
    - ``exit=N``: the exit code (default 0);
    - ``steps=N``: the steps that trained are 0 to N-1 (``hooktrace summary``'s count);
    - ``roots=A,B``: the roots are exactly these; ``roots>=A,B``: at least these;
    - ``modules=A,B``: the recorded modules are exactly these (optional);
    - ``status=S``: the trace's status (default ``complete``, which ``check`` must call
      whole; any other status must be the only problem ``check`` finds).
    """

    steps: int
    roots: frozenset[str]
    roots_at_least: bool = False
    exit: int = 0
    modules: frozenset[str] | None = None
    status: str = "complete"

    @classmethod
    def of(cls, script: Path) -> Expect:
        lines = _EXPECT.findall(script.read_text())
        if len(lines) != 1:
            raise ValueError(f"{script.name}: needs exactly one '# expect:' line")
        terms: dict[str, object] = {}
        for term in lines[0].split():
            match = _TERM.match(term)
            if match is None or (match[2] == ">=" and match[1] != "roots"):
                raise ValueError(f"{script.name}: cannot read {term!r} in its '# expect:' line")
            key, op, value = match.groups()
            if key in ("exit", "steps"):
                terms[key] = int(value)
            elif key in ("roots", "modules"):
                terms[key] = frozenset(value.split(","))
                if op == ">=":
                    terms["roots_at_least"] = True
            else:
                terms[key] = value
        if "steps" not in terms or "roots" not in terms:
            raise ValueError(f"{script.name}: its '# expect:' line needs steps= and roots=")
        return cls(**terms)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Run:
    returncode: int
    stdout: str
    stderr: str

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.stderr.splitlines()[-lines:])


def run_children(*commands: list[str], cwd: Path) -> list[Run]:
    """Run the commands at the same time; their results in order. Each runs in a process
    group of its own, killed at the end with whatever it left behind (a hung worker)."""
    procs = [
        subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for command in commands
    ]
    runs = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
            runs.append(Run(proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return runs


@dataclass(frozen=True)
class Runs:
    """A script run plainly and recorded: both runs, their parameter files and the trace."""

    script: Path
    plain: Run
    recorded: Run
    plain_out: Path
    recorded_out: Path
    run_dir: Path


def plain_and_recorded(script: Path, tmp_path: Path) -> Runs:
    plain_out, recorded_out = tmp_path / "plain.pt", tmp_path / "recorded.pt"
    run_dir = tmp_path / "run"
    record = ["-m", "hooktrace", "record", "--overwrite", "-o", str(run_dir)]
    plain, recorded = run_children(
        [sys.executable, str(script), str(plain_out)],
        [sys.executable, *record, str(script), "--", str(recorded_out)],
        cwd=tmp_path,
    )
    return Runs(script, plain, recorded, plain_out, recorded_out, run_dir)


def script_stderr(stderr: str) -> list[str]:
    """The lines of a recorded run's stderr that are not hooktrace's own: its ``hooktrace:``
    lines, and its warnings (the README's, e.g. for a compiled model) with the source line
    Python shows under each."""
    kept: list[str] = []
    lines = iter(stderr.splitlines())
    for line in lines:
        if line.startswith("hooktrace:"):
            continue
        if "Warning: hooktrace: " in line:
            next(lines, None)  # the warned line's source, indented
            continue
        kept.append(line)
    return kept


def assert_same_params(plain_out: Path, recorded_out: Path, recorded: Run) -> None:
    assert recorded_out.exists(), f"the recorded run saved no parameters:\n{recorded.tail()}"
    a = torch.load(plain_out, weights_only=True)
    b = torch.load(recorded_out, weights_only=True)
    assert sorted(a) == sorted(b)
    differ = [name for name in a if not _identical(a[name], b[name])]
    assert not differ, f"parameters not bit-identical with recording: {differ}"


def _identical(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def assert_trace(run_dir: Path, expect: Expect) -> None:
    trace = hooktrace.load(run_dir)
    report = hooktrace.check(run_dir)
    assert report.status == expect.status, report.problems
    if expect.status == "complete":
        assert report.whole, report.problems
    else:  # finished by the script's failure: nothing else may be lost
        others = [p for p in report.problems if not p.startswith(f"rank 0 is {expect.status} ")]
        assert len(report.problems) == 1 and not others, report.problems
    # the steps that trained, as the script counts them (an evaluation after the last
    # optimizer step is shown apart by summary)
    found = summary(trace)
    steps = trace.steps[["step", "micro_steps"]]
    assert (found.steps, found.first_step) == (expect.steps, 0 if expect.steps else None), steps
    assert found.last_step == (expect.steps - 1 if expect.steps else None), steps
    roots = set(trace.modules["root"].astype(str))
    if expect.roots_at_least:
        assert roots >= expect.roots, sorted(roots)
    else:
        assert roots == expect.roots, sorted(roots)
    if expect.modules is not None:
        assert set(trace.modules["module"].astype(str)) == expect.modules


def assert_transparent(runs: Runs) -> None:
    """Everything the plain and the recorded run must share, and what the trace must hold."""
    expect = Expect.of(runs.script)
    plain, recorded = runs.plain, runs.recorded
    assert plain.returncode == expect.exit, f"the script itself fails:\n{plain.tail()}"
    assert recorded.stderr.startswith("hooktrace: recording "), recorded.tail()
    assert recorded.returncode == plain.returncode, recorded.tail()
    assert recorded.stdout == plain.stdout
    assert script_stderr(recorded.stderr) == plain.stderr.splitlines()
    if expect.exit != 0:  # the script's own last words, e.g. its exception
        assert script_stderr(recorded.stderr)[-1:] == plain.stderr.splitlines()[-1:]
    assert_same_params(runs.plain_out, runs.recorded_out, recorded)
    assert_trace(runs.run_dir, expect)


# save_model_file.py is run (and checked as the others are) by
# test_saved_model_loads_without_hooktrace, which also loads what it saved.
PARAMETRIZED = sorted(p for p in SCRIPTS.glob("*.py") if p.name != "save_model_file.py")


@pytest.mark.parametrize("script", PARAMETRIZED, ids=lambda p: p.stem)
def test_recorded_run_behaves_as_plain(script: Path, tmp_path: Path) -> None:
    assert_transparent(plain_and_recorded(script, tmp_path))


# Loads a model file in a process where hooktrace cannot be imported, calls it, and prints
# what it finds: the model must hold nothing that needs hooktrace.
LOADER = """
import sys
sys.modules["hooktrace"] = None  # `import hooktrace` now raises ImportError
try:
    import hooktrace
except ImportError:
    print("hooktrace cannot be imported")
import torch
model = torch.load(sys.argv[1], weights_only=False)
dicts = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
print(type(model).__name__, "hooks", [sum(len(getattr(m, d)) for m in model.modules()) for d in dicts])
torch.manual_seed(1)
out = model(torch.randn(2, 8))
out.square().sum().backward()
print("output", out.detach().numpy().round(4).tolist())
print("grad norm", round(model[0].weight.grad.norm().item(), 4))
"""


def test_saved_model_loads_without_hooktrace(tmp_path: Path) -> None:
    runs = plain_and_recorded(SCRIPTS / "save_model_file.py", tmp_path)
    assert runs.plain.returncode == 0, runs.plain.tail()
    assert runs.recorded.returncode == 0, runs.recorded.tail()
    from_plain, from_recorded = run_children(
        [sys.executable, "-c", LOADER, f"{runs.plain_out}.model"],
        [sys.executable, "-c", LOADER, f"{runs.recorded_out}.model"],
        cwd=tmp_path,
    )
    assert from_plain.returncode == 0, from_plain.tail()
    assert from_plain.stdout.startswith(
        "hooktrace cannot be imported\nSequential hooks [0, 0, 0, 0]"
    )
    assert from_recorded.returncode == 0, from_recorded.tail()
    assert from_recorded.stdout == from_plain.stdout
    assert from_recorded.stderr == from_plain.stderr
    assert_transparent(runs)
