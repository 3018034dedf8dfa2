"""Running a command on 2 ranks under torchrun, as users launch distributed training: gloo on
the CPU, one thread a rank (bit-identical runs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun(
    where: Path, *command: str, env: dict[str, str] | None = None, ranks: int = 2
) -> subprocess.CompletedProcess[str]:
    """``python -m torch.distributed.run --standalone --nproc-per-node RANKS COMMAND`` in
    ``where`` (``env``: variables set besides); its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
         *command],
        capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=300, cwd=where,
    )  # fmt: skip
