"""Run the reliability suite (tests/reliability) and rewrite docs/RELIABILITY.md from the
figures its groups report: per group, the cases tried, survived and lost.

    python benchmarks/reliability_report.py             # run the suite, rewrite the document
    python benchmarks/reliability_report.py --from F    # only rewrite it, from a figures file

The suite writes its figures as JSON to the file named by HOOKTRACE_RELIABILITY_REPORT (see
tests/reliability/conftest.py); the document is generated from them, never edited by hand.
A failing test still counts: its case is tried and not survived, and the page says the suite
did not pass.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DOCUMENT = REPO / "docs" / "RELIABILITY.md"

INTRO = """\
# Reliability

People turn hooktrace on when a run is already in trouble: it must survive whatever that run
throws at it, lose nothing it had written, and never mislead. The reliability suite
(`tests/reliability/`, part of the normal test command) throws those things at it on purpose,
with real files, real processes and real training, and counts what happened. This page is
generated from the figures of one run of the suite by `python benchmarks/reliability_report.py`;
do not edit it by hand.

A case *survived* when every check of it held. *Lost* is counted per group, as each table
says. A case that failed (an `xfail` for a known bug included) is tried and not survived.
"""

DETAILS = {
    "kills": """\
Recording processes killed with SIGKILL at 24 moments drawn from a seeded generator (before
the first flush, anywhere in the run, and as soon as a segment of large full tensors is being
written), and ended by SIGTERM and SIGINT, under `hooktrace record` and `hooktrace.record()`.
Where each SIGKILL landed is read from what the process left: a temporary file means it died
during a write. Every trace must load without repair, hold every step flushed before the
signal with as many records as an undisturbed step, and no partial step; SIGTERM and SIGINT
must leave status `incomplete` with the signal named (the step the signal interrupted is kept
with the records taken before it).""",
    "disk": """\
A write fails mid-run: a file-size limit (EFBIG), a 2 MB tmpfs that fills up (ENOSPC), the
records directory replaced by a file (ENOTDIR), every directory made read-only for a process
without permission-override capabilities (EACCES), and a disk already full at the start.
Training must go on with one warning and end with bit-identical parameters (`--strict`: stop
with a RecordingError); the trace must load with every step flushed before the fault, leave no
temporary file (except in a read-only directory, where nothing can be deleted), and say what
was lost.""",
    "bad_traces": """\
Every analyzer command (`hooktrace.cli.COMMANDS` but `record`, so new commands are included)
on 50+ corrupted or wrong inputs (missing, empty, a file, truncated and bit-flipped Parquet
and HDF5, a missing or damaged manifest, a future format version, fields of the wrong type,
two runs of different models, names and paths that are not UTF-8, named pipes, ...), and on
traces damaged by a hypothesis fuzzer (truncate, flip bits, overwrite, zero, append, delete).
Each answer must be a one-line error with exit 2, or a result that is unchanged or says what
it left out; never a traceback, an internal error, a hang or a crash; `check` must never call
a damaged trace whole. Rows are per command.""",
    "awkward": """\
Models and loops that break naive hooks, each trained three times (without hooktrace, under
`hooktrace.record()`, and under the recorder of `hooktrace record`): the final parameters
and buffers must be equal bit for bit, the trace complete and whole, no hook left behind.""",
    "security": """\
Traces carrying pickle payloads (a Parquet field declaring pyarrow's pickle-based extension
type, pandas metadata, opaque or string HDF5 datasets where tensors should be, a `.npy` of
Python objects as a segment) are read with `pickle` made to raise; segments that point outside
the run; module, root and tensor names like `../../etc/x`, `/abs`, with NUL, newlines, 5,000
characters, lone surrogates or HTML, recorded through the API and `hooktrace record`; and
every page of HTML a command writes, checked for those names unescaped.""",
}

LIMITS = """\
## What these figures do not cover

- One rank only: no kill of one rank of a torchrun job, no GPU (none on the test machines).
- Power loss: files are not fsync'd, so a crash of the machine (not of the process) may lose
  flushed steps.
