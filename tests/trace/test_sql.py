"""SQL over a trace (``Trace.sql``), the bound on ``Trace.records``, and queries that open
only the parts holding the steps asked for."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from repo import FIXTURES, SAMPLES
from scale_runs import many_parts

import hooktrace
from hooktrace.trace import schema

FORMAT_1_0 = FIXTURES / "healthy_1_0"
"""sample_traces/healthy as it was first committed, in format 1.0: no notes, no histograms."""


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return many_parts(tmp_path_factory.mktemp("sql") / "run")


def test_sql_answers_as_pandas_does(run: Path) -> None:
    trace = hooktrace.load(run)
    got = trace.sql(
        "SELECT module, kind, max(norm) AS norm, count(*) AS n FROM records "
        "GROUP BY module, kind ORDER BY module, kind"
    )
    records = trace.records
    want = (
        records.assign(module=records["module"].astype(str), kind=records["kind"].astype(str))
        .groupby(["module", "kind"])["norm"]
        .agg(["max", "size"])
        .reset_index()
    )
    assert isinstance(got, pd.DataFrame)
    assert list(got["module"]) == list(want["module"])
    assert list(got["kind"]) == list(want["kind"])
    assert got["norm"].tolist() == want["max"].tolist()
    assert got["n"].tolist() == want["size"].tolist()


def test_the_tables_have_every_column_of_the_format_and_the_rank(run: Path) -> None:
    trace = hooktrace.load(run)
    for table, file_schema in (
        ("records", schema.RECORD_SCHEMA),
        ("steps", schema.STEP_SCHEMA),
        ("modules", schema.MODULE_SCHEMA),
    ):
        frame = trace.sql(f"SELECT * FROM {table} LIMIT 1")
        assert list(frame.columns) == ["rank", *file_schema.names], table
        assert frame["rank"].tolist() == [0]
    assert trace.sql("SELECT count(*) AS n FROM steps")["n"].item() == 40
    assert trace.sql("SELECT count(*) AS n FROM records")["n"].item() == len(trace.records)


def test_a_run_of_one_rank_has_its_records_as_written(run: Path) -> None:
    """One rank: ``records`` is ``rank_records`` (no logical columns, nothing pooled)."""
    trace = hooktrace.load(run)
    plain = trace.sql("SELECT * FROM records ORDER BY step, seq")
    pd.testing.assert_frame_equal(plain, trace.sql("SELECT * FROM rank_records ORDER BY step, seq"))
    assert "merged" not in plain.columns


def test_a_format_1_0_trace_reads_its_missing_notes_as_empty() -> None:
    trace = hooktrace.load(FORMAT_1_0)
    assert trace.format_version == "1.0"
    notes = trace.sql("SELECT DISTINCT note FROM records")
    assert notes["note"].tolist() == [""]


def test_sql_parameters_and_errors(run: Path) -> None:
    trace = hooktrace.load(run)
    rows = trace.sql("SELECT step FROM records WHERE step = ? AND kind = ?", [3, "output"])
    assert set(rows["step"]) == {3} and len(rows) == 10
    with pytest.raises(hooktrace.TraceError, match="no_such_column"):
        trace.sql("SELECT no_such_column FROM records")


def test_records_of_a_trace_over_the_bound_says_how_to_read_it(run: Path) -> None:
    trace = hooktrace.load(run, max_records=100)
    assert trace.record_count == 40 * 40
    with pytest.raises(hooktrace.TraceTooLarge) as raised:
        _ = trace.records
    message = str(raised.value)
    assert "1,600 records" in message and "max_records=100" in message
    assert "trace.query(steps=" in message and "trace.sql(" in message
    assert isinstance(raised.value, hooktrace.TraceError)
    # the filtered ways work, and the bound can be lifted
    assert len(trace.query(steps=(0, 1))) == 80
    assert len(hooktrace.load(run, max_records=None).records) == 1600
    assert len(hooktrace.load(run, max_records=1600).records) == 1600


def test_a_step_window_opens_only_the_parts_holding_it(
    run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = hooktrace.load(run)
    assert len(trace._parts[schema.RECORDS_DIR]) >= 8
    opened: list[int] = []
    read = trace._read

    def counting(*args: object, **kwargs: object) -> object:
        parts = kwargs.get("parts")
        opened.append(len(parts) if parts is not None else -1)  # type: ignore[arg-type]
        return read(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(trace, "_read", counting)
    rows = trace.query(steps=(9, 10), columns=["step", "seq"])
    assert sorted(rows["step"].unique()) == [9, 10] and len(rows) == 80
    assert 1 <= opened[-1] <= 2
    assert trace.query(steps=[39], columns=["step"])["step"].unique().tolist() == [39]
    assert opened[-1] == 1
    assert trace.query(steps=[], columns=["step"]).empty
    assert trace.query(steps=(100, 200), columns=["step"]).empty


def test_a_lone_column_name_is_one_column(run: Path) -> None:
    """``columns="mean"`` asks for the mean, not for four columns named by its letters
    (found in review: "unknown record column(s) ['a', 'e', 'm', 'n']")."""
    trace = hooktrace.load(run)
    one = trace.query(steps=[3], columns="mean")  # type: ignore[arg-type]
    assert one.equals(trace.query(steps=[3], columns=["mean"]))
    assert "mean" in one.columns and not one.empty
    with pytest.raises(hooktrace.TraceError, match=r"unknown record column\(s\) \['means'\]"):
        trace.query(columns="means")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("query", "said"),
    [
        ("", "takes a query as a string, not ''"),
        (None, "takes a query as a string, not None"),
        ("-- a comment", "returns no table: ask with a SELECT"),
    ],
)
def test_a_query_that_asks_nothing_is_told_so(run: Path, query: object, said: str) -> None:
    """Found in review: an AttributeError of DuckDB's result, or a TypeError of DuckDB's."""
    with pytest.raises(hooktrace.TraceError, match=re.escape(said)):
        hooktrace.load(run).sql(query)  # type: ignore[arg-type]


@pytest.mark.parametrize("steps", ["0-1", 5, [1, "x"], (0, "x")])
def test_steps_that_name_no_steps_are_told_how_to_name_them(run: Path, steps: object) -> None:
    """Found in review: ``steps="0-1"`` was a ValueError of int()'s."""
    with pytest.raises(hooktrace.TraceError, match=r"such as \[3, 5\], or an inclusive"):
        hooktrace.load(run).query(steps=steps)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("where", "shown"),
    [("step = 3", "step = 3"), ("module = 'fc1' AND kind = 'param'", "module = 'fc1'")],
)
def test_a_filter_over_the_logical_records_reaches_the_parquet_scan(where: str, shown: str) -> None:
    """A question about a few steps or modules of a run of several ranks reads only their row
    groups: the filter goes through the logical view down to every Parquet scan (it stopped
    at the view's grouping, and each such question read and merged the whole trace)."""
    trace = hooktrace.load(SAMPLES / "distributed" / "fsdp2")
    assert len(trace.ranks) == 2
    plan = trace.sql(f"EXPLAIN SELECT * FROM records WHERE {where}")["explain_value"].iloc[0]
    scans = plan.count("READ_PARQUET")
    assert scans >= 1 and plan.count(shown) == scans, plan
