"""anomaly_scan: the records reduced in DuckDB over the records view, and the same reductions
chunk by chunk through hooktrace's reader where DuckDB cannot read a part. Reference norms
come from pandas' own groupby over the records, not from hooktrace."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from repo import SAMPLES
from scale_runs import generate_trace, many_parts, module_names
from torch import nn

import hooktrace
from hooktrace.analyze.checks import anomaly_scan
from hooktrace.analyze.checks.anomaly_scan import Scan


def through_the_reader(monkeypatch: pytest.MonkeyPatch) -> None:
    """DuckDB fails on a part, as it does on one damaged inside."""

    def fails(self: Scan, steps: object, chunk_rows: int) -> None:
        raise duckdb.IOException("a part DuckDB cannot decode")

    monkeypatch.setattr(Scan, "read", fails)


def same(got: hooktrace.analyze.checks.anomalies.Anomalies, expected: object) -> None:
    assert isinstance(expected, hooktrace.analyze.checks.anomalies.Anomalies)
    pd.testing.assert_frame_equal(got.findings, expected.findings)
    assert (got.steps, got.modules, got.notes) == (expected.steps, expected.modules, expected.notes)


@pytest.mark.parametrize("run", ["nan", "exploding", "dead", "underflow"])
@pytest.mark.parametrize(
    "steps", [None, "12-25", [3, 15, 16, 17, 29]], ids=["all", "a range", "a list"]
)
def test_the_reader_path_finds_the_same(
    run: str, steps: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = hooktrace.anomalies(SAMPLES / run, steps=steps)  # type: ignore[arg-type]
    through_the_reader(monkeypatch)
    chunked = hooktrace.anomalies(SAMPLES / run, steps=steps, chunk_rows=300)  # type: ignore[arg-type]
    same(chunked, whole)


@pytest.mark.parametrize("run", ["nan", "exploding", "dead", "underflow", "healthy"])
def test_series_read_sorted_by_duckdb_find_the_same(
    run: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the grid of norms would be too large, DuckDB sorts them instead."""
    grid = hooktrace.anomalies(SAMPLES / run)
    monkeypatch.setattr(anomaly_scan, "DENSE_BYTES", 0)
    same(hooktrace.anomalies(SAMPLES / run), grid)


def test_a_part_duckdb_cannot_decode_is_left_out_and_said(tmp_path: Path) -> None:
    run = many_parts(tmp_path / "run", steps=12, nan_from_step=7, nan_module=module_names(10)[3])
    part = run / "records" / "rank=0" / "part-000003.parquet"
    without = tmp_path / "without"
    shutil.copytree(run, without)
    (without / part.relative_to(run)).unlink()
    expected = hooktrace.anomalies(without)
    # garbage over the pages of the norm column: DuckDB and the reader both fail to decode it
    chunk = (
        pq.ParquetFile(part).metadata.row_group(0).column(pq.read_schema(part).names.index("norm"))
    )
    data = bytearray(part.read_bytes())
    start = chunk.data_page_offset
    data[start + 10 : start + chunk.total_compressed_size - 2] = b"\x55" * (
        chunk.total_compressed_size - 12
    )
    part.write_bytes(bytes(data))
    with pytest.raises(duckdb.Error):
        duckdb.sql(f"SELECT sum(norm) FROM read_parquet('{part}')").fetchall()
    with pytest.warns(hooktrace.TraceWarning, match="left out records/rank=0/part-000003"):
        found = hooktrace.anomalies(run)
    same(found, expected)
    assert found.steps == 11 and set(found.findings["kind"]) == {
        "nonfinite_forward",
        "nonfinite_param",
    }


