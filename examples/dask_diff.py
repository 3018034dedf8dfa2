"""The first divergence of two runs, and where they differ per module, on Dask.

For traces larger than one machine (thousands of ranks, 10^10 records): Dask reads the runs'
Parquet datasets as they lie (hive partitions ``rank=R``), joins the two runs on the record
keys, and compares each partition of the join with hooktrace's own
:func:`hooktrace.analyze.diff.compare.compare`, the one definition of "equal within
tolerance" that ``hooktrace diff`` uses too. Then two reductions: the smallest (step, seq)
of the records that differ, and per module how many differ and from which step.

Install the extra (``pip install 'hooktrace[dask]'``), then, on this machine's cores::

    python examples/dask_diff.py sample_traces/healthy sample_traces/diverged

or on a cluster (the runs on storage every worker reads: a shared file system, S3, GCS)::

    python examples/dask_diff.py s3://bucket/runs/a s3://bucket/runs/b --scheduler tcp://host:8786

Statistics only: full tensors live in HDF5 segments, which hooktrace diff compares where both
runs saved one; a record that differs only in its full tensor is not found here.
docs/SCALING.md says more.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import dask.dataframe as dd
import pandas as pd

from hooktrace.analyze.diff.compare import KEYS, TABLE_DTYPES, VALUES, compare
from hooktrace.analyze.diff.diff import DEFAULT_ATOL, DEFAULT_RTOL

_NAMES = ("phase", "module", "kind", "slot", "dtype", "segment")  # categories in pandas


def records(run: str) -> dd.DataFrame:
    """A run's records: the keys and the values compared, a partition per Parquet part."""
    columns = [*KEYS, *VALUES]  # rank from the hive partition
    frame = dd.read_parquet(f"{run}/records", columns=columns)
    return frame.map_partitions(_plain, meta=_plain(frame._meta))


def _plain(part: pd.DataFrame) -> pd.DataFrame:
    """Names as strings and the rank as an integer: the two runs' categories differ, and a
    join on categories of different sets is a join on their codes."""
    part = part.astype({c: object for c in _NAMES if c in part.columns})
    return part.assign(rank=part["rank"].astype("int64"))


def _compare(merged: pd.DataFrame, rtol: float, atol: float) -> pd.DataFrame:
    merged = merged.assign(
        in_a=(merged["_merge"] != "right_only").to_numpy(),
        in_b=(merged["_merge"] != "left_only").to_numpy(),
    ).drop(columns="_merge")
    return compare(merged, rtol=rtol, atol=atol, tensors=None)


def diff(run_a: str, run_b: str, *, rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> Any:
    """(first divergence as a one-row DataFrame, empty when none; the per-module table)."""
    a, b = records(run_a), records(run_b)
    merged = a.merge(b, on=list(KEYS), how="outer", suffixes=("_a", "_b"), indicator=True)
    meta = pd.DataFrame({c: pd.Series(dtype=t) for c, t in TABLE_DTYPES.items()})
    compared = merged.map_partitions(_compare, rtol, atol, meta=meta)
    differing = compared[compared["status"] != "equal"]
    differing = differing.assign(
        module=differing["module"].astype(str),
        kind=differing["kind"].astype(str),
        slot=differing["slot"].astype(str),
        status=differing["status"].astype(str),
    )
    first = differing.nsmallest(1, ["step", "seq", "rank"])
    modules = differing.groupby("module").agg(
        differing=("step", "count"), first_step=("step", "min"), rel_diff=("rel_diff", "max")
    )
    first, modules = dd.compute(first, modules)
    return first, modules.sort_values(["first_step", "differing"], ascending=[True, False])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_a")
    parser.add_argument("run_b")
    parser.add_argument("--scheduler", help="a Dask scheduler's address; default: this machine")
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    if args.scheduler:
        from dask.distributed import Client

        Client(args.scheduler)
    first, modules = diff(args.run_a, args.run_b)
    if first.empty:
        print(f"MATCH  {args.run_a} vs {args.run_b}")
        return 0
    row = first.iloc[0]
    print(
        f"first divergence: step {row['step']}, {row['kind']} of '{row['module']}' (slot "
        f"{row['slot']}, call {row['call']}, micro-step {row['micro_step']}, {row['phase']}, "
        f"rank {row['rank']}, seq {row['seq']}): {row['status']}"
    )
    print(f"modules that differ ({len(modules)}), earliest first:")
    print(modules.head(args.top).to_string())
    return 1


if __name__ == "__main__":
    sys.exit(main())
