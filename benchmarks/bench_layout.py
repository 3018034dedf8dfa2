"""The records' Parquet layout, measured: does the writer's (step, seq) order in row groups of
65,536 rows serve the analyzer's reads, or would another layout pay?

Takes a run (for instance one of ``bench_scale.py``'s cached pairs), and rewrites its records
parts in other layouts beside it, everything else shared:

  64k (written)   the writer's layout: each part in (step, seq) order, row groups of 65,536
  16k, 256k, 1M   the same order, smaller or larger row groups
  by module       each part sorted by (module, step, seq), row groups of 65,536: a module's
                  records together, so its statistics prune by module; steps spread

and times, interleaved repetition by repetition (variants in a new order each time), what the
analyzer asks most: one step and a window of 35 (``trace.query(steps=...)``, as ``replay`` and
``diff --steps`` read), one module's history (``trace.query(modules=...)``), and ``summary`` (a
scan of three dictionary columns). It prints the medians, their ratio to the written layout,
and the records' size on disk.

    python benchmarks/bench_layout.py --run /work/scale_cache/10M-a --work /tmp/layouts
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's hooktrace

import hooktrace
from hooktrace.analyze.overview.summary import summary

LAYOUTS: dict[str, tuple[int, bool]] = {  # row group size, sorted by module
    "64k (written)": (1 << 16, False),
    "16k": (1 << 14, False),
    "256k": (1 << 18, False),
    "1M": (1 << 20, False),
    "by module": (1 << 16, True),
}


_ORDER = ("module", "step", "seq")


def rewrite(run: Path, out: Path, row_group_size: int, by_module: bool) -> None:
    """``run`` with its records parts rewritten in a layout; the rest linked."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for entry in run.iterdir():
        if entry.name != "records":
            os.symlink(entry.resolve(), out / entry.name)
    for part in sorted((run / "records").rglob("*.parquet")):
        table = pq.read_table(part)
        if by_module:
            keys = pa.table(  # arrow sorts no dictionary column: by the names themselves
                {n: pc.cast(table[n], pa.string()) if n == "module" else table[n] for n in _ORDER}
            )
            order = pc.sort_indices(keys, sort_keys=[(n, "ascending") for n in _ORDER])
            table = table.take(order)
        target = out / part.relative_to(run)
        target.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(  # as hooktrace/trace/crash_safe.py writes them, but the layout
            table,
            target,
            compression="zstd",
            row_group_size=row_group_size,
            write_page_checksum=True,
            use_dictionary=[f.name for f in table.schema if not pa.types.is_floating(f.type)],
        )


def questions(trace: hooktrace.Trace) -> dict[str, Callable[[], object]]:
    steps = trace.steps["step"]
    middle = int(steps.median())
    module = str(trace.modules["module"].iloc[len(trace.modules) // 2])
    return {
        "1 step": lambda: trace.query(
            steps=(middle, middle), columns=["step", "module", "kind", "norm"]
        ),
        "35 steps": lambda: trace.query(
            steps=(middle, middle + 34), columns=["step", "module", "kind", "norm"]
        ),
        "one module": lambda: trace.query(modules=[module], columns=["step", "kind", "norm"]),
        "summary": lambda: summary(trace),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    paths = {}
    for name, (size, by_module) in LAYOUTS.items():
        paths[name] = args.work / name.split()[0].replace("(", "")
        start = time.perf_counter()
        rewrite(args.run, paths[name], size, by_module)
        print(f"rewrote {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr)
    traces = {name: hooktrace.load(path) for name, path in paths.items()}
    asked = {name: questions(trace) for name, trace in traces.items()}
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.reps):
        order = list(LAYOUTS)
        random.shuffle(order)
        for name in order:
            for question, ask in asked[name].items():
                start = time.perf_counter()
                ask()
                times.setdefault((name, question), []).append(time.perf_counter() - start)
    written = "64k (written)"
    parts = sorted((paths[written] / "records").rglob("*.parquet"))
    print(f"{args.run}: {sum(pq.ParquetFile(p).metadata.num_rows for p in parts):,} records")
    print(f"  {'layout':<15}" + "".join(f" {q + ' s (ratio)':>17}" for q in asked[written]))
    base = {q: statistics.median(times[(written, q)]) for q in asked[written]}
    for name in LAYOUTS:
        cells = []
        for question in asked[name]:
            median = statistics.median(times[(name, question)])
            cells.append(f"{median:.3f} ({median / base[question]:.2f})")
        size = sum(p.stat().st_size for p in (paths[name] / "records").rglob("*.parquet"))
        print(f"  {name:<15}" + "".join(f" {c:>17}" for c in cells) + f"  {size / 1e6:,.0f} MB")


if __name__ == "__main__":
    main()