- Parquet pages carry a CRC-32 since 2026-11-21, which the reader verifies: a flipped bit
  in a page that still decompresses and decodes (zstd does not checksum its frames here) is a
  damaged part, not other numbers (a test searches for such a bit and flips it). Before that,
  a flipped bit was caught only when its page no longer decompressed or decoded. The footer
  (schema, row-group statistics) has no checksum: a flip there is caught when it no longer
  parses; one that parses could make a filtered read skip a row group, or (in the
  statistics of `segment` or `tensor_key`, which `diff` takes instead of decoding a column
  of one value) make `diff` compare a row group's full tensors by their statistics. What is answered
  through DuckDB does not verify page checksums: `trace.sql`, `summary`'s counts, the
  reductions of `anomalies` and the plan of `diff` read such a flipped bit as other numbers
  (DuckDB fails only on what it cannot decode, and the analyzer then reads through
  hooktrace's reader, which leaves the part out). `hooktrace check` reads every page
  against its checksum.
- HDF5 segments checksum their metadata, and every full tensor carries a CRC-32 of its bytes
  that the reader and `hooktrace check` verify (fletcher32 per chunk before 2026-11-21);
  segments written before 2026-11-20 carry neither.
- The fuzzer damages one file at a time, 40 examples per run (derandomized): half of them
  Parquet parts, half the other files (two tests, run side by side);
  `HOOKTRACE_FUZZ_EXAMPLES=2000` searches further.
"""


def run_suite(figures: Path, pytest_args: list[str]) -> tuple[int, float]:
    env = dict(os.environ, HOOKTRACE_RELIABILITY_REPORT=str(figures))
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "tests/reliability",
            *pytest_args,
        ],
        cwd=REPO,
        env=env,
    )
    return done.returncode, time.perf_counter() - started


def render(data: dict[str, Any], *, passed: bool | None, seconds: float | None) -> str:
    lines = [INTRO]
    when = time.strftime("%Y-%m-%d")
    machine = f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    run = f"Figures of {when} ({machine}"
    run += f"; the suite took {seconds:.0f} s" if seconds is not None else ""
    run += ")."
    if passed is False:
        run += " **The suite did not pass on this run**: see the cases not survived."
    lines += [run, ""]
    totals = [0, 0, 0]
    for group, content in data.items():
        lines += [f"## {content['title']}", "", DETAILS.get(group, ""), ""]
        lines += ["| case | tried | survived | lost |", "|---|---:|---:|---:|"]
        sums = [0, 0, 0]
        for name, tally in content["cases"].items():
            row = [tally["tried"], tally["survived"], tally["lost"]]
            sums = [a + b for a, b in zip(sums, row, strict=True)]
            lines.append(f"| {_cell(name)} | {row[0]} | {row[1]} | {row[2]} |")
        lines.append(f"| **all** | **{sums[0]}** | **{sums[1]}** | **{sums[2]}** |")
        lines += ["", f"*Lost*: {content['lost_means']}.", ""]
        totals = [a + b for a, b in zip(totals, sums, strict=True)]
    lines += [
        "## All groups",
        "",
        f"{totals[0]} cases tried, {totals[1]} survived, {totals[2]} lost.",
        "",
        LIMITS,
    ]
    return "\n".join(lines)


def merged(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of several processes (pytest-xdist's workers) as one: each case's tallies
    added up, the groups in the page's order."""
    groups: dict[str, Any] = {}
    for report in reports:
        for group, content in report.items():
            into = groups.setdefault(group, {**content, "cases": {}})
            for name, tally in content["cases"].items():
                total = into["cases"].setdefault(name, {"tried": 0, "survived": 0, "lost": 0})
                for key in total:
                    total[key] += tally[key]
    order = list(DETAILS) + [g for g in groups if g not in DETAILS]  # the page's order
    return {group: groups[group] for group in order if group in groups}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="figures JSON to render")
    parser.add_argument("--output", type=Path, default=DOCUMENT, help="the page to write")
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest")
    args = parser.parse_args()
    passed: bool | None = None
    seconds: float | None = None
    if args.source is None:
        with tempfile.TemporaryDirectory() as scratch:
            figures = Path(scratch) / "figures.json"
            code, seconds = run_suite(figures, args.pytest_args)
            passed = code == 0
            reported = sorted(Path(scratch).glob("figures.json*"))  # .gw0, ... under -n
            if not reported:
                print("the suite reported no figures", file=sys.stderr)
                return code or 1
            data = merged([json.loads(path.read_text()) for path in reported])
    else:
        data = json.loads(args.source.read_text())
    args.output.write_text(render(data, passed=passed, seconds=seconds))
    print(f"wrote {args.output}")
    return 0 if passed in (None, True) else 1


if __name__ == "__main__":
    sys.exit(main())
