"""``hooktrace record SCRIPT``: real training loops, recorded through the CLI in subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import click
import pytest
import torch
from repo import ROOT

import hooktrace
from hooktrace.analyze.overview.summary import summary

PRELUDE = """
import sys, torch
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 4, generator=g), torch.randint(0, 2, (6,), generator=g)
criterion = nn.CrossEntropyLoss()
"""

LOOPS = {
    "optimizer": (
        """
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(4):
            x, y = batch(i)
            criterion(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        """,
        {"steps": [0, 1, 2, 3], "micro_steps": [1, 1, 1, 1], "skipped": []},
    ),
    "accumulation": (
        """
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for i in range(6):
            x, y = batch(i)
            (criterion(model(x), y) / 3).backward()
            if (i + 1) % 3 == 0:
                opt.step()
                opt.zero_grad()
        """,
        {"steps": [0, 1], "micro_steps": [3, 3], "skipped": []},
    ),
    "grad_scaler_skip": (
        """
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu")
        for i in range(4):
            x, y = batch(i)
            loss = criterion(model(x), y)
            if i == 2:
                loss = loss * float("inf")  # overflow: the scaler skips this step
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        """,
        {"steps": [0, 1, 2, 3], "micro_steps": [1, 1, 1, 1], "skipped": [2]},
    ),
    "manual_skip": (
        """
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(4):
            x, y = batch(i)
            loss = criterion(model(x), y) * (float("nan") if i == 1 else 1.0)
            loss.backward()
            if torch.isfinite(loss):
                opt.step()
            opt.zero_grad()
        """,
        {"steps": [0, 1, 2, 3], "micro_steps": [1, 1, 1, 1], "skipped": [1]},
    ),
    "lbfgs": (
        """
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=3)
        x, y = batch(0)
        calls = 0
        def closure():
            global calls
            calls += 1
            opt.zero_grad()
            loss = criterion(model(x), y)
            loss.backward()
            return loss
        for i in range(3):
            opt.step(closure)
        print("CLOSURE_CALLS", calls)
        """,
        {"steps": [0, 1, 2], "skipped": []},
    ),
    "no_optimizer": (
        """
        for i in range(3):
            x, y = batch(i)
            criterion(model(x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p.data.add_(p.grad, alpha=-0.1)
                    p.grad = None
        """,
        {"steps": [0, 1, 2], "micro_steps": [1, 1, 1], "skipped": []},
    ),
    "eval_inside_training": (
        """
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i in range(4):
            x, y = batch(i)
            criterion(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i % 2 == 1:
                model.eval()
                with torch.no_grad():
                    for j in range(3):
                        model(batch(100 + j)[0])
                model.train()
        """,
        # steps 0-3 train; evaluations after steps 1 and 3 land in steps 2 and 4, phase eval
        {
            "steps": [0, 1, 2, 3, 4],
            "micro_steps": [1, 1, 1, 1, 0],
            "skipped": [],
            "eval_steps": [2, 4],
        },
    ),
    "inference_only": (
        """
        model.eval()
        with torch.no_grad():
            for i in range(5):
                model(batch(i)[0])
        """,
        {"steps": [0, 1, 2, 3, 4], "micro_steps": [0, 0, 0, 0, 0], "skipped": []},
    ),
}


def _script(tmp_path: Path, body: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(PRELUDE + textwrap.dedent(body))
    return path


def _record(
    *args: str, cwd: Path | None = None, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hooktrace", "record", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        **kwargs,
    )  # type: ignore[call-overload,no-any-return]


@pytest.mark.parametrize("loop", list(LOOPS))
def test_steps_in_real_training_loops(tmp_path: Path, loop: str) -> None:
    body, expected = LOOPS[loop]
    run = tmp_path / "run"
    result = _record("-q", "-o", str(run), str(_script(tmp_path, body)))
    assert result.returncode == 0, result.stderr
    trace = hooktrace.load(run)
    steps = trace.steps
    assert list(steps["step"]) == expected["steps"]
    if "micro_steps" in expected:
        assert list(steps["micro_steps"]) == expected["micro_steps"]
    assert list(steps.loc[steps["skipped"], "step"]) == expected["skipped"]
    if loop == "lbfgs":  # every closure evaluation is a backward pass of its step
        calls = int(result.stdout.split("CLOSURE_CALLS")[1])
        assert steps["micro_steps"].sum() == calls and (steps["micro_steps"] >= 1).all()
    records = trace.records
    if "eval_steps" in expected:
        assert (
            sorted(set(records.loc[records["phase"] == "eval", "step"])) == expected["eval_steps"]
        )
    # names as in named_modules(); the loss module is a root of its own
    assert {"0", "1", "2", "Sequential"} <= set(records["module"])
    assert trace.status == "complete"


def test_the_script_runs_as_main_with_its_own_argv_path_and_file(tmp_path: Path) -> None:
    (tmp_path / "helper_mod.py").write_text("VALUE = 41\n")
    script = _script(
        tmp_path,
        """
        import helper_mod
        print("ARGV", sys.argv)
        print("FILE", __file__)
        print("NAME", __name__, helper_mod.VALUE + 1)
        """,
    )
    result = _record(
        "-q", "-o", str(tmp_path / "run"), str(script), "--epochs", "3", "-x", cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert f"ARGV ['{script}', '--epochs', '3', '-x']" in result.stdout
    assert f"FILE {script}" in result.stdout
    # `record train.py -- ARGS`, as PRODUCT.md writes it: the separator is not the script's
    result = _record(
        "-q", "-o", str(tmp_path / "run2"), str(script), "--", "--epochs", "3", cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    assert f"ARGV ['{script}', '--epochs', '3']" in result.stdout
    result = _record("-q", "-o", str(tmp_path / "run3"), str(script), "--", "--", cwd=ROOT)
    assert f"ARGV ['{script}', '--']" in result.stdout  # a second one is the script's
    assert "NAME __main__ 42" in result.stdout


def test_a_symlinked_script_given_by_a_relative_path_sees_what_python_shows_it(
    tmp_path: Path,
) -> None:
    """``__file__``, ``sys.argv[0]``, ``sys.path[0]``, the files beside ``__file__`` and the
    traceback's path are as `python ./link/train.py` makes them (found in review: hooktrace
    resolved the symlink, so the script read the data beside its target, and normalised
    the path it was given)."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.mkdir()
    (real / "lr.txt").write_text("0.07")
    (link / "lr.txt").write_text("0.05")
    _script(
        real,
        """
        from pathlib import Path
        print("FILE", __file__, "ARGV0", sys.argv[0], "PATH0", sys.path[0])
        print("LR", (Path(__file__).parent / "lr.txt").read_text())
        raise ValueError("the end")
        """,
    )
    (link / "train.py").symlink_to(real / "train.py")
    plain = subprocess.run(
        [sys.executable, "./link/train.py"], capture_output=True, text=True, cwd=tmp_path
    )
    recorded = _record("-q", "-o", str(tmp_path / "run"), "./link/train.py", cwd=tmp_path)
    assert f"FILE {tmp_path}/./link/train.py ARGV0 ./link/train.py PATH0 {real}" in plain.stdout
    assert "LR 0.05" in plain.stdout
    assert (recorded.returncode, recorded.stdout) == (plain.returncode, plain.stdout)
    assert recorded.stderr.splitlines()[-3:] == plain.stderr.splitlines()[-3:]


def test_a_script_that_raises_keeps_its_traceback_and_exit_code(tmp_path: Path) -> None:
    body = """
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = batch(i)
        criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    raise ValueError("boom at the end")
    """
    script = _script(tmp_path, body)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    result = _record("-q", "-o", str(tmp_path / "run"), str(script))
    assert result.returncode == plain.returncode == 1
    assert result.stderr == plain.stderr  # the script's own traceback, no hooktrace frames
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "failed"
    assert "ValueError: boom at the end" in trace.manifest["ranks"]["0"]["error"]
    assert list(trace.steps["step"]) == [0, 1, 2]


def test_a_script_that_does_not_compile_is_reported_as_python_reports_it(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("import torch\ndef (\n")
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    result = _record("-q", "-o", str(tmp_path / "run"), str(script))
    assert result.returncode == plain.returncode == 1
    assert result.stderr == plain.stderr  # no frame of hooktrace's, nor of runpy's
    assert "SyntaxError" in result.stderr and "hooktrace" not in result.stderr


def test_the_closing_report_says_why_a_run_holds_no_record(tmp_path: Path) -> None:
    quiet = tmp_path / "quiet.py"
    quiet.write_text("import torch\nprint(torch.ones(2).sum().item())\n")
    result = _record("-o", str(tmp_path / "run"), str(quiet))
    assert result.returncode == 0, result.stderr
    closing = result.stderr.splitlines()[-1]
    assert closing == (
        f"hooktrace: complete: 0 steps, 0 records in {tmp_path / 'run'} (no nn.Module was "
        "called: hooktrace records the models the script calls)"
    )
    again = _record("-o", str(tmp_path / "run"), str(quiet))
    assert again.returncode == 2
    assert "overwrite it (hooktrace record --overwrite; overwrite=True in Python)" in (again.stderr)
    summary = subprocess.run(
        [sys.executable, "-m", "hooktrace", "summary", str(tmp_path / "run")],
        capture_output=True,
        text=True,
    )
    assert "records   0\n" in summary.stdout  # no colon with nothing after it


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_model_called_only_inside_a_compiled_function_is_found_as_it_compiles(
    tmp_path: Path, backend: str
) -> None:
    """A model called only inside a compiled function has no call outside compiled code to
    be found by: the run said "incomplete: 0 steps, 0 records" (with ``eager``), or
    recorded aot_eager's forward graph, which it runs as a module, as the model: a root
    "GraphModule" of 18 evaluation outputs and nothing else. It is found as dynamo
    compiles the function, and recorded as the script run without the compiler records
    it, with its loss module."""
    body = f"""
    @torch.compile(backend={backend!r})
    def loss_of(x, y):
        return criterion(model(x), y)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(2):
        loss_of(*batch(i)).backward()
        opt.step()
        opt.zero_grad()
    """
    script = _script(tmp_path, body)
    compiled = _record("-o", str(tmp_path / "compiled"), str(script))
    assert compiled.returncode == 0, compiled.stderr
    closing = f"hooktrace: complete: 2 steps, 36 records in {tmp_path / 'compiled'}\n"
    assert closing in compiled.stderr, compiled.stderr
    eager = _record(
        "-q", "-o", str(tmp_path / "eager"), str(script),
        env={**os.environ, "TORCHDYNAMO_DISABLE": "1"},
    )  # fmt: skip
    assert eager.returncode == 0, eager.stderr
    result = hooktrace.diff(tmp_path / "eager", tmp_path / "compiled", rtol=1e-4)
    assert result.match and result.records == 36, result
    modules = set(hooktrace.load(tmp_path / "compiled").records["module"])
    assert modules == {"Sequential", "0", "1", "2", "CrossEntropyLoss"}


def test_the_closing_report_says_how_to_record_a_model_it_did_not_find(tmp_path: Path) -> None:
    """An optimizer that steps parameters no module call holds (a model written as bare
    tensors): the run said "incomplete: 0 steps, 0 records" and no more (the reason was in
    summary alone)."""
    body = """
    w = nn.Parameter(torch.randn(4, 2))
    opt = torch.optim.SGD([w], lr=0.1)
    for i in range(2):
        x, y = batch(i)
        nn.functional.cross_entropy(x @ w, y).backward()
        opt.step()
        opt.zero_grad()
    """
    run = tmp_path / "run"
    result = _record("-o", str(run), str(_script(tmp_path, body)))
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"hooktrace: incomplete: 0 steps, 0 records in {run}: an optimizer stepped 2 time(s), "
        "but no recorded model holds its parameters: nothing was recorded (hooktrace record "
        "finds a model at its first call, or as dynamo compiles a function that calls it; "
        "hooktrace.record(model, out) in the script records any other)"
    )


def test_a_step_the_script_ended_in_before_its_backward_is_not_an_evaluation(
    tmp_path: Path,
) -> None:
    """A training forward that raised before its backward was counted as "an evaluation";
    an evaluation after the last step is one still."""
    body = """
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(4):
        x, y = batch(i)
        if i == 3:
            with torch.no_grad():
                model.eval(); model(x); model.train()  # an evaluation, in step 3 too
            out = model(x)
            raise RuntimeError("the loader broke")
        criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    """
    run = tmp_path / "run"
    result = _record("-o", str(run), str(_script(tmp_path, body)))
    assert result.returncode == 1
    records = len(hooktrace.load(run).records)
    assert result.stderr.splitlines()[-2] == (
        f"hooktrace: failed: 3 steps (step 3 ended before its backward), {records} records in {run}"
    )
    found = summary(hooktrace.load(run))
    assert (found.steps, found.evaluation_only, found.ended_in_training) == (3, [], 3)
    evaluated = tmp_path / "evaluated.py"
    ends = body.replace('raise RuntimeError("the loader broke")', "break")  # ends complete
    evaluated.write_text(PRELUDE + textwrap.dedent(ends))
    result = _record("-o", str(tmp_path / "run2"), str(evaluated))
    assert "complete: 3 steps and an evaluation" in result.stderr, result.stderr
    found = summary(hooktrace.load(tmp_path / "run2"))
    assert (found.evaluation_only, found.ended_in_training) == ([3], None)


def test_check_counts_steps_in_words_that_read(tmp_path: Path) -> None:
    """One step is "1 step", and a rank that failed before its first step says so."""
    body = """
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(STEPS):
        x, y = batch(i)
        criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    raise ValueError("boom")
    """
    for steps in (0, 1):
        script = _script(tmp_path, body.replace("STEPS", str(steps)))
        run = tmp_path / f"run{steps}"
        assert _record("-q", "-o", str(run), str(script)).returncode == 1
        checked = subprocess.run(
            [sys.executable, "-m", "hooktrace", "check", str(run)], capture_output=True, text=True
        )
        assert checked.returncode == 1, checked.stderr
        first, lost = checked.stdout.splitlines()[:2]
        readable = "1 step readable" if steps else "0 steps readable"
        assert first == f"{run}: INCOMPLETE (status failed, {readable})"
        when = "after step 0" if steps else "before any step was flushed"
        assert lost.startswith(f"  lost: rank 0 is failed {when}: ValueError: boom")


def test_the_closing_report_says_how_statistics_were_computed(tmp_path: Path) -> None:
    body = """
    wide = nn.Sequential(nn.Linear(4, 1000), nn.ReLU())  # (16, 1000) outputs: the kernel's
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    for i in range(2):
        wide(torch.randn(16, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    """
    result = _record("-o", str(tmp_path / "run"), str(_script(tmp_path, body)))
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[-2].startswith("hooktrace: complete: 2 steps")
    assert lines[-1].startswith("hooktrace: statistics: one-pass (numba ")
    assert lines[-1].endswith(" s to load, once")
    # small tensors only: read in place by the same kernels, loaded at the first one
    small = _record("-o", str(tmp_path / "small"), str(_script(tmp_path, LOOPS["optimizer"][0])))
    assert small.stderr.strip().splitlines()[-1].startswith("hooktrace: statistics: one-pass")


def test_exit_codes_pass_through(tmp_path: Path) -> None:
    result = _record("-q", "-o", str(tmp_path / "a"), str(_script(tmp_path, "sys.exit(3)")))
    assert result.returncode == 3
    assert hooktrace.load(tmp_path / "a").status == "failed"
    result = _record(
        "-q", "-o", str(tmp_path / "b"), str(_script(tmp_path, "sys.exit(0)", "ok.py"))
    )
    assert result.returncode == 0
    assert hooktrace.load(tmp_path / "b").status == "complete"


LONG_LOOP = """
opt = torch.optim.SGD(model.parameters(), lr=0.01)
print("READY", flush=True)
i = 0
while True:
    x, y = batch(i)
    criterion(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    i += 1
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signals_finalize_the_trace_then_end_the_process_as_usual(
    tmp_path: Path, signum: int
) -> None:
    script = _script(tmp_path, LONG_LOOP)
    outcomes = []
    for recorded in (False, True):
        command = [sys.executable, str(script)]
        if recorded:
            command = [
                sys.executable,
                "-m",
                "hooktrace",
                "record",
                "-q",
                "-o",
                str(tmp_path / "run"),
                str(script),
            ]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "READY"
        time.sleep(1.5)  # let a few steps run
        # and, recorded, reach the disk (the first step loads the kernels: on a busy machine
        # that may take longer than the sleep)
        flushed = tmp_path / "run" / "records" / "rank=0"
        deadline = time.monotonic() + 60
        while recorded and not any(flushed.glob("part-*.parquet")) and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signum)
        proc.communicate(timeout=60)
        outcomes.append(proc.returncode)
    assert outcomes[0] == outcomes[1]  # as without hooktrace
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "incomplete"
    assert ("SIGTERM" if signum == signal.SIGTERM else "SIGINT") in trace.manifest["ranks"]["0"][
        "error"
    ]
    assert len(trace.steps) > 0


BLOCKED = """
import datetime
import torch.distributed as dist
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(3):
    x, y = batch(i)
    criterion(model(x), y).backward()
    opt.step()
    opt.zero_grad()
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=300))
print("BLOCKED", flush=True)
store.get("never set")  # waits in C++, as a rendezvous or a collective with a dead peer does
"""


def test_sigterm_inside_a_call_that_does_not_return_still_ends_the_process(
    tmp_path: Path,
) -> None:
    """Unrecorded, SIGTERM ends a process blocked in C++ at once; recorded, the handler that
    finishes the trace waited for the main thread to come back to Python, which it never did:
    torchrun's SIGKILL came 30 s later, and the trace was left unfinished."""
    script = _script(tmp_path, BLOCKED)
    outcomes = []
    for recorded in (False, True):
        command = [sys.executable, str(script)]
        if recorded:
            command = [sys.executable, "-m", "hooktrace", "record", "-q", "-o",
                       str(tmp_path / "run"), str(script)]  # fmt: skip
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "BLOCKED"
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)  # (unfixed: blocked for the store's 300 s)
        outcomes.append(proc.returncode)
    assert outcomes == [-signal.SIGTERM, -signal.SIGTERM]
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "incomplete"
    assert trace.manifest["ranks"]["0"]["error"] == "terminated by SIGTERM"
    assert list(trace.steps["step"]) == [0, 1, 2]


