"""Disk trouble during recording: no space left, and an output directory that turns unwritable.

Each case trains the same seeded model (children.disk_train: statistics for 10 steps, then
about 300 kB of full tensors a step) while a write of the trace fails mid-run, four ways:

- a file-size limit (RLIMIT_FSIZE: a write past it fails with EFBIG);
- a 2 MB tmpfs that fills up (ENOSPC), where mounting is permitted;
- the records directory replaced by a file (ENOTDIR; works as root, who ignores permissions);
- every directory of the run made read-only, the process running as root without the
  capabilities that override permissions (``setpriv``), so EACCES is real.

Training must go on with one clear message and end with the same parameters, bit for bit, as
without hooktrace; ``strict=True`` must stop it with a RecordingError instead. The trace must
load, hold every step flushed before the fault, whole, leave no temporary file behind, and
say (status, ``hooktrace check``) that steps were lost.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import hooktrace
from hooktrace.errors import RecordingError

from . import children
from .conftest import Figures
from .helpers import PYTHON, child_env, run_cli

CONTEXT = children.forkserver()
FILE_SIZE_LIMIT = 512 * 1024


def _train(folder: Path, mode: str, **options: object) -> int | None:
    process = CONTEXT.Process(
        target=children.disk_train, args=(str(folder / "run"), str(folder), mode), kwargs=options
    )
    process.start()
    process.join(180)
    return process.exitcode


@pytest.fixture(scope="module")
def plain_params(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' SHA-256 after training without hooktrace."""
    folder = tmp_path_factory.mktemp("plain")
    assert _train(folder, "plain") == 0, (folder / "stderr.txt").read_text()
    return (folder / "params.txt").read_text()


def _hooktrace_messages(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "hooktrace" in line and "Warning" in line]


def _verify(folder: Path, run: Path, plain_params: str, *, strict: bool) -> tuple[list[str], int]:
    """What is wrong after a fault, and how many steps flushed before it are missing."""
    problems = []
    stderr = (folder / "stderr.txt").read_text()
    messages = _hooktrace_messages(stderr)
    if strict:
        if "RecordingError" not in stderr:
            problems.append(f"strict: training was not stopped by a RecordingError:\n{stderr}")
    else:
        if (folder / "params.txt").read_text() != plain_params:
            problems.append("the training's parameters differ from a run without hooktrace")
        if len(messages) != 1:
            problems.append(f"not one clear message but {len(messages)}:\n{stderr}")
        for noise in ("Traceback", "Exception ignored", "Segmentation"):
            if noise in stderr:
                problems.append(f"{noise} on stderr:\n{stderr}")
    trace = hooktrace.load(run)
    counts = trace.records.groupby("step").size()
    steps = sorted(int(s) for s in counts.index)
    lost = len(set(range(len(steps))) - set(steps))  # flushed before the fault: 0, 1, 2, ...
    if lost or not steps:
        problems.append(f"steps before the fault are missing: readable {steps}")
    if counts.nunique() > 1:
        problems.append(f"steps that are not whole: {counts.to_dict()}")
    if trace.skipped:
        problems.append(f"unreadable files: {trace.skipped}")
    leftovers = sorted(str(p.relative_to(run)) for p in run.glob("**/.*.tmp"))
    if leftovers:
        problems.append(f"temporary files left behind: {leftovers}")
    status = trace.manifest["ranks"]["0"]
    if trace.status not in ("incomplete", "failed") or not status.get("steps_lost"):
        problems.append(f"the status does not say steps were lost: {status}")
    check = run_cli(["check", str(run)])
    if check.code != 1 or "could not write" not in check.stdout:
        problems.append(f"check does not say what was lost:\n{check}")
    return problems, lost


def _case(
    figures: Figures, name: str, folder: Path, run: Path, plain_params: str, *, strict: bool
) -> None:
    with figures.case("disk", name) as case:
        problems, case.lost = _verify(folder, run, plain_params, strict=strict)
        assert not problems, "\n".join(problems)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_file_size_limit(
    strict: bool, plain_params: str, tmp_path: Path, figures: Figures
) -> None:
    code = _train(tmp_path, "strict" if strict else "record", file_size_limit=FILE_SIZE_LIMIT)
    assert code == (1 if strict else 0), (tmp_path / "stderr.txt").read_text()
    name = "file-size limit (EFBIG)" + (", --strict" if strict else "")
    _case(figures, name, tmp_path, tmp_path / "run", plain_params, strict=strict)


