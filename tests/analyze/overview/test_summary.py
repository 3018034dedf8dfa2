"""``hooktrace.summary`` counted by DuckDB, checked against pandas over the same records."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from scale_runs import many_parts, with_nulls

import hooktrace
from hooktrace.analyze.overview.summary import summary


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return many_parts(tmp_path_factory.mktemp("summary") / "run")


def _expected(records: object) -> dict[str, object]:
    import pandas as pd

    assert isinstance(records, pd.DataFrame)
    per_module = records["module"].astype(str).value_counts()
    return {
        "records": len(records),
        "kinds": records["kind"].astype(str).value_counts().to_dict(),
        "phases": records["phase"].astype(str).value_counts().to_dict(),
        "full_tensors": int((records["tensor_key"] != "").sum()),
        "per_module": per_module.to_dict(),
        "steps": sorted(records["step"].unique().tolist()),
    }


def test_summary_counts_what_pandas_counts(run: Path) -> None:
    s = summary(run)
    want = _expected(hooktrace.load(run).records)
    assert s.records == want["records"] == 1600
    assert s.kinds == want["kinds"]
    assert s.phases == want["phases"]
    assert s.full_tensors == want["full_tensors"]
    assert s.steps == 40 and (s.first_step, s.last_step) == (0, 39)
    per_module = want["per_module"]
    assert isinstance(per_module, dict)
    assert dict(zip(s.largest["module"], s.largest["records"], strict=True)) == {
        m: per_module[m] for m in s.largest["module"]
    }
    assert s.not_summarised.empty


def test_kinds_of_equal_counts_come_in_the_format_order(run: Path) -> None:
    # each ReLU and Linear has one output and one grad_output a step: a tie
    assert list(summary(run).kinds)[:2] == ["output", "grad_output"]


def test_a_part_damaged_inside_is_left_out_with_a_warning(tmp_path: Path) -> None:
    run = many_parts(tmp_path / "run")
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[3]
    rows = pq.read_metadata(part).num_rows
    chunk = pq.read_metadata(part).row_group(0).column(4)  # module
    assert chunk.path_in_schema == "module"
    data = bytearray(part.read_bytes())
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    for i in range(start + 8, start + chunk.total_compressed_size - 2):
        data[i] ^= 0x5A
    part.write_bytes(bytes(data))
    with pytest.warns(hooktrace.TraceWarning, match="left out records/rank=0/part-000003"):
        s = summary(run)
    assert s.records == 1600 - rows
    # counted by hooktrace's reader, as pandas counts what it could read
    with pytest.warns(hooktrace.TraceWarning):
        want = _expected(hooktrace.load(run).records)
    assert (s.records, s.kinds, s.phases) == (want["records"], want["kinds"], want["phases"])
    per_module = want["per_module"]
    assert isinstance(per_module, dict)
    assert dict(zip(s.largest["module"], s.largest["records"], strict=True)) == {
        m: per_module[m] for m in s.largest["module"]
    }


def test_phases_and_full_tensors_are_counted_as_pandas_counts_them(tmp_path: Path) -> None:
    # train and eval forwards, full tensors every other step: the kind-and-phase grouping
    import torch
    from torch import nn

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, tmp_path / "run", full_every=2):
        for _ in range(4):
            model(torch.randn(5, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(torch.randn(5, 4))
            model.train()
    s = summary(tmp_path / "run")
    want = _expected(hooktrace.load(tmp_path / "run").records)
    assert set(s.phases) == {"train", "eval"} and s.full_tensors > 0
    assert (s.records, s.kinds, s.phases) == (want["records"], want["kinds"], want["phases"])
    assert s.full_tensors == want["full_tensors"]
    assert dict(zip(s.largest["module"], s.largest["records"], strict=True)) == want["per_module"]


def test_records_without_a_module_are_counted_once(tmp_path: Path) -> None:
    # a part rewritten by another tool, with nulls where the schema has none: the grouping
    # by module then has a NULL module, which is not the grouping by kind
    run = many_parts(tmp_path / "run", steps=4)
    with_nulls(sorted((run / "records" / "rank=0").glob("part-*.parquet"))[0], "module", [0, 1])
    s = summary(run)
    assert s.records == hooktrace.load(run).record_count
    assert set(s.kinds) <= {"output", "grad_output", "param", "grad_param"}
    assert sum(s.kinds.values()) == s.records


def _ema_run(out: Path) -> Path:
    """A model trained 3 steps, its EMA copy (no gradients) evaluated after each, and a
    teacher evaluated before: two roots that only ever evaluate."""
    import copy

    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ema = copy.deepcopy(model).requires_grad_(False)
    teacher = nn.Linear(4, 2).eval()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record({"model": model, "ema": ema, "teacher": teacher}, out):
        for _ in range(3):
            x = torch.randn(6, 4)
            with torch.no_grad():
                target = teacher(x)
            (model(x) - target).square().mean().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                ema(x)
    return out


def test_roots_that_only_evaluate_are_named(tmp_path: Path) -> None:
    found = summary(_ema_run(tmp_path / "run"))
    assert found.roots == ["model", "ema", "teacher"]
    assert found.evaluated_roots == ["ema", "teacher"]
    assert "(roots: model, ema, teacher; only evaluated: ema, teacher)" in _cli_summary(
        tmp_path / "run"
    )


def test_no_root_is_said_to_only_evaluate_in_a_run_that_never_trains(tmp_path: Path) -> None:
    import torch

    model = torch.nn.Linear(4, 2)
    with torch.no_grad(), hooktrace.record(model, tmp_path / "run") as rec:
        for _ in range(2):
            model(torch.randn(3, 4))
            rec.step()
    assert summary(tmp_path / "run").evaluated_roots == []


def _cli_summary(run: Path) -> str:
    from click.testing import CliRunner

    from hooktrace.cli import cli

    result = CliRunner().invoke(cli, ["summary", str(run)])
    assert result.exit_code == 0, result.output
    return result.stdout


def test_the_ranks_notes_are_shown_once_with_the_ranks_that_wrote_them(tmp_path: Path) -> None:
    """Each rank's status ``notes``: one said by every rank is shown once, plainly; one said
    by some ranks names them; notes that are not a list of strings are left out, warned."""
    import json
    import shutil

    from repo import SAMPLES

    from hooktrace.cli.summary import render

    run = tmp_path / "run"
    shutil.copytree(SAMPLES / "distributed" / "fsdp2", run)
    for rank, notes in ((0, ["every rank's", "rank 0's own"]), (1, ["every rank's"])):
        status = run / "status" / f"rank={rank}.json"
        status.write_text(json.dumps({**json.loads(status.read_text()), "notes": notes}))
    found = summary(run)
    assert found.notes == {0: ["every rank's", "rank 0's own"], 1: ["every rank's"]}
    assert "not recorded:\n  every rank's\n  rank 0: rank 0's own\n" in render(found)
    status = run / "status" / "rank=1.json"
    status.write_text(json.dumps({**json.loads(status.read_text()), "notes": "not a list"}))
    with pytest.warns(hooktrace.TraceWarning, match="notes is not a list of strings"):
        found = summary(run)
    assert found.notes == {0: ["every rank's", "rank 0's own"]}
    assert "  rank 0: every rank's\n  rank 0: rank 0's own\n" in render(found)
    assert summary(SAMPLES / "distributed" / "fsdp2").notes == {}