def test_two_ranks_and_the_steps_with_a_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the steps that hold a NaN are read in full (rank 1's, from step 9); modules are
    numbered as they first show, over both ranks. Checked as logical tensors, the non-finite
    origins are the same: each rank's."""
    run = tmp_path / "run"
    generate_trace(run, steps=14, modules=6, world_size=2)
    generate_trace(
        run, steps=14, modules=6, rank=1, world_size=2, nan_from_step=9,
        nan_module=module_names(6)[2], writer_options={"max_buffer_bytes": 1},
    )  # fmt: skip
    whole = hooktrace.anomalies(run, per_rank=True)
    assert set(whole.findings["rank"]) == {1} and whole.findings["step"].min() >= 9
    assert whole.steps == 14 and whole.modules == 6  # a step of both ranks is one step
    # as logical tensors (the default): the origins are still each rank's own
    logical = hooktrace.anomalies(run)
    assert logical.logical and logical.steps == 14
    same(logical, whole)
    later = hooktrace.anomalies(run, steps="10-13", per_rank=True)
    through_the_reader(monkeypatch)
    same(hooktrace.anomalies(run, chunk_rows=50, per_rank=True), whole)
    same(hooktrace.anomalies(run, steps="10-13", chunk_rows=50, per_rank=True), later)


class Three(nn.Module):
    """A module of three parameters: three grad_param records a step."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.shift, self.tilt = (nn.Parameter(torch.randn(16)) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift - self.tilt * x.mean()


@pytest.mark.parametrize("grid", [True, False], ids=["a grid", "sorted by DuckDB"])
def test_norms_of_more_than_two_records_sum_as_pandas_does(
    tmp_path: Path, grid: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three micro-steps a step (three output records a module) and a module of three
    parameters: the norms are Kahan's sums in seq order, as pandas' groupby makes them, to
    the bit, through either path."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), Three(), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run"):
        for _ in range(5):
            for _ in range(3):
                x = torch.randn(8, 16) * 10.0 ** torch.randint(-3, 4, (1,))
                F.cross_entropy(model(x), torch.randint(0, 4, (8,))).backward()
            opt.step()
            opt.zero_grad()
    if not grid:
        monkeypatch.setattr(anomaly_scan, "DENSE_BYTES", 0)
    trace = hooktrace.load(tmp_path / "run")
    records = trace.records
    keys = ["rank", "module", "step"]
    for series, rows, how in (
        ("grads", (records["kind"] == "grad_param") & (records["dtype"] != "None"), "sum"),
        ("outputs", (records["kind"] == "output") & (records["phase"] == "train"), "mean"),
    ):
        picked = records[rows]
        squares = pd.DataFrame(
            {"rank": picked["rank"].to_numpy(np.int64), "module": picked["module"].astype(str).to_numpy(),
             "step": picked["step"].to_numpy(), "square": picked["norm"].to_numpy(float) ** 2}
        )  # fmt: skip
        grouped = squares.groupby(keys)["square"]
        assert grouped.size().max() == 3
        expected = np.sqrt(grouped.sum() if how == "sum" else grouped.mean())
        for read in (Scan.read, Scan.read_chunks):
            scan = Scan(trace, 0.95)
            try:
                read(scan, None, 40)
                got = pd.concat(list(scan.norms.tables(series, scan.names)))
            finally:
                scan.close()
            got = got.assign(rank=got["rank"].astype(np.int64), module=got["module"].astype(str))
            got = got.set_index(keys)["value"]
            pd.testing.assert_series_equal(
                got.sort_index(), expected.sort_index(), check_names=False, rtol=0, atol=0
            )


def test_squares_summed_into_the_grid_as_one_by_one_whether_close_or_far() -> None:
    rng = np.random.default_rng(3)
    for spread in (50, 10**7):  # places close together (a histogram), far apart (add.at)
        at = rng.integers(0, spread, 3000)
        values = rng.random(3000) * 10.0 ** rng.integers(-20, 20, 3000)
        sums, counts = np.zeros(spread), np.zeros(spread, dtype=np.int32)
        for part in np.array_split(np.arange(3000), 7):  # in batches
            anomaly_scan._add(sums, counts, at[part], values[part])
        expected, seen = np.zeros(spread), np.zeros(spread, dtype=np.int64)
        for place, value in zip(at.tolist(), values.tolist(), strict=True):
            expected[place] += value
            seen[place] += 1
        assert np.array_equal(counts, seen)
        twice = seen <= 2  # where the order cannot matter, to the bit
        assert np.array_equal(sums[twice], expected[twice])
        assert np.allclose(sums, expected, rtol=1e-12, atol=0)


class NaNThenHigh(nn.Module):
    """At step 10 of three micro-steps a step: NaN in the first, 1000 times in the others."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == 31:
            return x * float("nan")
        return x * 1000.0 if self.calls in (32, 33) else x


@pytest.mark.parametrize("grid", [True, False], ids=["a grid", "sorted by DuckDB"])
def test_a_nan_among_more_than_two_records_makes_the_norm_nan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, grid: bool
) -> None:
    """DuckDB folded bool_or(isnan(square)) to false from the Parquet statistics: the norm of
    step 10 came out finite, and two activation spikes that the reader path does not see."""
    if not grid:
        monkeypatch.setattr(anomaly_scan, "DENSE_BYTES", 0)
    model = nn.Sequential(nn.Linear(8, 8), NaNThenHigh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with hooktrace.record(model, tmp_path / "run"):
        for _ in range(20):
            for _ in range(3):
                F.cross_entropy(model(torch.randn(6, 8)), torch.randint(0, 4, (6,))).backward()
            opt.step()
            opt.zero_grad()
    trace = hooktrace.load(tmp_path / "run")
    scan = Scan(trace, 0.95)
    try:
        scan.read(None, 250_000)
        norms = pd.concat(list(scan.norms.tables("outputs", scan.names)))
    finally:
        scan.close()
    at_10 = norms[(norms["step"] == 10) & (norms["module"].astype(str) == "1")]
    assert np.isnan(at_10["value"]).all() and len(at_10) == 1
    view = hooktrace.anomalies(trace)
    through_the_reader(monkeypatch)
    same(hooktrace.anomalies(tmp_path / "run"), view)


class Swapping(nn.Module):
    """Two layers that run in one order on even steps and in the other on odd ones: each
    one's first seq is not the same at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.odd = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second = (self.b, self.a) if self.odd else (self.a, self.b)
        return second(torch.relu(first(x)))


def _swapping(path: Path) -> Path:
    model = Swapping()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with hooktrace.record(model, path):
        for step in range(6):
            model.odd = step % 2 == 1
            model(torch.randn(3, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return path


@pytest.mark.parametrize("path", ["a grid", "sorted by DuckDB", "chunks"])
@pytest.mark.parametrize("trace_of", ["an order that changes", "two ranks"])
def test_the_output_series_carry_each_modules_first_seq_as_pandas_finds_it(
    tmp_path: Path, path: str, trace_of: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if trace_of == "two ranks":
        run = tmp_path / "run"
        for rank in (0, 1):
            generate_trace(run, steps=6, modules=5, rank=rank, world_size=2)
        for part in (run / "records" / "rank=1").glob("part-*.parquet"):  # rank 1's seqs
            table = pq.read_table(part)  # later than rank 0's: a mix-up of ranks shows
            at = table.schema.get_field_index("seq")
            shifted = pa.compute.add(table.column("seq"), 7)
            pq.write_table(table.set_column(at, table.schema.field("seq"), shifted), part)
    else:
        run = _swapping(tmp_path / "run")
    if path == "sorted by DuckDB":
        monkeypatch.setattr(anomaly_scan, "DENSE_BYTES", 0)
    trace = hooktrace.load(run)
    records = trace.records
    outputs = records[(records["kind"] == "output") & (records["phase"] == "train")]
    keys = {"rank": outputs["rank"].astype(np.int64), "module": outputs["module"].astype(str)}
    expected = outputs.assign(**keys).groupby(["rank", "module"])["seq"].min()
    scan = Scan(trace, 0.95)
    try:
        (Scan.read_chunks if path == "chunks" else Scan.read)(scan, None, 40)
        got = pd.concat(list(scan.norms.tables("outputs", scan.names)))
    finally:
        scan.close()
    # the checks take the smallest seq of a module's rows (the chunks give each step's)
    got = got.assign(rank=got["rank"].astype(np.int64), module=got["module"].astype(str))
    first = got.groupby(["rank", "module"])["seq"].min()
    pd.testing.assert_series_equal(
        first.sort_index(), expected.sort_index(), check_names=False, check_dtype=False
    )
    if trace_of == "an order that changes":  # at some step each layer ran second
        steps = outputs[outputs["module"].isin(["a", "b"])].pivot_table(
            index="step", columns="module", values="seq", observed=True
        )
        assert (steps["a"] < steps["b"]).any() and (steps["b"] < steps["a"]).any()


@pytest.mark.parametrize("run", ["nan", "exploding"])
@pytest.mark.parametrize("steps", [None, (12, 25), [3, 15, 16, 17, 29]])
def test_the_steps_read_and_those_with_a_nan_are_those_the_records_hold(
    run: str, steps: object
) -> None:
    """From the steps table and a query the row groups' statistics answer: the (rank, step)
    pairs that grouping every record finds, and which of them hold a NaN or an Inf."""
    trace = hooktrace.load(SAMPLES / run)
    scan = Scan(trace, 0.95)
    scan._con = trace._duckdb()
    where, parameters = anomaly_scan._where(steps)  # type: ignore[arg-type]
    got = scan._recorded(steps, where, parameters)  # type: ignore[arg-type]
    expected = scan._con.execute(
        "SELECT rank, step, bool_or(nan_count > 0 OR inf_count > 0) AS bad FROM records "
        f"WHERE {where} GROUP BY ALL ORDER BY rank, step",
        parameters,
    ).fetchnumpy()
    assert got is not None
    for column in ("rank", "step", "bad"):
        np.testing.assert_array_equal(got[column], expected[column].astype(got[column].dtype))
    if run == "nan" and steps is None:
        assert got["bad"].any() and not got["bad"].all()


def test_without_a_steps_table_the_records_say_which_steps_were_read(tmp_path: Path) -> None:
    whole, run = tmp_path / "whole" / "nan", tmp_path / "without" / "nan"
    shutil.copytree(SAMPLES / "nan", whole)
    shutil.copytree(SAMPLES / "nan", run)
    shutil.rmtree(run / "steps")
    trace = hooktrace.load(run)
    assert trace.steps.empty
    expected = hooktrace.anomalies(whole)
    found = hooktrace.anomalies(trace)
    found.findings["capture"] = found.findings["capture"].str.replace(str(run), str(whole))
    same(found, expected)
