"""The logical view at scale: ``hooktrace summary``, ``diff`` and ``anomalies`` of a synthetic
run of 8 ranks (10^7 records by default), as logical tensors (the default for a run of
several ranks) and per rank (``--per-rank``), side by side: wall time and the process's peak
memory. Then ``trace.sql`` over ``records`` (the logical records) and over ``rank_records``
(each rank's): a question about one module, and one about every record.

Two runs are written once by benchmarks/synthetic.py, every rank through the real trace
writer (run B with its statistics scaled from a module at step ``steps // 2``, so that diff
has a divergence to find); each command runs in a process of its own, ``--reps`` times,
alternating the two views, and the medians are printed.

Run: python benchmarks/bench_logical.py [--records 10000000] [--ranks 8] [--reps 3]
                                        [--keep DIR]   (reuse the runs written there)
                                        [--only NAME]  (one case: summary, diff, sql, ...)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import generate_trace, module_names, rows_per_step

MODULES = 250
_CHILD = """
import resource, sys, time
from hooktrace.cli import cli
started = time.perf_counter()
try:
    cli.main(sys.argv[1:], standalone_mode=False)
except SystemExit:
    pass
took = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"MEASURED {took} {peak}", file=sys.stderr)
"""
_SQL_CHILD = """
import resource, sys, time
import hooktrace
trace = hooktrace.load(sys.argv[1])
started = time.perf_counter()
trace.sql(sys.argv[2])
took = time.perf_counter() - started
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"MEASURED {took} {peak}", file=sys.stderr)
"""
_ONE_MODULE = (
    "SELECT step, norm FROM {table} WHERE module = 'blocks.0.fc' AND kind = 'grad_param' "
    "ORDER BY step"
)
_EVERY_RECORD = "SELECT module, kind, max(norm) AS norm FROM {table} GROUP BY ALL"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=10_000_000)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--keep", type=Path, help="write the runs here (and reuse them)")
    parser.add_argument("--only", help="the cases whose name starts with this")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        where = args.keep or Path(scratch)
        a, b = write_runs(where, args.records, args.ranks)
        cases = {
            "summary": ["summary", str(b)],
            "diff": ["diff", str(a), str(b), "--stop-at-first"],
            "diff, whole": ["diff", str(a), str(b), "--format", "csv", "-o", str(where / "d.csv")],
            "anomalies": ["anomalies", str(b)],
            "sql, a module": [_ONE_MODULE],
            "sql, every": [_EVERY_RECORD],
        }
        print(f"{args.records:,} records over {args.ranks} ranks, {args.reps} repetitions:")
        print(f"  {'command':<14}{'view':<10}{'seconds':>9}{'peak MB':>10}")
        for name, command in cases.items():
            if args.only and not name.startswith(args.only):
                continue
            for view, extra in (("logical", []), ("per rank", ["--per-rank"])):
                if name == "summary" and extra:
                    continue  # summary counts both in one pass
                if name.startswith("sql"):  # records, or rank_records
                    table = "rank_records" if extra else "records"
                    query = command[0].format(table=table)
                    runs = [run([str(b), query], _SQL_CHILD) for _ in range(args.reps)]
                else:
                    runs = [run([*command, *extra]) for _ in range(args.reps)]
                seconds = statistics.median(r[0] for r in runs)
                peak = statistics.median(r[1] for r in runs) / 1024
                print(f"  {name:<14}{view:<10}{seconds:>9.2f}{peak:>10.0f}")
    return 0


def write_runs(where: Path, records: int, ranks: int) -> tuple[Path, Path]:
    """Runs A and B of ``records`` records over ``ranks`` ranks (B perturbed from the middle
    step), unless ``where`` holds them already."""
    steps = max(1, records // (ranks * rows_per_step(MODULES)))
    middle = module_names(MODULES)[MODULES // 2]
    made = []
    for name, perturb in (("a", None), ("b", steps // 2)):
        path = where / f"logical-{name}-{records}-{ranks}"
        made.append(path)
        if (path / "manifest.json").exists():
            continue
        started = time.perf_counter()
        for rank in range(ranks):
            generate_trace(
                path, steps=steps, modules=MODULES, rank=rank, world_size=ranks,
                perturb_from_step=perturb, perturb_module=middle if perturb else None,
            )  # fmt: skip
        print(f"wrote {path} in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    return made[0], made[1]


def run(command: list[str], child: str = _CHILD) -> tuple[float, int]:
    """Seconds and peak resident kB of ``hooktrace COMMAND`` (or of another ``child``
    script given ``command``) in a process of its own."""
    done = subprocess.run(
        [sys.executable, "-c", child, *command], capture_output=True, text=True, check=False
    )
    line = [x for x in done.stderr.splitlines() if x.startswith("MEASURED ")]
    if not line:
        raise RuntimeError(f"hooktrace {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    _, took, peak = line[-1].split()
    return float(took), int(peak)


if __name__ == "__main__":
    sys.exit(main())
