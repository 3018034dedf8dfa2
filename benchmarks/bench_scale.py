"""The analyzer at scale: every command and the main library calls on run pairs of 1M, 10M and
100M records, side by side with the same questions written by hand in DuckDB over the same
Parquet files, in one run.

Each measurement runs in a child process of its own, which reports its wall time and its peak
resident set size (``VmHWM``): the figures of a case include Python's start and its imports,
as a user's command does. The pairs come from ``scale_pairs.py`` (made once, then cached:
the 100M pair takes some 20 minutes and 9 GB). The first divergence hooktrace names must be
the one the hand-written query finds: the script says AGREE or DISAGREE, and exits 1 on a
disagreement.

    python benchmarks/bench_scale.py --cache /work/scale_cache                 # 1M and 10M
    python benchmarks/bench_scale.py --cache /work/scale_cache --sizes 100M --reps 1

The hand-written queries run with DuckDB's memory limit at 4 GB (``--duckdb-memory``): on a
shared machine its default, 80% of the memory, is not a neighbour's share. hooktrace's own
queries run at its 1 GB default.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent  # measure this checkout's hooktrace, whatever is installed
sys.path.insert(0, str(HERE))

from scale_pairs import SHAPES, Pair, pair  # noqa: E402

MEASURE = """
import json, sys, time
t0 = time.perf_counter()
{body}
seconds = time.perf_counter() - t0
status = open("/proc/self/status").read()  # VmHWM: this process's own peak
peak_mb = int(status.split("VmHWM:")[1].split()[0]) / 1024
print(json.dumps({{"seconds": seconds, "peak_mb": peak_mb, "answer": answer}}))
"""

FIRST_LINE = "next((l for l in out.output.splitlines() if l.startswith('first divergence')), '')"

CLI = """
from click.testing import CliRunner
from hooktrace.cli import cli
out = CliRunner().invoke(cli, {args!r})
if out.exit_code not in (0, 1):
    sys.exit(f"exit {{out.exit_code}}: {{out.output}}")
