"""The run pairs ``bench_scale.py`` measures: made once with ``synthetic.py``, then cached.

A pair is run A and run B of the same seed, B perturbed at one module from a step on, so the
first divergence is known in advance (``Pair.first``). Sizes (records per run):

- ``1M``: 1,000 steps x 250 modules (1,000 records a step), B diverging at step 900;
- ``10M``: 1,000 steps x 2,500 modules (10,000 records a step), B diverging at step 900,
  and ``10M-early``: the same A, B diverging at step 100;
- ``100M``: 10,000 steps x 2,500 modules, B diverging at step 9,000 (about 9 GB on disk for
  the pair; some 20 minutes to make on a 2-core machine).

Each run is written under a temporary name and renamed when whole, so an interrupted making
leaves no half run in the cache. ``python benchmarks/scale_pairs.py CACHE 100M`` makes one.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from synthetic import generate_trace, module_names


@dataclass(frozen=True)
class Shape:
    steps: int
    modules: int
    diverge_at: int

    @property
    def module(self) -> str:
        """The perturbed module: one in the middle of the stack."""
        return module_names(self.modules)[self.modules // 2]


SHAPES = {
    "1M": Shape(steps=1_000, modules=250, diverge_at=900),
    "10M": Shape(steps=1_000, modules=2_500, diverge_at=900),
    "10M-early": Shape(steps=1_000, modules=2_500, diverge_at=100),
    "100M": Shape(steps=10_000, modules=2_500, diverge_at=9_000),
}


@dataclass(frozen=True)
class Pair:
    name: str
    a: Path
    b: Path
    shape: Shape

    @property
    def records(self) -> int:
        from synthetic import rows_per_step

        return self.shape.steps * rows_per_step(self.shape.modules)


def pair(cache: Path, name: str) -> Pair:
    """The pair ``name`` under ``cache``, made first where it is not there yet."""
    shape = SHAPES[name]
    size = name.split("-")[0]
    a = cache / f"{size}-a"  # 10M and 10M-early share run A
    b = cache / f"{name}-b"
    _make(a, shape, perturbed=False)
    _make(b, shape, perturbed=True)
    return Pair(name, a, b, shape)


def _make(path: Path, shape: Shape, *, perturbed: bool) -> None:
    if path.exists():
        return
    tmp = path.with_name(f".{path.name}.making")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    made = generate_trace(
        tmp, steps=shape.steps, modules=shape.modules, seed=0,
        perturb_from_step=shape.diverge_at if perturbed else None,
        perturb_module=shape.module if perturbed else None,
    )  # fmt: skip
    tmp.rename(path)
    print(
        f"made {path} ({made.rows:,} records) in {time.perf_counter() - t0:.0f} s",
        file=sys.stderr,
    )


if __name__ == "__main__":
    cache_dir = Path(sys.argv[1])
    cache_dir.mkdir(parents=True, exist_ok=True)
    for wanted in sys.argv[2:]:
        print(pair(cache_dir, wanted))
