"""Running a command on 2 ranks under torchrun, as users launch distributed training: gloo on
the CPU, one thread a rank (bit-identical runs). Python's fault handler is on: a rank that
dies of a signal prints every thread's stack."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path


def torchrun(
    where: Path, *command: str, env: dict[str, str] | None = None, ranks: int = 2
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node RANKS COMMAND`` in
    ``where`` (``env``: variables set besides); its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         *command],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})},
        timeout=300, cwd=where,
    )  # fmt: skip


TEARDOWN_ABORT = "terminate called without an active exception"
"""What a rank prints when, rarely, torch's C++ ends it with SIGABRT (a thread object destroyed
while it still runs, by the words; gloo's teardown, by where it was seen). Seen three times in
CI runs, each in a plain run that imports no hooktrace (commit ebf0762, and CI on 2026-11-30);
never in 147 plain runs here, 120 of them three side by side."""


def unrecorded(where: Path, *command: str, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """:func:`torchrun` for a script run without hooktrace, the control a recorded run is
    compared with: run once more where a rank died so (:data:`TEARDOWN_ABORT`),
    with a warning that carries its output. A recorded run is never run again: there, such
    a death could be hooktrace's."""
    done = torchrun(where, *command, ranks=ranks)
    if done.returncode != 0 and TEARDOWN_ABORT in done.stderr:
        warnings.warn(
            f"an unrecorded run died of SIGABRT in torch's C++, run again: {done.stderr[-3000:]}",
            stacklevel=2,
        )
        done = torchrun(where, *command, ranks=ranks)
    return done
