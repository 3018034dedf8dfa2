"""A trace is readable without hooktrace: pandas, pyarrow, DuckDB and h5py, as docs/FORMAT.md says."""

from __future__ import annotations

import json
import re
from pathlib import Path

import duckdb
import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch
from repo import FIXTURES, ROOT, SAMPLES
from torch import nn

import hooktrace
from hooktrace.trace import histograms, schema


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("format") / "run"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, out, full_steps=[1]):
        for _ in range(3):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    return out


def test_pandas_reads_the_partitioned_datasets(run: Path) -> None:
    records = pd.read_parquet(run / "records")
    assert len(records) == len(hooktrace.load(run).records)
    assert set(records["rank"].astype(int)) == {0}
    assert set(records.columns) == {*schema.RECORD_SCHEMA.names, "rank"}
    steps = pd.read_parquet(run / "steps")
    assert sorted(steps["step"]) == [0, 1, 2]
    modules = pd.read_parquet(run / "modules")
    assert set(modules["module"]) == {"Sequential", "0", "1", "2"}


def test_pyarrow_dataset_with_hive_partitioning(run: Path) -> None:
    table = ds.dataset(run / "records", format="parquet", partitioning="hive").to_table(
        filter=ds.field("kind") == "grad_output", columns=["step", "module", "norm", "rank"]
    )
    assert table.num_rows == 3 * 4  # three steps, four modules


def test_duckdb_queries_the_metadata(run: Path) -> None:
    glob = str(run / "records" / "*" / "*.parquet")
    rows = duckdb.sql(
        f"SELECT module, count(*) AS n, max(norm) AS top FROM read_parquet('{glob}', hive_partitioning=1) "
        "WHERE kind = 'output' GROUP BY module ORDER BY module"
    ).fetchall()
    assert [(m, n) for m, n, _ in rows] == [("0", 3), ("1", 3), ("2", 3), ("Sequential", 3)]


def test_statistics_are_written_plain_and_names_as_dictionaries(run: Path) -> None:
    """Statistics rarely repeat: a dictionary page of them is wasted work (crash_safe.py)."""
    part = next((run / "records" / "rank=0").glob("part-*.parquet"))
    group = pq.ParquetFile(part).metadata.row_group(0)
    encodings = {
        group.column(i).path_in_schema: set(group.column(i).encodings)
        for i in range(group.num_columns)
    }
    dictionary = {"PLAIN_DICTIONARY", "RLE_DICTIONARY"}
    for name in ("mean", "std", "min", "max", "norm", "zero_fraction"):
        assert not encodings[name] & dictionary, name
    for name in ("module", "kind", "step", "seq"):
        assert encodings[name] & dictionary, name


def test_h5py_reads_full_tensors_and_activity(run: Path) -> None:
    trace = hooktrace.load(run)
    row = trace.record("0", "output", step=1)
    with h5py.File(run / row["segment"], "r") as f:
        assert f.attrs["format_version"] == schema.FORMAT_VERSION
        data = f[row["tensor_key"]][()]
        assert f[row["tensor_key"]].attrs["dtype"] == "float32"
        counts = f["activity"][row["activity_offset"] : row["activity_offset"] + row["units"]]
    np.testing.assert_array_equal(data, trace.tensor("0", "output", step=1))
    np.testing.assert_array_equal(counts, (data > 0).sum(axis=0))


def test_manifest_and_status_are_plain_json(run: Path) -> None:
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["format"] == "hooktrace" and manifest["format_version"] == schema.FORMAT_VERSION
    assert {
        "hooktrace_version",
        "torch_version",
        "python_version",
        "command",
        "config",
        "start_time",
        "world_size",
    } <= set(manifest)
    status = json.loads((run / "status" / "rank=0.json").read_text())
    assert status["status"] == "complete" and status["end_time"] >= manifest["start_time"]


def test_documented_columns_match_the_schema() -> None:
    text = (ROOT / "docs" / "FORMAT.md").read_text()
    for name in [
        *schema.RECORD_SCHEMA.names,
        *schema.STEP_SCHEMA.names,
        *schema.MODULE_SCHEMA.names,
    ]:
        assert f"| `{name}`" in text or f"`{name}`," in text or f", `{name}`" in text, name
    for kind in schema.KINDS:
        assert f"`{kind}`" in text, kind