@contextmanager
def small_filesystem(where: Path, size: str = "2m") -> Iterator[Path]:
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({mounted.stderr.strip()}): not permitted")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.parametrize("strict", [False, True], ids=["default", "strict"])
def test_a_full_disk(strict: bool, plain_params: str, tmp_path: Path, figures: Figures) -> None:
    with small_filesystem(tmp_path / "disk") as disk:
        run, own = disk / "run", disk / "checkpoint.txt"
        process = CONTEXT.Process(
            target=children.disk_train,
            args=(str(run), str(tmp_path), "strict" if strict else "record"),
            kwargs={"own_write": str(own)},
        )
        process.start()
        process.join(180)
        assert process.exitcode == (1 if strict else 0), (tmp_path / "stderr.txt").read_text()
        copy = tmp_path / "run"  # read it off the small disk before unmounting
        shutil.copytree(run, copy)
        if not strict:
            # hooktrace gave back the space of the write that failed: the training's own
            # small file after it still fits
            assert own.read_text().startswith("the training's own"), "no space left for it"
    name = "full disk, 2 MB tmpfs (ENOSPC)" + (", --strict" if strict else "")
    _case(figures, name, tmp_path, copy, plain_params, strict=strict)


def _while_training(
    folder: Path, fault: Callable[[Path], None], command: list[str] | None = None
) -> int | None:
    """Train, apply ``fault`` to the run once a part is written and step 5 is reached."""
    run, ready = folder / "run", folder / "ready"
    options = {"ready": str(ready)}
    if command is None:
        process = CONTEXT.Process(
            target=children.disk_train, args=(str(run), str(folder), "record"), kwargs=options
        )
        process.start()
    else:
        args = json.dumps({"run": str(run), "folder": str(folder), "mode": "record", **options})
        popen = subprocess.Popen([*command, args], env=child_env())
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (
        ready.exists() and list((run / "records" / "rank=0").glob("part-*.parquet"))
    ):
        time.sleep(0.005)
    fault(run)
    if command is None:
        process.join(180)
        return process.exitcode
    return popen.wait(180)


def test_the_records_directory_replaced_by_a_file(
    plain_params: str, tmp_path: Path, figures: Figures
) -> None:
    moved = tmp_path / "moved"

    def fault(run: Path) -> None:
        os.rename(run / "records" / "rank=0", moved)
        (run / "records" / "rank=0").write_text("not a directory\n")

    code = _while_training(tmp_path, fault)
    assert code == 0, (tmp_path / "stderr.txt").read_text()
    rank0 = tmp_path / "run" / "records" / "rank=0"
    rank0.unlink()  # the directory comes back, as a remounted disk would
    os.rename(moved, rank0)
    _case(
        figures,
        "records directory replaced by a file (ENOTDIR)",
        tmp_path,
        tmp_path / "run",
        plain_params,
        strict=False,
    )


def test_a_run_directory_that_turns_read_only(
    plain_params: str, tmp_path: Path, figures: Figures
) -> None:
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv is not installed: cannot run without permission-override capabilities")
    # root ignores file permissions only through these capabilities: without them, read-only
    # directories refuse its writes as they would anyone's
    command = [setpriv, "--bounding-set=-dac_override,-dac_read_search", PYTHON, children.__file__]
    tmp_path.chmod(0o755)
    directories: list[Path] = []

    def fault(run: Path) -> None:
        directories.extend([run, *(p for p in run.rglob("*") if p.is_dir())])
        for directory in directories:
            directory.chmod(0o555)

    try:
        code = _while_training(tmp_path, fault, command)
    finally:
        for directory in directories:
            directory.chmod(0o755)
    assert code == 0, (tmp_path / "stderr.txt").read_text()
    problems, lost = _verify(tmp_path, tmp_path / "run", plain_params, strict=False)
    # its final status could not be written either, so the trace reads as unfinished and check
    # says so (all it can know); a temporary file may stay, as nothing can be deleted from a
    # read-only directory (check reports it). The rest must hold.
    excused = ("the status does not say", "check does not", "temporary files left")
    problems = [p for p in problems if not p.startswith(excused)]
    with figures.case("disk", "run directory turned read-only (EACCES)") as case:
        case.lost = lost
        trace = hooktrace.load(tmp_path / "run")
        assert trace.status == "recording"
        assert run_cli(["check", str(tmp_path / "run")]).code == 1
        assert not problems, "\n".join(problems)


def test_an_unwritable_output_is_refused_before_training(tmp_path: Path, figures: Figures) -> None:
    """No room from the start (the disk already full): one clear error, before training."""
    with small_filesystem(tmp_path / "disk", size="1m") as disk:
        filler = disk / "filler"
        with pytest.raises(OSError), filler.open("wb") as f:
            while True:
                f.write(bytes(1 << 16))
        run = disk / "run"
        with figures.case("disk", "disk already full when recording starts"):
            with pytest.raises(RecordingError, match="cannot write a trace into"):
                hooktrace.record(torch.nn.Linear(2, 2), run)
            script = tmp_path / "train.py"
            script.write_text("print('TRAINING')\n")
            result = subprocess.run(
                [PYTHON, "-m", "hooktrace", "record", "-q", "-o", str(disk / "run2"), str(script)],
                capture_output=True,
                text=True,
                env=child_env(),
            )
            assert result.returncode == 2, result.stderr
            assert "TRAINING" not in result.stdout
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("hooktrace: error:"), result.stderr
            assert "No space left" in lines[0], lines
