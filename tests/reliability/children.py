"""What the processes of the kill group run. Module-level functions, so that a forkserver
(which has imported torch once, before forking each of them) can start them in milliseconds.

Each one creates the file ``ready`` once recording has begun, then trains until a signal ends
it. The writer flushes every 0.1 s instead of every second (its own parameter), so a short run
has many part files and many moments between and during writes.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import resource
import sys
import time
from multiprocessing.context import ForkServerContext
from pathlib import Path

import torch
from torch import nn

import hooktrace
from hooktrace.trace.writer import TraceWriter

FLUSH_SECONDS = 0.1

# an unmodified training script, for `hooktrace record`: argv is STEPS READY_FILE
SCRIPT = """
import sys, time
from pathlib import Path
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
Path(sys.argv[2]).touch()
for i in range(int(sys.argv[1])):
    g = torch.Generator().manual_seed(i)
    model(torch.randn(16, 64, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    time.sleep(0.01)
"""


def forkserver() -> ForkServerContext:
    """The forkserver every group shares, with torch and hooktrace imported once."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(  # no effect once the server runs: one list for all
        [
            "torch",
            "torch._dynamo",  # the first optimizer imports it: 2 s a process otherwise
            "hooktrace.recorder.recording.recorder",
            "hooktrace.recorder.recording.launch",
            "hooktrace.cli.record",
            __name__,
        ]
    )
    return context


def _flush_often() -> None:
    defaults = TraceWriter.__init__.__kwdefaults__
    assert defaults is not None
    defaults["flush_seconds"] = FLUSH_SECONDS


def train(run: str, steps: int, mode: str, ready: str) -> None:
    """``big``: full tensors of the first layer at every step (about 1 MB a step), so that a
    segment takes a while to write; ``small``: statistics, full tensors every 3rd step."""
    _flush_often()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    big = mode == "big"
    width = 512 if big else 32
    model = nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    options: dict[str, object] = (
        {"full_every": 1, "full_modules": "^0$"} if big else {"full_every": 3}
    )
    with hooktrace.record(model, run, **options):
        Path(ready).touch()
        for i in range(steps):
            g = torch.Generator().manual_seed(i)
            x = torch.randn(256 if big else 16, 64, generator=g)
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            time.sleep(0.01)


def record_script(run: str, script: str, steps: int, ready: str) -> None:
    """``hooktrace record -q -o RUN SCRIPT STEPS READY``, through the console script's own
    entry point."""
    _flush_often()
    torch.set_num_threads(1)
    from hooktrace.cli import main

    sys.argv = ["hooktrace", "record", "-q", "-o", run, script, str(steps), ready]
    main(sys.argv[1:])


def _to_file(path: Path) -> None:
    """Send this process's standard error (Python's and C libraries') to ``path``."""
    err = open(path, "w", buffering=1)  # noqa: SIM115 - lives as long as the process
    os.dup2(err.fileno(), 2)
    sys.stderr = err


def disk_train(
    run: str,
    folder: str,
    mode: str,
    *,
    ready: str | None = None,
    file_size_limit: int | None = None,
    own_write: str | None = None,
) -> None:
    """40 seeded steps; statistics until step 10, full tensors (about 300 kB a step) from
    then on, so that a small disk or a file-size limit fails a write mid-run.

    ``mode``: ``plain`` (no hooktrace), ``record``, or ``strict``. Writes the parameters'
    SHA-256 to FOLDER/params.txt, standard error to FOLDER/stderr.txt; touches ``ready`` at
    step 5; writes ``own_write`` after training (the training's own file on the same disk).
    """
    out = Path(folder)
    _to_file(out / "stderr.txt")
    if file_size_limit is not None:  # Python ignores SIGXFSZ: a write past it fails, EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))
    _flush_often()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def steps() -> None:
        for i in range(40):
            g = torch.Generator().manual_seed(i)
            model(torch.randn(64, 64, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            if i == 5 and ready is not None:
                Path(ready).touch()
            time.sleep(0.02)

    if mode == "plain":
        steps()
    else:
        with hooktrace.record(model, run, full_steps="10-", strict=mode == "strict"):
            steps()
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    (out / "params.txt").write_text(digest.hexdigest())
    if own_write is not None:
        Path(own_write).write_text("the training's own checkpoint\n")


if __name__ == "__main__":  # for a process started by setpriv: ARGS are disk_train's, as JSON
    import json

    disk_train(**json.loads(sys.argv[1]))
