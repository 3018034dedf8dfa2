"""Time and peak memory of ``hooktrace diff`` on two generated traces of 1M records each.

Run B is run A with one module perturbed from the middle step on, so half the records differ.
Each case runs in a fresh subprocess, which reports its own wall time and peak resident set
size (``VmHWM``); "import only" is the floor every case pays (Python, pandas, pyarrow).

    python benchmarks/bench_diff.py                 # 1M records per trace
    python benchmarks/bench_diff.py --rows 200000   # quicker
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

CASES = {
    "import only (the floor)": "import hooktrace.analyze.diff.diff\nresult = ''",
    "hooktrace diff A B (CLI, report)": """
        from click.testing import CliRunner
        from hooktrace.cli import cli
        out = CliRunner().invoke(cli, ["diff", "{a}", "{b}"])
        result = f"exit {{out.exit_code}}: " + out.output.splitlines()[2][:70]
    """,
    "hooktrace diff --format parquet -o": """
        from click.testing import CliRunner
        from hooktrace.cli import cli
        out = CliRunner().invoke(cli, ["diff", "{a}", "{b}", "--format", "parquet", "-o", "{out}"])
        import pyarrow.parquet as pq
        result = f"exit {{out.exit_code}}: {{pq.read_metadata('{out}').num_rows:,}} rows written"
    """,
    "hooktrace.diff(A, B, stop_at_first=True)": """
        import hooktrace
        r = hooktrace.diff("{a}", "{b}", stop_at_first=True)
        result = f"first at step {{r.first.step}}, {{r.first.module}} {{r.first.kind}}"
    """,
    "hooktrace.diff(A, B) (keeps differing rows)": """
        import hooktrace
        r = hooktrace.diff("{a}", "{b}")
        result = f"{{len(r.table):,}} differing rows kept"
    """,
    "for scale: load(A).records + load(B).records": """
        import hooktrace
        a, b = hooktrace.load("{a}").records, hooktrace.load("{b}").records
        result = f"{{len(a) + len(b):,}} rows in memory"
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
    parser.add_argument("--rows", type=int, default=1_000_000, help="records per trace")
    parser.add_argument("--modules", type=int, default=250)
    parser.add_argument("--keep", type=Path, help="write the traces here and keep them")
    args = parser.parse_args(argv)

    steps = max(1, args.rows // rows_per_step(args.modules))
    with tempfile.TemporaryDirectory() as tmp:
        root = args.keep or Path(tmp)
        a, b = root / "a", root / "b"
        perturbed = module_names(args.modules)[args.modules // 2]
        t0 = time.perf_counter()
        made = generate_trace(a, steps=steps, modules=args.modules, seed=0)
        generate_trace(
            b, steps=steps, modules=args.modules, seed=0,
            perturb_from_step=steps // 2, perturb_module=perturbed,
        )  # fmt: skip
        print(
            f"two traces of {made.rows:,} records ({steps} steps x {args.modules} modules; run B "
            f"perturbed at {perturbed} from step {steps // 2}), generated in "
            f"{time.perf_counter() - t0:.1f} s\n"
        )
        print(f"{'case':<46} {'time (s)':>9} {'peak RSS (MB)':>14}  result")
        print("-" * 120)
        for name, body in CASES.items():
            m = measure(body, a=str(a), b=str(b), out=str(root / "diff.parquet"))
            print(f"{name:<46} {m['seconds']:>9.2f} {m['peak_mb']:>14.0f}  {m['result']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