answer = {pick}
"""


DUCKDB = """
import duckdb
con = duckdb.connect(config={{"memory_limit": "{memory}"}})
con.execute("SET enable_progress_bar = false")
def R(run):
    return f"read_parquet('{{run}}/records/*/*.parquet', hive_partitioning = true)"
{body}
"""

# what "differs" means, written by hand: statistics against the size of the values, as
# docs and diff_compare say (rms for mean, std, min and max; the norm for the norm)
DIFFERS = " OR ".join(
    [
        f"abs(a.{s} - b.{s}) > {{atol}} + {{rtol}} * greatest(a.norm, b.norm) / sqrt(a.numel)"
        for s in ("mean", "std", "min", "max")
    ]
    + ["abs(a.norm - b.norm) > {atol} + {rtol} * greatest(a.norm, b.norm)"]
).format(atol=1e-8, rtol=1e-5)
KEYS = "rank, step, micro_step, phase, module, call, kind, slot"
FIRST = (
    "SELECT a.step, a.module, a.kind, a.slot FROM {a} a JOIN {b} b USING ({keys}) "
    "WHERE ({differs}){where} ORDER BY a.step, a.seq LIMIT 1"
)


def cases(p: Pair) -> list[tuple[str, str, str | None]]:
    """(case, hooktrace body, hand-written DuckDB body or None) for the pair ``p``; each body
    sets ``answer``, and has ``A`` and ``B``, the pair's runs."""
    a, b = str(p.a), str(p.b)
    at, last = p.shape.diverge_at, min(p.shape.diverge_at + 34, p.shape.steps - 1)
    step = p.shape.steps // 2
    found = [
        (
            "summary",
            cli(["summary", a], "out.output.splitlines()[6]"),
            "n = con.execute(f'SELECT kind, phase, count(*) FROM {R(A)} GROUP BY ALL').fetchall()\n"
            "top = con.execute(f'SELECT module, count(*) n FROM {R(A)} GROUP BY module "
            "ORDER BY n DESC LIMIT 10').fetchall()\n"
            "answer = f'{sum(r[2] for r in n):,} records'",
        ),
        ("check", cli(["check", a], "out.output.splitlines()[0]"), None),
        (
            f"diff --steps {at}-{last}",
            cli(["diff", a, b, "--steps", f"{at}-{last}"], FIRST_LINE),
            first_divergence_sql(f" AND a.step BETWEEN {at} AND {last}"),
        ),
        (
            "diff --stop-at-first",
            cli(["diff", a, b, "--stop-at-first"], FIRST_LINE),
            first_divergence_sql(),
        ),
        (
            "diff (full)",
            cli(["diff", a, b], FIRST_LINE),
            first_divergence_sql()
            + "\nmodules = con.execute(f'SELECT a.module, count(*) n, min(a.step) FROM {R(A)} a "
            f"JOIN {{R(B)}} b USING ({KEYS}) WHERE ({DIFFERS}) GROUP BY a.module').fetchall()",
        ),
        (
            "anomalies",
            cli(["anomalies", b], "out.output.splitlines()[0]"),
            'jumps = con.execute(f"""WITH g AS (SELECT module, step, sqrt(sum(norm * norm)) v '
            "FROM {R(B)} WHERE kind = 'grad_param' GROUP BY module, step), "
            "l AS (SELECT module, step, v, lag(v) OVER (PARTITION BY module ORDER BY step) p "
            'FROM g) SELECT module, min(step) FROM l WHERE v > 10 * p GROUP BY module""")'
            ".fetchall()\n"
            "nan = con.execute(f'SELECT step, seq, module FROM {R(B)} WHERE nan_count > 0 "
            "ORDER BY step, seq LIMIT 1').fetchall()\n"
            "answer = f'{len(jumps)} modules with grad-norm jumps'",
        ),
        (
            "anomalies (against its checks by hand)",
            cli(["anomalies", b], "out.output.splitlines()[0]"),
            "found = con.execute(ANOMALY_CHECKS.format(records=R(B))).fetchall()\n"
            "nan = con.execute(f'SELECT step, seq, module FROM {R(B)} WHERE nan_count > 0 "
            "OR inf_count > 0 ORDER BY step, seq LIMIT 1').fetchall()\n"
            "answer = f'{len(found) + len(nan)} findings'",
        ),
        ("dead-relus", cli(["dead-relus", a], "out.output.splitlines()[0]"), None),
        (
            f"replay --step {step}",
            cli(["replay", a, "--step", str(step)], "out.output.splitlines()[0]"),
            None,
        ),
        (
            "load(A).records",
            "import hooktrace\ntry:\n    answer = f'{len(hooktrace.load(A).records):,} rows'\n"
            "except hooktrace.TraceTooLarge:\n    answer = 'TraceTooLarge'",
            None,
        ),
        (
            f"trace.query(steps={at}-{last}, kinds=[grad_param])",
            f"import hooktrace\nrows = hooktrace.load(A).query(steps=({at}, {last}), "
            "kinds=['grad_param'], columns=['step', 'module', 'norm'])\n"
            "answer = f'{len(rows):,} rows'",
            f'rows = con.execute(f"SELECT step, module, norm FROM {{R(A)}} WHERE kind = '
            f"'grad_param' AND step BETWEEN {at} AND {last}\").df()\n"
            "answer = f'{len(rows):,} rows'",
        ),
        (
            "trace.sql(max grad norm per module)",
            'import hooktrace\nrows = hooktrace.load(A).sql("SELECT module, max(norm) AS n '
            "FROM records WHERE kind = 'grad_param' GROUP BY module\")\n"
            "answer = f'{len(rows):,} rows'",
            'rows = con.execute(f"SELECT module, max(norm) AS n FROM {R(A)} WHERE kind = '
            "'grad_param' GROUP BY module\").df()\nanswer = f'{len(rows):,} rows'",
        ),
    ]
    runs = f"A, B = {a!r}, {b!r}\n"
    return [(name, runs + body, None if sql is None else runs + sql) for name, body, sql in found]


def cli(args: list[str], pick: str) -> str:
    return CLI.format(args=args, pick=pick)


def first_divergence_sql(where: str = "") -> str:
    return (
        "row = con.execute(FIRST.format(a=R(A), b=R(B), keys=KEYS, differs=DIFFERS, "
        f"where={where!r})).fetchone()\n"
        "answer = f'first divergence: step {row[0]}, {row[2]} of {row[1]!r} (slot {row[3]})' "
        "if row else 'none'"
    )


def measure(body: str) -> dict[str, Any]:
    code = MEASURE.format(body=body)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=REPO, env=env
    )
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1:] or ["?"]
        return {"seconds": math.nan, "peak_mb": math.nan, "answer": f"FAILED: {why[0]}"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return dict(json.loads(lines[-1]))


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seconds": statistics.median(r["seconds"] for r in runs),
        "peak_mb": statistics.median(r["peak_mb"] for r in runs),
        "answer": runs[-1]["answer"],
    }


def agree(case: str, ours: str, theirs: str) -> str:
    """Whether both name the same first divergence (step, kind, module, slot)."""
    if not case.startswith("diff"):
        return ""
    mine = re.search(r"step (\d+), .*?: (\w+) of '([^']+)' \(slot (\S+?),", ours)
    hand = re.search(r"step (\d+), (\w+) of '([^']+)' \(slot (\S+?)\)", theirs)
    if mine and hand and mine.groups() == hand.groups():
        return "AGREE"
    return "DISAGREE"


