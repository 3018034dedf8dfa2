"""Records per step from the steps table, where the parts' footers agree (trace/counts.py),
and the diff's plan made from them."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from scale_runs import generate_trace

import hooktrace
from hooktrace.analyze.diff import diff as diff_module
from hooktrace.trace.counts import records_per_step


@pytest.fixture
def run(tmp_path: Path) -> Path:
    path = tmp_path / "run"
    for rank in (0, 1):
        generate_trace(path, steps=10, modules=4, rank=rank, world_size=2,
                       writer_options={"max_buffer_bytes": 1})  # fmt: skip
    return path


def _from_records(trace: hooktrace.Trace) -> pd.DataFrame:
    records = trace.query(columns=["rank", "step"], logical=False)
    counted = records.groupby(["rank", "step"]).size().rename("records").reset_index()
    return counted.astype("int64")


def test_the_steps_table_counts_what_the_records_hold(run: Path) -> None:
    trace = hooktrace.load(run)
    counted = records_per_step(trace)
    assert counted is not None
    expected = _from_records(trace)
    pd.testing.assert_frame_equal(
        counted.sort_values(["rank", "step"]).reset_index(drop=True), expected
    )
    # the diff's plan, with the filters it takes from the steps table
    for ranks, steps in ((None, None), ([1], None), (None, "3-5,9"), ([0], "8-")):
        plan = diff_module._step_counts(
            trace, None, None, ranks, diff_module._step_predicate(steps)
        )
        rows = expected if ranks is None else expected[expected["rank"].isin(ranks)]
        per_step = rows.groupby("step")["records"].sum()
        chosen = diff_module._step_predicate(steps)(per_step.index.to_series()).to_numpy()
        pd.testing.assert_series_equal(plan, per_step[chosen], check_names=False)


def test_a_lost_part_is_not_counted_and_a_part_that_disagrees_makes_the_records_say(
    run: Path,
) -> None:
    parts = sorted((run / "records" / "rank=1").glob("part-*.parquet"))
    parts[3].unlink()  # its steps are in no part's span: not counted
    trace = hooktrace.load(run)
    counted = records_per_step(trace)
    assert counted is not None
    pd.testing.assert_frame_equal(
        counted.sort_values(["rank", "step"]).reset_index(drop=True), _from_records(trace)
    )
    table = pq.read_table(parts[5])
    pq.write_table(table.slice(0, table.num_rows // 2), parts[5])  # fewer rows than its steps
    trace = hooktrace.load(run)
    assert records_per_step(trace) is None
    plan = diff_module._step_counts(trace, None, None, None, diff_module._step_predicate(None))
    per_step = _from_records(trace).groupby("step")["records"].sum()
    pd.testing.assert_series_equal(plan, per_step, check_names=False)


def test_an_empty_part_leaves_the_steps_table_to_count(run: Path) -> None:
    # a part without rows has no step statistics: nothing in it to disagree with the steps
    before = records_per_step(hooktrace.load(run))
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[-1]
    empty = pq.read_table(part).slice(0, 0)
    pq.write_table(empty, part.with_name("part-999999.parquet"))
    trace = hooktrace.load(run)
    assert (trace.part_spans()["records"] == 0).sum() == 1
    counted = records_per_step(trace)
    assert counted is not None and before is not None
    pd.testing.assert_frame_equal(counted, before)