OWN_HANDLER = """
import os, signal, time
def on_term(signum, frame):
    print("got SIGTERM", flush=True)
    time.sleep(2)  # saving a checkpoint: longer than the watch waits for hooktrace's handler
    print("saved", flush=True)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    if i == 2:
        os.kill(os.getpid(), signal.SIGTERM)
    x, y = batch(i)
    criterion(model(x), y).backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_script_that_handles_sigterm_itself_ends_as_its_handler_says(tmp_path: Path) -> None:
    """The watch acted on a SIGTERM the script's own handler was taking care of: it ended the
    process by the signal in the middle of the handler's checkpoint (found by a review)."""
    script = _script(tmp_path, OWN_HANDLER)
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    result = _record("-q", "-o", str(tmp_path / "run"), str(script))
    assert (plain.returncode, plain.stdout) == (0, "got SIGTERM\nsaved\n")
    assert (result.returncode, result.stdout) == (0, "got SIGTERM\nsaved\n"), result.stderr
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "complete" and list(trace.steps["step"]) == [0, 1]


FORKS = """
import multiprocessing, time
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(4):
    if i == 2:  # a worker forked mid-run, and ended as DataLoader ends its workers
        worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,))
        worker.start()
        time.sleep(0.5)
        worker.terminate()
        worker.join()
        print("worker", worker.exitcode, flush=True)
        time.sleep(2)  # longer than the watch waits for the main thread
    x, y = batch(i)
    criterion(model(x), y).backward()
    opt.step()
    opt.zero_grad()
print("done")
"""


