"""The analyzer at scale: load, diff, anomalies and dead-relus on generated 1M- and 4M-record
traces (seconds, peak memory, each in a fresh process), and ``hooktrace --help`` start-up.

    python benchmarks/bench_analyzer.py                  # 1M and 4M records
    python benchmarks/bench_analyzer.py --rows 1000000   # one size
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_diff import measure  # noqa: E402  (the one-case-per-process harness)
from synthetic import generate_trace, module_names, rows_per_step  # noqa: E402

CASES = {
    "import (the floor)": "import hooktrace.analyze.diff.diff, hooktrace.analyze.checks.anomalies\nresult = ''",
    "load(A).records": """
        import hooktrace
        result = f"{{len(hooktrace.load('{a}').records):,}} rows"
    """,
    "diff(A, B)": """
        import hooktrace
        r = hooktrace.diff("{a}", "{b}")
        result = f"first: step {{r.first.step}} {{r.first.module}}"
    """,
    "anomalies(B)": """
        import hooktrace
        r = hooktrace.anomalies("{b}")
        result = f"{{len(r.findings)}} findings"
    """,
    "dead_relus(A)": """
        import hooktrace
        r = hooktrace.dead_relus("{a}")
        result = f"{{int(r.layers['dead'].sum())}} dead units"
    """,
}


def help_startup(repeats: int = 11) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run(
            [sys.executable, "-m", "hooktrace", "--help"], capture_output=True, check=True
        )
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, action="append", help="records per trace (repeatable)")
    parser.add_argument("--modules", type=int, default=250)
    args = parser.parse_args(argv)
    sizes = args.rows or [1_000_000, 4_000_000]

    print(f"hooktrace --help: {help_startup():.3f} s (median of 11 runs, python start-up included)")
    baseline = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    print(f"python -c pass:   {time.perf_counter() - baseline:.3f} s\n")

    for rows in sizes:
        steps = max(1, rows // rows_per_step(args.modules))
        with tempfile.TemporaryDirectory() as tmp:
            a, b = Path(tmp) / "a", Path(tmp) / "b"
            middle = module_names(args.modules)[args.modules // 2]
            made = generate_trace(
                a,
                steps=steps,
                modules=args.modules,
                seed=0,
                dead_units=4,
                dead_from_step=steps // 4,
            )
            generate_trace(
                b, steps=steps, modules=args.modules, seed=0, perturb_from_step=steps // 2,
                perturb_module=middle, nan_from_step=3 * steps // 4, nan_module=middle,
            )  # fmt: skip
            print(f"{made.rows:,} records per trace ({steps} steps x {args.modules} modules)")
            print(f"  {'case':<20} {'time (s)':>9} {'peak RSS (MB)':>14}  result")
            for name, body in CASES.items():
                m = measure(body, a=str(a), b=str(b))
                print(f"  {name:<20} {m['seconds']:>9.2f} {m['peak_mb']:>14.0f}  {m['result']}")
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