def _documented_types(text: str) -> list[dict[str, str]]:
    """Each table of ``text``: its rows' column names (a row may name several) and the first
    words of their type cell (``int32 (partition)`` -> ``int32``)."""
    tables: list[dict[str, str]] = [{}]
    for line in text.splitlines():
        if not line.startswith("|"):
            if tables[-1]:
                tables.append({})
            continue
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) >= 2 and cells[0].startswith("`"):
            for name in re.findall(r"`([^`]+)`", cells[0]):
                tables[-1][name] = re.split(r"[,(]", cells[1])[0].strip()
    return tables


def _type_word(kind: pa.DataType) -> str:
    """An Arrow type as FORMAT.md writes it."""
    if pa.types.is_dictionary(kind):
        return f"dictionary {_type_word(kind.value_type)}"
    if pa.types.is_list(kind):
        return f"list of {_type_word(kind.value_type)}"
    return {"double": "float64", "float": "float32"}.get(str(kind), str(kind))


@pytest.mark.parametrize(
    "table",
    [schema.RECORD_SCHEMA, schema.STEP_SCHEMA, schema.MODULE_SCHEMA, histograms.HISTOGRAM_SCHEMA],
    ids=["records", "steps", "modules", "histograms"],
)
def test_documented_column_types_match_the_schema(table: pa.Schema) -> None:
    """Each column's type in FORMAT.md's table of it (the table naming most of its columns)
    is the type the files hold (found stale in review: dictionary strings said ``string``)."""
    tables = _documented_types((ROOT / "docs" / "FORMAT.md").read_text())
    documented = max(tables, key=lambda found: len(set(found) & set(table.names)))
    wrong = {
        field.name: (documented.get(field.name), _type_word(field.type))
        for field in table
        if documented.get(field.name) != _type_word(field.type)
    }
    assert not wrong, f"FORMAT.md says (documented, written): {wrong}"


FORMAT_1_0 = FIXTURES / "healthy_1_0"
"""sample_traces/healthy as first committed, in format 1.0: no notes, captures or histograms."""


@pytest.mark.parametrize(
    "command",
    [
        "summary {run}",
        "check {run}",
        "diff {run} {run}",
        "anomalies {run}",
        "precision {run}",
        "dead-relus {run}",
        "replay {run} --step 3",
        "replay {run} --nonfinite",
        "plot {run} --what grad-norms --output {out}/grads.png",
        "report {run} --output {out}/report.html",
    ],
)
def test_every_command_reads_a_format_1_0_trace(command: str, tmp_path: Path) -> None:
    """Minor versions only add: a trace written before notes (1.1), captures (1.2) and
    histograms (1.3) is answered as it was, by every command."""
    from click.testing import CliRunner

    from hooktrace.cli import cli

    assert hooktrace.load(FORMAT_1_0).format_version == "1.0"
    args = command.format(run=FORMAT_1_0, out=tmp_path).split()
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("older", [FORMAT_1_0, SAMPLES / "healthy"], ids=["1.0", "1.3"])
def test_a_trace_from_before_shards_reads_them_as_whole_tensors(older: Path) -> None:
    """Parts written before 1.4 have no shard columns: every record reads as a whole
    tensor's, "" in each, through the reader and through SQL."""
    trace = hooktrace.load(older)
    assert trace.format_version < "1.4"
    columns = list(schema.SHARD_COLUMNS)
    records = trace.query(columns=["step", *columns], steps=[0, 1])
    assert len(records) and (records[columns] == "").all().all()
    counted = trace.sql(
        "SELECT count(*) AS n, count(DISTINCT logical_shape || placements) AS kinds FROM records"
    )
    assert counted["n"].iloc[0] == trace.record_count and counted["kinds"].iloc[0] == 1


def test_a_ranks_record_is_its_own_shard_and_a_missing_rank_is_named() -> None:
    """Trace.record (and tensor) of a sharded run answer one rank's shard, which says where it
    lies; a rank the run lacks was said to be a missing module ("modules include: ")."""
    trace = hooktrace.load(SAMPLES / "distributed" / "fsdp2")
    shard = trace.record("fc1", "param", step=0, slot="weight", rank=1)
    assert (shard["logical_shape"], shard["shard_offset"]) == ("32,16", "16,0")
    whole = trace.query(steps=[0], modules=["fc1"], kinds=["param"])
    assert whole.set_index("slot").loc["weight", "shape"] == "32,16"  # the ranks' shards merged
    with pytest.raises(hooktrace.TensorNotRecorded, match=r"no rank 2 \(ranks: 0, 1\)"):
        trace.tensor("fc1", "param", step=0, slot="weight", rank=2)
