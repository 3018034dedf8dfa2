"""Write the distributed sample traces, sample_traces/distributed/: examples/distributed.py
recorded in three layouts of the same training.

- ``one``: in one process, the whole batch;
- ``fsdp2``: under FSDP2 on 2 ranks (torchrun, gloo), each rank half the batch;
- ``ddp``: under DDP on 2 ranks, where rank 1 nudges its replica of ``fc2.bias`` at step 3
  (``--desync-at 3``): a replica that came apart.

    python sample_traces/make_distributed.py               # rewrite them
    python sample_traces/make_distributed.py --out DIR     # write them elsewhere

Seeded, one thread a rank: making them again writes the same numbers (only the times and
versions in manifest.json and status/ change). ``--stats FILE`` keeps the one process's own
statistics of the model's output per step (what the tests check the records against).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EXAMPLE = Path("examples") / "distributed.py"  # from ROOT: the manifests name it so

LAYOUTS = {"one": ["one"], "fsdp2": ["fsdp2"], "ddp": ["ddp", "--desync-at", "3"]}
"""Each sample's arguments to the example; all but ``one`` on 2 ranks."""


def record(out: Path, name: str, args: list[str], ranks: int = 2) -> None:
    """``hooktrace record`` of the example with ``args`` into ``out/name`` (under torchrun
    on ``ranks`` ranks, unless the layout is ``one``)."""
    launch = [sys.executable]
    if args[0] != "one":
        launch += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    where = out / name
    where = where.relative_to(ROOT) if where.is_relative_to(ROOT) else where
    command = [*launch, "-m", "hooktrace", "record", "-q", "--overwrite", "-o", str(where)]
    done = subprocess.run(
        [*command, str(EXAMPLE), *args], capture_output=True, text=True, cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600,
    )  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"recording {name} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE / "distributed")
    parser.add_argument("--stats", type=Path, help="the one process's statistics, as JSON")
    options = parser.parse_args()
    options.out = options.out.resolve()
    options.stats = options.stats and options.stats.resolve()
    options.out.mkdir(parents=True, exist_ok=True)
    for name, args in LAYOUTS.items():
        stats = ["--stats", str(options.stats)] if name == "one" and options.stats else []
        record(options.out, name, [*args, *stats])
        print(f"wrote {options.out / name}")


if __name__ == "__main__":
    main()