def test_a_forked_worker_ended_by_sigterm_leaves_the_recording_alone(tmp_path: Path) -> None:
    """A forked child's SIGTERM must not reach the recording process's own watch."""
    result = _record("-q", "-o", str(tmp_path / "run"), str(_script(tmp_path, FORKS)))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["worker", str(-signal.SIGTERM), "done"]
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "complete" and list(trace.steps["step"]) == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--every", "0"], "--every"),
        (["--steps", "9-2"], "bad step range"),
        (["--modules", "fc", "--modules", "("], "bad module pattern '(': missing )"),  # was
        # named as the pattern the options were joined into, '(?:()'
        (["--bogus"], "no such option: --bogus (hooktrace record --help"),  # was "no such
        # script"
        (["torchrun"], "a launcher runs hooktrace: torchrun --nproc-per-node N -m hooktrace"),
        (["python"], "hooktrace record runs the script itself: hooktrace record [OPTIONS]"),
        (["--compression", "zip"], "--compression"),
        (["--config", "missing.toml"], "cannot read --config"),
        (["--max-tensor-mb", "inf"], "max_tensor_mb must be a finite number"),  # was internal
        (["-o", "a_file/run"], "cannot create"),  # each was two lines: "recording ... into"
        (["-o", "a_trace"], "already holds a trace"),
        (["-o", "."], "holds other files (a_file, a_trace, train.py) and no trace"),  # was
        # written in among the user's files
    ],
)
def test_bad_options_fail_before_the_script_starts(
    tmp_path: Path, args: list[str], message: str
) -> None:
    marker = tmp_path / "started"
    script = _script(tmp_path, f"open({str(marker)!r}, 'w').write('x')")
    (tmp_path / "a_file").write_text("x")
    hooktrace.record(torch.nn.Linear(2, 2), tmp_path / "a_trace").close()
    if "-o" not in args:
        args = [*args, "-o", str(tmp_path / "run")]
    result = _record(*args, str(script), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not marker.exists()


def test_bad_options_fail_before_torch_is_imported(tmp_path: Path) -> None:
    """A mistyped option is answered at once, not after the seconds torch takes to load."""
    script = _script(tmp_path, "")
    done = _exit_and_torch("--steps", "9-2", str(script))
    assert done.stdout.split() == ["2", "False"], done.stderr


def _exit_and_torch(*args: str) -> subprocess.CompletedProcess[str]:
    """``hooktrace record ARGS`` in a fresh interpreter, which prints its exit code and
    whether torch was imported by then."""
    probe = (
        "import sys; from hooktrace.cli import main\n"
        "try:\n"
        f"    main(['record', *{list(args)!r}])\n"
        "except SystemExit as exc:\n"
        "    print(exc.code, 'torch' in sys.modules)\n"
    )
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)


