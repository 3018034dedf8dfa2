"""Time and peak memory of ``hooktrace anomalies`` and ``hooktrace dead-relus`` on a generated
trace of 1M records.

The trace (benchmarks/synthetic.py: Linear/ReLU blocks, 1,000 records a step) has planted
faults, so both commands have something to report: the first 24 of 64 units of every ReLU die
at the first third of the steps, and one Linear turns NaN at three fifths. Each case runs in a
fresh subprocess, which reports its own wall time and peak resident set size (``VmHWM``);
"import only" is the floor every case pays (Python, pandas, pyarrow, h5py).

    python benchmarks/bench_findings.py                 # 1M records
    python benchmarks/bench_findings.py --rows 200000   # quicker
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent  # benchmark this checkout's hooktrace, whatever is installed
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))

from synthetic import generate_trace, module_names, rows_per_step  # noqa: E402

MEASURE = """
import json, resource, sys, time
t0 = time.perf_counter()
{body}
seconds = time.perf_counter() - t0
try:  # VmHWM: this process's own peak (ru_maxrss would count the parent's RSS at fork)
    status = open("/proc/self/status").read()
    peak_mb = int(status.split("VmHWM:")[1].split()[0]) / 1024
except (OSError, IndexError):
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
print(json.dumps({{"seconds": seconds, "peak_mb": peak_mb, "result": str(result)}}))
"""

CLI = """
    from click.testing import CliRunner
    from hooktrace.cli import cli
    out = CliRunner().invoke(cli, {args})
    result = f"exit {{out.exit_code}}: " + (out.output.splitlines() or [""])[0][:80]
"""

CASES = {
    "import only (the floor)": "import hooktrace.analyze.checks.anomalies, hooktrace.analyze.checks.dead_units\nresult = ''",
    "hooktrace anomalies RUN": CLI.replace("{args}", '["anomalies", "{run}"]'),
    "hooktrace anomalies RUN --format parquet -o": CLI.replace(
        "{args}", '["anomalies", "{run}", "--format", "parquet", "-o", "{out}"]'
    ),
    "hooktrace.anomalies(RUN, chunk_rows=50_000)": """
        import hooktrace
        r = hooktrace.anomalies("{run}", chunk_rows=50_000)
        result = repr(r)
    """,
    "hooktrace dead-relus RUN": CLI.replace("{args}", '["dead-relus", "{run}"]'),
    "hooktrace dead-relus RUN --units --format csv": """
        from click.testing import CliRunner
        from hooktrace.cli import cli
        out = CliRunner().invoke(cli, ["dead-relus", "{run}", "--units", "--format", "csv"])
        result = f"exit {{out.exit_code}}: {{len(out.output.splitlines()) - 1:,}} dead units listed"
    """,
    "for scale: load(RUN).records": """
        import hooktrace
        records = hooktrace.load("{run}").records
        result = f"{{len(records):,}} rows in memory"
    """,
}


def measure(body: str, **paths: str) -> dict[str, object]:
    code = MEASURE.format(body=textwrap.dedent(body).format(**paths).strip())
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO
    )
    if done.returncode != 0:
        raise SystemExit(f"benchmark case failed:\n{done.stderr}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000, help="records in the trace")
    parser.add_argument("--modules", type=int, default=250)
    parser.add_argument("--keep", type=Path, help="write the trace here and keep it")
    args = parser.parse_args(argv)

    steps = max(1, args.rows // rows_per_step(args.modules))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        run = root / "run"
        nan_module = module_names(args.modules)[(args.modules // 2) & ~1]  # a Linear
        t0 = time.perf_counter()
        made = generate_trace(
            run, steps=steps, modules=args.modules, seed=0,
            dead_units=24, dead_from_step=steps // 3,
            nan_from_step=steps * 3 // 5, nan_module=nan_module,
        )  # fmt: skip
        print(
            f"a trace of {made.rows:,} records ({steps} steps x {args.modules} modules; 24 of 64 "
            f"units of every ReLU dead from step {steps // 3}, {nan_module} NaN from step "
            f"{steps * 3 // 5}), generated in {time.perf_counter() - t0:.1f} s\n"
        )
        print(f"{'case':<46} {'time (s)':>9} {'peak RSS (MB)':>14}  result")
        print("-" * 130)
        for name, body in CASES.items():
            m = measure(body, run=str(run), out=str(root / "findings.parquet"))
            print(f"{name:<46} {m['seconds']:>9.2f} {m['peak_mb']:>14.0f}  {m['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