def _label(p: Pair) -> str:
    size = f"{p.records / 1e6:g}M"
    return size if p.name == size else f"{size} (diverging at step {p.shape.diverge_at})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache", type=Path,
        default=Path(os.environ.get("HOOKTRACE_SCALE_CACHE", Path.home() / ".cache/hooktrace-scale")),
        help="where the run pairs are made once and kept",
    )  # fmt: skip
    parser.add_argument("--sizes", nargs="+", default=["1M", "10M"], choices=sorted(SHAPES))
    parser.add_argument("--reps", type=int, default=3, help="medians of this many runs")
    parser.add_argument("--cases", help="only cases whose name contains this")
    parser.add_argument("--duckdb-memory", default="4GB")
    args = parser.parse_args(argv)
    args.cache.mkdir(parents=True, exist_ok=True)

    print("| records | case | hooktrace s | peak MB | hand-written DuckDB s | peak MB | "
          "time ratio | first divergence | hooktrace's answer |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    failed = False
    for size in args.sizes:
        p = pair(args.cache, size)
        for name, ours_body, sql_body in cases(p):
            if args.cases and args.cases not in name:
                continue
            ours, theirs = [], []
            for _ in range(args.reps):  # interleaved: the host's slow spells hit both
                ours.append(measure(ours_body))
                if sql_body is not None:
                    sql = DUCKDB.format(memory=args.duckdb_memory, body=sql_body)
                    theirs.append(measure(FIRST_DEFS + sql))
            mine = median_of(ours)
            hand = median_of(theirs) if theirs else None
            verdict = agree(name, mine["answer"], hand["answer"]) if hand else ""
            failed |= verdict == "DISAGREE"
            ratio = f"{mine['seconds'] / hand['seconds']:.2f}" if hand else "-"
            hand_s = f"{hand['seconds']:.2f} | {hand['peak_mb']:,.0f}" if hand else "- | -"
            print(
                f"| {_label(p)} | {name} | {mine['seconds']:.2f} | "
                f"{mine['peak_mb']:,.0f} | {hand_s} | {ratio} | {verdict} | {mine['answer']} |",
                flush=True,
            )
            if verdict == "DISAGREE":
                print(f"  hand-written: {hand['answer'] if hand else ''}", flush=True)
    return 1 if failed else 0


# the checks of `hooktrace anomalies` as one would write them by hand in DuckDB (but for the
# non-finite origins, a query of its own): the gradient norm and the output norm of each
# module per step against the median of the 20 steps before (log10), the spread from their
# quartiles, spikes and explosions past ten times and a hundred times the baseline,
# vanishing and exploding bounds, parameters whose .grad is always None, gradients exactly
# zero. The baseline is the plain rolling median: anomalies' leaves the high steps out.
ANOMALY_CHECKS = """
WITH norms AS (
    SELECT 'grad' AS series, rank, module, step, sqrt(sum(norm * norm)) AS v FROM {records}
    WHERE kind = 'grad_param' AND dtype <> 'None' GROUP BY ALL
    UNION ALL
    SELECT 'output', rank, module, step, sqrt(avg(norm * norm)) FROM {records}
    WHERE kind = 'output' AND phase = 'train' GROUP BY ALL),
logs AS (SELECT *, CASE WHEN v > 0 AND isfinite(v) THEN log10(v) END AS z FROM norms),
judged AS (
    SELECT *, median(z) OVER w AS base,
           (quantile_cont(z, 0.75) OVER w - quantile_cont(z, 0.25) OVER w) / 1.349 AS spread
    FROM logs
    WINDOW w AS (PARTITION BY series, rank, module ORDER BY step
                 ROWS BETWEEN 20 PRECEDING AND 1 PRECEDING)),
series AS (
    SELECT series, rank, module,
           count(*) FILTER (WHERE z - base >= greatest(1, 5 * spread)) AS high,
           count(*) FILTER (WHERE z - base >= greatest(2, 5 * spread)) AS explosive,
           count(*) FILTER (WHERE v > 1e6) AS above,
           count(*) FILTER (WHERE v > 0 AND v < 1e-7) AS vanishing
    FROM judged GROUP BY ALL),
never AS (
    SELECT rank, module FROM {records} WHERE kind = 'grad_param'
    GROUP BY rank, module, slot HAVING bool_and(dtype = 'None')),
zero AS (
    SELECT rank, module, count(DISTINCT step) AS steps FROM {records}
    WHERE kind = 'grad_param' AND dtype <> 'None' AND norm = 0 GROUP BY ALL)
SELECT series, rank, module FROM series WHERE high + above + vanishing > 0
UNION ALL SELECT 'no_gradient', rank, module FROM never
UNION ALL SELECT 'zero_gradient', rank, module FROM zero
"""

FIRST_DEFS = (
    f"FIRST = {FIRST!r}\nKEYS = {KEYS!r}\nDIFFERS = {DIFFERS!r}\n"
    f"ANOMALY_CHECKS = {ANOMALY_CHECKS!r}\n"
)


if __name__ == "__main__":
    sys.exit(main())