def test_a_flag_or_size_of_the_wrong_kind_in_the_config_fails_before_torch(
    tmp_path: Path,
) -> None:
    """A TOML ``inputs = "no"`` would read as true, and ``max_tensor_mb = -1`` drop every
    full tensor (found in review): refused before the script starts or torch loads."""
    script = _script(tmp_path, "")
    for line, said in [
        ('inputs = "no"', "inputs is True or False (true or false in TOML; got 'no')"),
        ("histograms = 3", "histograms takes record kinds"),  # was an internal error
        ("modules = 5", "modules is a regex or a list of regexes, such as 'blocks\\.0' (got 5)"),
        ("max_tensor_mb = -1", "max_tensor_mb must be a finite number, 0 or more (got -1)"),
    ]:
        config = tmp_path / "hooktrace.toml"
        config.write_text(line + "\n")
        done = _exit_and_torch("--config", str(config), str(script))
        assert done.stdout.split() == ["2", "False"], done.stderr
        assert said in done.stderr


def test_missing_script_and_config_file(tmp_path: Path) -> None:
    result = _record(str(tmp_path / "nope.py"))
    assert result.returncode == 2 and "no such script" in result.stderr
    config = tmp_path / "hooktrace.toml"
    config.write_text('every = 2\nmodules = ["^0$"]\nparams = false\n')
    result = _record(
        "-q",
        "--config",
        str(config),
        "-o",
        str(tmp_path / "run"),
        str(_script(tmp_path, LOOPS["optimizer"][0])),
    )
    assert result.returncode == 0, result.stderr
    trace = hooktrace.load(tmp_path / "run")
    assert list(trace.steps["step"]) == [0, 2]
    assert set(trace.records["module"]) == {"0"}
    config.write_text("evry = 2\n")
    result = _record("--config", str(config), str(_script(tmp_path, "")))
    assert result.returncode == 2 and "unknown key(s) evry" in result.stderr


@pytest.mark.parametrize("example", ["mlp_classifier", "cnn_classifier", "tiny_gpt"])
def test_examples_train_bit_identically_under_hooktrace_record(
    tmp_path: Path, example: str
) -> None:
    script = ROOT / "examples" / f"{example}.py"
    plain = subprocess.run(
        [sys.executable, str(script), "--save-params", str(tmp_path / "plain.pt")],
        capture_output=True,
        text=True,
    )
    assert plain.returncode == 0, plain.stderr
    recorded = _record(
        "-q", "-o", str(tmp_path / "run"), str(script), "--save-params", str(tmp_path / "rec.pt")
    )
    assert recorded.returncode == 0, recorded.stderr
    # the same output (losses printed to 4 digits), but for the path the script saved to
    assert recorded.stdout.replace("rec.pt", "plain.pt") == plain.stdout
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "rec.pt")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    trace = hooktrace.load(tmp_path / "run")
    assert trace.status == "complete" and len(trace.steps) >= 20


def test_a_script_that_needs_torchrun_is_told_how_to_run_under_it(tmp_path: Path) -> None:
    script = _script(
        tmp_path, "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    result = _record("-q", "-o", str(tmp_path / "run"), str(script), env=env)
    assert result.returncode == 1  # the script's own exit, its traceback shown
    assert "ValueError: Error initializing torch.distributed" in result.stderr
    assert result.stderr.splitlines()[-1] == (
        "hooktrace: the script starts torch.distributed from the environment torchrun sets: "
        f"run it as torchrun --nproc-per-node N -m hooktrace record [OPTIONS] {script}"
    )


def test_torchrun_two_ranks_write_one_run(tmp_path: Path) -> None:
    script = tmp_path / "ddp.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch, torch.distributed as dist
            from torch import nn
            from torch.nn.parallel import DistributedDataParallel as DDP
            dist.init_process_group("gloo")
            torch.manual_seed(0)
            model = DDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            g = torch.Generator().manual_seed(dist.get_rank())
            for i in range(3):
                model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            dist.destroy_process_group()
            """
        )
    )
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hooktrace", "record", "--overwrite", "-o", str(run), str(script)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    # each rank counts its own steps (all ranks' rows were counted: "6 steps" for 3)
    finals = sorted(line for line in result.stderr.splitlines() if "records in" in line)
    assert finals == [
        f"hooktrace: rank {r}: complete: 3 steps, 48 records in {run}" for r in (0, 1)
    ]
    trace = hooktrace.load(run)
    found = summary(trace)
    assert (found.steps, found.micro_steps) == (3, 3)  # micro-steps were summed over ranks
    assert trace.manifest["world_size"] == 2 and trace.ranks == [0, 1]
    assert trace.status == "complete"
    records = trace.records
    assert set(records["rank"]) == {0, 1}
    assert {"0", "1", "2", "Sequential"} == set(records["module"])  # no "module." prefix
    # data-parallel ranks hold equal parameters, and see different data
    params = (
        records[records["kind"] == "param"]
        .set_index(["step", "module", "slot", "rank"])["norm"]
        .unstack()
    )
    assert (params[0] == params[1]).all()
    outputs = (
        records[records["kind"] == "output"]
        .set_index(["step", "module", "slot", "rank"])["mean"]
        .unstack()
    )
    assert (outputs[0] != outputs[1]).any()
    # again, without --overwrite: every rank refuses (rank 1 wrote over its earlier parts,
    # then waited for rank 0 until torchrun killed it, and the trace read "incomplete")
    again = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "hooktrace", "record", "-o", str(run), str(script)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert again.returncode != 0
    refused = [line for line in again.stderr.splitlines() if "already holds a trace" in line]
    assert len(refused) == 2, again.stderr[-3000:]
    kept = hooktrace.load(run)
    assert kept.status == "complete" and len(kept.records) == len(records)


def test_a_compiled_model_is_recorded_inside(tmp_path: Path) -> None:
    body = """
    compiled = torch.compile(model, backend="aot_eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = batch(i)
        criterion(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
    torch.save(model.state_dict(), sys.argv[1])
    """
    script = _script(tmp_path, body)
    plain = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "plain.pt")], capture_output=True, text=True
    )
    assert plain.returncode == 0, plain.stderr
    result = _record("-o", str(tmp_path / "run"), str(script), str(tmp_path / "rec.pt"))
    assert result.returncode == 0, result.stderr
    assert "torch.compile" not in result.stderr  # nothing to warn of
    a, b = torch.load(tmp_path / "plain.pt"), torch.load(tmp_path / "rec.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    records = hooktrace.load(tmp_path / "run").records
    assert set(records["module"]) == {"Sequential", "0", "1", "2", "CrossEntropyLoss"}
    for module in ("0", "1", "2"):  # from the statistics compiled into the graph
        kinds = set(records.loc[records["module"] == module, "kind"])
        assert {"output", "grad_output"} <= kinds, module
    params = records[records["kind"].isin(["param", "grad_param"])]
    assert set(zip(params["module"], params["slot"], strict=True)) == {
        ("0", "weight"),
        ("0", "bias"),
        ("2", "weight"),
        ("2", "bias"),
    }
    assert (params["dtype"] == "float32").all() and params["mean"].notna().all()


def test_every_option_has_help_with_an_example() -> None:
    from hooktrace.cli.record import record

    for param in record.params:
        if isinstance(param, click.Option) and param.name not in ("quiet", "strict"):
            assert param.help and "e.g." in param.help, param.name


def test_without_torch_record_says_to_install_it(tmp_path: Path) -> None:
    script = _script(tmp_path, "")
    code = f"import sys; sys.modules['torch'] = None\nfrom hooktrace.cli import main\nmain(['record', {str(script)!r}])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert "needs PyTorch" in result.stderr and "pip install torch" in result.stderr


def test_an_unhashable_optimizer_is_found_and_steps(tmp_path: Path) -> None:
    """``hooktrace record`` keeps the optimizers it sees; one whose class defines ``__eq__``
    without ``__hash__`` (a dataclass's) made the script's own constructor fail (found in
    review)."""
    body = """
    class Compared(torch.optim.SGD):
        def __eq__(self, other):
            return self is other
    opt = Compared(model.parameters(), lr=0.1)
    for i in range(3):
        x, y = batch(i)
        criterion(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    """
    run = tmp_path / "run"
    result = _record("-q", "-o", str(run), str(_script(tmp_path, body)))
    assert result.returncode == 0, result.stderr
    assert list(hooktrace.load(run).steps["step"]) == [0, 1, 2]


def test_a_first_run_says_in_plain_words_what_computes_the_statistics() -> None:
    """On a machine whose numba cache lacks the kernels (a fresh install), the final line
    says what happened and what happens next, not the route's description."""
    from hooktrace.cli.record import _route_said
    from hooktrace.trace.schema import COLD_ROUTE

    said = _route_said(COLD_ROUTE, 0.0)
    assert said.startswith("computed by torch's own operations this time:")
    assert said.endswith("compiles them, once, and the next runs load them")
    assert "numba's cache lacked" not in said
    loaded = _route_said("one-pass (numba 0.68.1, on torch's OpenMP threads)", 0.5)
    assert loaded == "one-pass (numba 0.68.1, on torch's OpenMP threads), 0.50 s to load, once"
