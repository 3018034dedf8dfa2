"""``hooktrace diff`` across layouts: examples/distributed.py, the same model and global batch
trained in one process, under FSDP2, DDP and tensor parallelism on 2 ranks, and under FSDP2
and tensor parallelism on a 2x2 mesh (4 ranks; gloo, torchrun), compared as logical tensors
with no option. The ground truth is the one process's own statistics of the model's output
and its gradient, computed by the script in torch, and the one-process recording. The
first three are made as sample_traces/make_distributed.py makes the committed samples, and
hold their numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from click.testing import CliRunner
from torchrun import torchrun

import hooktrace
from hooktrace.cli import cli

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = ROOT / "sample_traces" / "distributed"
_STATS = ["mean", "std", "min", "max", "norm"]
_PER_STEP = 16  # 4 parameters, their gradients, 4 outputs (fc1, act, fc2, MLP), their gradients


_OUTPUTS_TOO = ["-m", "hooktrace", "record", "-q", "--histograms", "param,grad_param,output"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """``one``, ``fsdp2`` and ``ddp`` (rank 1's replica of fc2.bias nudged at step 3), as the
    samples are made; ``tp`` and ``fsdp_tp``, and ``one_outputs`` (one process again), with
    histograms of the outputs too. With the one process's truth, step by step."""
    where = tmp_path_factory.mktemp("layouts")
    made = subprocess.run(
        [sys.executable, str(ROOT / "sample_traces" / "make_distributed.py"), "--out",
         str(where), "--stats", str(where / "truth.json")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-3000:]
    example = str(ROOT / "examples" / "distributed.py")
    for layout, ranks in (("tp", 2), ("fsdp_tp", 4)):
        done = torchrun(where, *_OUTPUTS_TOO, "-o", layout, example, layout, ranks=ranks)
        assert done.returncode == 0, done.stderr[-3000:]
    one = [sys.executable, *_OUTPUTS_TOO, "-o", str(where / "one_outputs"), example, "one"]
    done = subprocess.run(one, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return where, json.loads((where / "truth.json").read_text())


def test_one_process_and_fsdp2_match_as_logical_tensors(runs: tuple[Path, list]) -> None:
    where, _ = runs
    result = hooktrace.diff(where / "one", where / "fsdp2")
    assert result.match and result.first is None, result
    # every record of the one process paired with a logical one: 4 parameters, their
    # gradients, 4 outputs (three layers and the root) and their gradients, 4 steps
    assert result.records == len(hooktrace.load(where / "one").records) == 6 * _PER_STEP
    assert not result.structure.differs
    assert "compared logical tensors (run A one rank and run B 2 ranks)" in result.notes[0]


def test_ddp_matches_until_the_step_a_change_was_planted(runs: tuple[Path, list]) -> None:
    where, _ = runs
    before = hooktrace.diff(where / "one", where / "ddp", steps="0-2")
    assert before.match and before.records == 3 * _PER_STEP
    result = hooktrace.diff(where / "one", where / "ddp")
    assert not result.match and result.first is not None
    # rank 1's own fc2.bias: its half of the batch comes out of fc2 otherwise
    assert (result.first.step, result.first.module, result.first.kind) == (3, "fc2", "output")


@pytest.mark.parametrize(
    ("layout", "ranks", "dp"), [("fsdp2", 2, 2), ("ddp", 2, 2), ("tp", 2, 1), ("fsdp_tp", 4, 2)]
)
def test_the_logical_view_holds_the_one_processs_own_numbers(
    runs: tuple[Path, list], layout: str, ranks: int, dp: int
) -> None:
    """The model's output and its gradient, pooled over the data-parallel ranks' halves of
    the batch (the gradient divided by 2) and counted once over tensor-parallel peers,
    against torch's statistics of the whole batch's in the one process."""
    where, truth = runs
    logical = hooktrace.load(where / layout).query(
        modules=["MLP"], kinds=["output", "grad_output"], steps=(0, 2), logical=True
    )
    assert len(logical) == 3 * 2
    merged = "batch" if dp > 1 else "replicas"
    for row in logical.itertuples():
        how = (row.shape, row.numel, row.ranks, row.dp, row.merged)
        assert how == ("8,5", 40, ranks, dp, merged)
        got = [getattr(row, name) for name in _STATS]
        assert got == pytest.approx(truth[row.step][row.kind], rel=1e-5, abs=1e-9), row


def test_parameters_count_once_whether_sharded_or_replicated(runs: tuple[Path, list]) -> None:
    where, _ = runs
    one = hooktrace.load(where / "one").query(kinds=["param", "grad_param"])
    for layout, merged in (("fsdp2", "shards"), ("ddp", "replicas")):
        trace = hooktrace.load(where / layout)
        logical = trace.query(kinds=["param", "grad_param"], logical=True)
        assert len(logical) == len(one) and set(logical["merged"]) == {merged}
        assert (logical["shape"].to_numpy() == one["shape"].to_numpy()).all()
        assert (logical["logical_shape"] == "").all() and (logical["ranks"] == 2).all()
        # the SQL view says the same
        viewed = trace.sql(
            "SELECT count(*) AS n, count(DISTINCT merged) AS how FROM logical_records "
            "WHERE kind IN ('param', 'grad_param')"
        )
        assert viewed.iloc[0].tolist() == [len(one), 1]


def test_per_rank_compares_rank_with_rank(runs: tuple[Path, list]) -> None:
    where, _ = runs
    result = hooktrace.diff(where / "one", where / "fsdp2", per_rank=True)
    assert not result.match
    assert result.structure.records_only_b == 6 * _PER_STEP  # rank 1: none in one process
    assert not any("logical" in note for note in result.notes)


def test_the_cli_compares_layouts_with_no_option(runs: tuple[Path, list]) -> None:
    where, _ = runs
    runner = CliRunner()
    done = runner.invoke(cli, ["diff", str(where / "one"), str(where / "fsdp2")])
    assert done.exit_code == 0, done.output
    assert done.output.startswith("MATCH") and "compared logical tensors" in done.output
    apart = runner.invoke(cli, ["diff", str(where / "one"), str(where / "fsdp2"), "--per-rank"])
    assert apart.exit_code == 1, apart.output


def test_a_sharded_model_is_named_as_in_one_process(runs: tuple[Path, list]) -> None:
    """fully_shard swaps the root's class for FSDPMLP: the root is still MLP."""
    where, _ = runs
    modules = hooktrace.load(where / "fsdp2").modules
    root = modules[modules["depth"] == 0].iloc[0]
    assert (root["module"], root["type"]) == ("MLP", "__main__.MLP")


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_tensor_parallel_runs_match_one_process(runs: tuple[Path, list], layout: str) -> None:
    """Colwise and rowwise layers on 2 ranks, alone and under FSDP2 on a 2x2 mesh: every
    logical tensor matches; the rowwise layer's output, a partial sum on each rank until
    its reduction, is set aside with a note."""
    where, _ = runs
    result = hooktrace.diff(where / "one", where / layout)
    assert result.match and not result.structure.differs, result
    assert result.records == 6 * (_PER_STEP - 1)  # all but the rowwise layer's output
    assert "partial sums" in result.notes[1]


def test_what_tensor_parallelism_hands_between_its_layers(runs: tuple[Path, list]) -> None:
    where, _ = runs
    trace = hooktrace.load(where / "tp")
    step = trace.query(steps=[0], kinds=["output"], logical=False)
    placed = step.groupby("module", observed=True)["placements"].agg(set)
    assert placed["fc1"] == {"S(1)"}  # ColwiseParallel's output, a DTensor at the boundary
    assert placed["fc2"] == {"P(sum)"}  # RowwiseParallel's, before its reduction
    assert placed["act"] == {""}  # the ReLU between them gets the local shard, a plain tensor
    # the model's output is the reduction's pending result: summarised once it is done
    # (it was skipped, "tensor subclass AsyncCollectiveTensor")
    root = step[step["module"] == "MLP"]
    assert (root["note"] == "").all() and root["mean"].notna().all()
    logical = trace.query(steps=[0], modules=["act"], logical=True)
    one = hooktrace.load(where / "one").query(steps=[0], modules=["act"])
    assert (logical["merged"] == "local shards").all()
    assert (logical["shape"] == "8,16+8,16").all()  # where each shard lies is not recorded
    assert logical["norm"].to_numpy() == pytest.approx(one["norm"].to_numpy(), rel=1e-6)


def test_each_rank_says_where_it_sits_among_the_data_parallel_ranks(
    runs: tuple[Path, list],
) -> None:
    where, _ = runs
    expected = {
        "one": None,
        "ddp": {0: 0, 1: 1},
        "fsdp2": {0: 0, 1: 1},
        "tp": {0: 0, 1: 0},
        "fsdp_tp": {0: 0, 1: 0, 2: 1, 3: 1},
    }
    assert {name: hooktrace.load(where / name).layout for name in expected} == expected


@pytest.mark.parametrize("name", ["one", "fsdp2", "ddp"])
def test_the_committed_samples_are_made_again(runs: tuple[Path, list], name: str) -> None:
    """sample_traces/make_distributed.py writes the committed records again (within float32
    rounding, so that a CPU with other vector kernels passes too)."""
    where, _ = runs
    keys = ["rank", "step", "seq", "module", "kind", "slot", "shape", "placements", "shard_offset"]
    committed = hooktrace.load(SAMPLES / name).records
    again = hooktrace.load(where / name).records
    pd.testing.assert_frame_equal(
        committed[keys].astype(str), again[keys].astype(str), check_categorical=False
    )
    expected = committed[_STATS].to_numpy(dtype=float)
    scale = np.abs(expected).max(axis=1)[:, None]
    difference = np.abs(again[_STATS].to_numpy(dtype=float) - expected)
    assert (difference <= 1e-5 * scale + 1e-7).all(), (
        f"run sample_traces/make_distributed.py and commit the traces ({name})"
    )


@pytest.mark.parametrize("layout", ["fsdp2", "ddp", "tp", "fsdp_tp"])
def test_the_sql_view_and_the_query_agree(runs: tuple[Path, list], layout: str) -> None:
    """``records`` (DuckDB's logical records, a run of several ranks) and ``query()``
    (numpy's): one answer; ``rank_records`` holds each rank's records as written."""
    where, _ = runs
    trace = hooktrace.load(where / layout)
    viewed = trace.sql("SELECT * FROM records ORDER BY step, seq, rank")
    pd.testing.assert_frame_equal(
        viewed, trace.sql("SELECT * FROM logical_records ORDER BY step, seq, rank")
    )
    read = trace.query()
    assert len(viewed) == len(read) > 0
    assert list(viewed.columns) == list(read.columns)
    written = trace.sql("SELECT * FROM rank_records ORDER BY rank, step, seq")
    assert len(written) == len(trace.records) > len(viewed)
    assert written["seq"].tolist() == trace.records["seq"].tolist()
    for column in ("rank", "step", "module", "kind", "slot", "shape", "numel", "merged", "dp"):
        assert viewed[column].astype(str).tolist() == read[column].astype(str).tolist(), column
    for column in (*_STATS, "zero_fraction"):
        np.testing.assert_allclose(viewed[column], read[column], rtol=1e-12, err_msg=column)


_SAME_SQL = (
    "SELECT step, module, kind, slot, call, shape, numel, mean, std, min, max, norm, "
    "zero_fraction, nan_count FROM records WHERE step < 3 AND NOT contains(placements, 'P(') "
    "ORDER BY step, module, kind, slot, call"
)
"""A question in SQL whose answer does not depend on the layout (before the step where the
DDP sample's change was planted; a partial sum, never pooled, left out)."""


@pytest.mark.parametrize(
    ("layout", "partial"), [("fsdp2", 0), ("ddp", 0), ("tp", 2), ("fsdp_tp", 4)]
)
def test_the_same_sql_gives_the_one_processs_answer(
    runs: tuple[Path, list], layout: str, partial: int
) -> None:
    """A user's query over ``records`` answers about the model, whatever the layout: the
    one process's answer, to float rounding (each record once, the same shapes). Rowwise
    parallelism's fc2 output is a partial sum on each rank (the reduction comes after the
    module's hook): each rank's record stays its own."""
    where, _ = runs
    with_outputs = "one_outputs" if partial else "one"  # the same recording options
    one = hooktrace.load(where / with_outputs).sql(_SAME_SQL)
    trace = hooktrace.load(where / layout)
    got = trace.sql(_SAME_SQL)
    partials = trace.sql(
        "SELECT module, kind, merged FROM records WHERE step < 3 AND merged = 'partial'"
    )
    assert len(partials) == 3 * partial
    assert set(map(tuple, partials[["module", "kind"]].values)) <= {("fc2", "output")}
    if partial:
        one = one[~((one["module"] == "fc2") & (one["kind"] == "output"))].reset_index(drop=True)
    key = ["step", "module", "kind", "slot", "call", "numel", "nan_count"]
    assert len(got) == len(one) == 3 * _PER_STEP - (3 if partial else 0)
    pd.testing.assert_frame_equal(got[key], one[key])
    # the ReLU's local shards (no DTensor says where they lie) list their own shapes
    whole = ~got["shape"].str.contains("+", regex=False)
    assert (got["shape"][whole] == one["shape"][whole]).all() and whole.sum() >= len(got) - 6
    for column in (*_STATS, "zero_fraction"):
        np.testing.assert_allclose(got[column], one[column], rtol=1e-5, atol=1e-7, err_msg=column)


@pytest.mark.parametrize("layout", ["fsdp2", "ddp", "tp", "fsdp_tp"])
def test_sql_histograms_are_those_of_the_logical_records(
    runs: tuple[Path, list], layout: str
) -> None:
    """``histograms`` in a run of several ranks: a row per logical record, under its rank
    and seq in ``records``, its counts the sum of its parts' (``histograms()`` sums them in
    numpy); the initial parameters' bins are the one process's; ``rank_histograms`` holds
    each rank's."""
    where, _ = runs
    trace = hooktrace.load(where / layout)
    viewed = trace.sql("SELECT * FROM histograms ORDER BY rank, step, seq")
    summed = trace.histograms()
    assert len(viewed) == len(summed) > 0
    assert list(viewed.columns) == list(summed.columns)
    for column in ("rank", "step", "seq", "module", "kind", "slot"):
        assert viewed[column].astype(str).tolist() == summed[column].astype(str).tolist()
    for column in ("numel", "zero", "nan", "pos_inf", "neg_inf"):
        assert viewed[column].tolist() == summed[column].tolist(), column
    for sign in ("pos", "neg"):
        assert np.array_equal(np.stack(viewed[sign]), np.stack(summed[sign])), sign
    joined = trace.sql(
        "SELECT h.numel AS counted, r.numel, r.kind FROM histograms h "
        "JOIN records r USING (rank, step, seq)"
    )
    assert len(joined) == len(viewed)
    assert (joined["counted"] == joined["numel"]).all()
    bins = "SELECT module, slot, pos, neg FROM histograms WHERE kind = 'param' AND step = 0 "
    bins += "ORDER BY module, slot"
    one = hooktrace.load(where / "one").sql(bins)
    got = trace.sql(bins)
    assert got[["module", "slot"]].equals(one[["module", "slot"]]) and len(got) == 4
    for sign in ("pos", "neg"):
        assert np.array_equal(np.stack(got[sign]), np.stack(one[sign])), sign
    rows = trace.sql("SELECT count(*) AS n, count(DISTINCT rank) AS ranks FROM rank_histograms")
    assert rows.iloc[0].tolist() == [trace.histogram_count, len(trace.ranks)]


def test_a_tensor_only_another_rank_holds_pairs_with_one_process(tmp_path: Path) -> None:
    """Pipeline-like: rank 1 holds fc2's records and rank 0 the rest. The logical records
    pair by tensor whatever rank holds them (they were left unpaired, rank 1 against 0)."""
    import shutil

    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    split = tmp_path / "split"
    shutil.copytree(SAMPLES / "one", split)
    parts = sorted((split / "records" / "rank=0").glob("part-*.parquet"))
    (split / "records" / "rank=1").mkdir()
    for part in parts:
        table = pq.read_table(part, partitioning=None)
        on_one = pc.equal(table.column("module").cast("string"), "fc2")
        pq.write_table(table.filter(pc.invert(on_one)), part)
        pq.write_table(table.filter(on_one), split / "records" / "rank=1" / part.name)
    status = (split / "status" / "rank=0.json").read_text().replace('"rank": 0', '"rank": 1')
    (split / "status" / "rank=1.json").write_text(status)
    result = hooktrace.diff(SAMPLES / "one", split)
    assert result.match and result.records == 6 * _PER_STEP, result
    assert "run B 2 ranks" in result.notes[0]


def _bins(frame: pd.DataFrame) -> dict[tuple, int]:
    """``hooktrace.hist``'s rows as {(module, kind, slot, bin, exponent): count}."""
    return {
        (r.module, r.kind, r.slot, r.bin, None if pd.isna(r.exponent) else int(r.exponent)): r.count
        for r in frame.itertuples()
    }


@pytest.mark.parametrize("layout", ["fsdp2", "ddp", "tp", "fsdp_tp"])
def test_histograms_of_logical_tensors_are_the_whole_tensors(
    runs: tuple[Path, list], layout: str
) -> None:
    """At step 0 every layout holds the same initial parameters (sharded, replicated, or
    both): their logical histograms are those of the whole tensors, bin for bin, as numpy
    counts them from the model torch builds; rank by rank, the shards add up to them and a
    replica holds them whole."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("example", ROOT / "examples" / "distributed.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)  # the example's own model, seeded as it seeds it
    truth = {}
    for name, param in example.MLP().named_parameters():
        module, slot = name.split(".")
        values = param.detach().double().numpy().ravel()
        exponent = np.frexp(np.abs(values))[1] - 1  # 2^e <= |x| < 2^(e+1)
        for sign, chosen in (("pos", values > 0), ("neg", values < 0)):
            found, counts = np.unique(exponent[chosen], return_counts=True)
            for e, n in zip(found.tolist(), counts.tolist(), strict=True):
                truth[(module, "param", slot, sign, e)] = n
    where, _ = runs
    logical = hooktrace.hist(where / layout, kinds=["param"], steps=[0])
    assert logical.attrs["logical"] and (logical["rank"] == 0).all()
    assert _bins(logical) == truth
    per_rank = hooktrace.hist(where / layout, kinds=["param"], steps=[0], per_rank=True)
    assert not per_rank.attrs["logical"] and per_rank["rank"].nunique() > 1
    # shards add up to the whole, and each copy of a replica holds it (DDP's parameters,
    # rowwise parallelism's bias on each tensor-parallel rank): per rank, the counts summed
    # over the ranks are the truth times the copies of each shard
    params = hooktrace.load(where / layout).query(steps=[0], kinds=["param"], logical=False)
    offsets = params.groupby(["module", "slot"], observed=True)["shard_offset"].nunique()
    copies = (params.groupby(["module", "slot"], observed=True).size() // offsets).to_dict()
    summed = per_rank.groupby(["module", "kind", "slot", "bin", "exponent"], dropna=False)
    counted = _bins(summed["count"].sum().reset_index())
    assert {k: n // copies[(k[0], k[2])] for k, n in counted.items()} == truth
    assert any(n > 1 for n in copies.values()) == (layout != "fsdp2")
    # the SQL view holds the parts, each under its logical record's rank and seq
    viewed = hooktrace.load(where / layout).sql(
        "SELECT module, slot, sum(numel) AS numel, count(DISTINCT (rank, seq)) AS records "
        "FROM logical_histogram_spans WHERE kind = 'param' AND step = 0 GROUP BY ALL"
    )
    assert (viewed["records"] == 1).all()
    sizes = {n: p.numel() for n, p in example.MLP().named_parameters()}
    assert {f"{m}.{s}": n for m, s, n in viewed[["module", "slot", "numel"]].values} == sizes


@pytest.mark.parametrize("layout", ["tp", "fsdp_tp"])
def test_activation_histograms_pool_the_ranks_parts(runs: tuple[Path, list], layout: str) -> None:
    """The ReLU between a colwise and a rowwise layer holds a local shard on each
    tensor-parallel rank, and under FSDP2 + TP each data-parallel rank half the batch: pooled,
    its histogram is the one process's, bin for bin, at every step."""
    where, _ = runs
    one = hooktrace.hist(where / "one_outputs", modules=["act"], kinds=["output"])
    pooled = hooktrace.hist(where / layout, modules=["act"], kinds=["output"])
    key = ["step", "bin", "exponent"]
    pd.testing.assert_frame_equal(
        pooled[[*key, "numel", "count"]].reset_index(drop=True),
        one[[*key, "numel", "count"]].reset_index(drop=True),
    )


@pytest.mark.parametrize("layout", ["fsdp2", "tp", "fsdp_tp"])
def test_precision_measures_logical_tensors(runs: tuple[Path, list], layout: str) -> None:
    """``precision`` pools a tensor's parts over the ranks: at step 0 (the same parameters
    everywhere) the one process's numbers; ``--per-rank`` measures each rank's shard."""
    where, _ = runs
    measured = {
        name: hooktrace.precision(where / name, steps=[0], kinds=["param"])
        for name in ("one", layout)
    }
    assert measured[layout].attrs["logical"]
    pd.testing.assert_frame_equal(measured[layout], measured["one"], check_categorical=False)
    per_rank = hooktrace.precision(where / layout, steps=[0], kinds=["param"], per_rank=True)
    assert set(per_rank["rank"]) == set(hooktrace.load(where / layout).ranks)
    weights = [frame[frame["slot"] == "weight"] for frame in (per_rank, measured["one"])]
    totals = weights[0].groupby("module")["nonzero"].sum()  # the weights are sharded: no copy
    assert totals.to_dict() == weights[1].set_index("module")["nonzero"].to_dict()
    shown = CliRunner().invoke(cli, ["precision", str(where / layout), "--kinds", "param"])
    assert shown.exit_code == 0 and "logical tensors" in shown.output
    header = shown.output.splitlines()[3]
    assert header.startswith("module  kind"), header  # no rank column
    apart = CliRunner().invoke(cli, ["precision", str(where / layout), "--per-rank"])
    assert apart.exit_code == 0 and apart.output.splitlines()[2].startswith("rank")


@pytest.mark.parametrize("layout", ["fsdp2", "ddp", "tp", "fsdp_tp"])
def test_dead_relus_places_the_units_of_every_rank(runs: tuple[Path, list], layout: str) -> None:
    """The ReLU's 32 units: under tensor parallelism each peer holds 16 of them (a local
    shard), side by side in rank order; the data-parallel ranks' counts of a unit add up.
    With a bound that makes units "dead" (positive in under 60% of their values), every
    layout finds the units the one process finds, with the same activity."""
    where, _ = runs
    options = {"threshold": 0.6, "min_steps": 1, "layer_threshold": 0.0}
    one = hooktrace.dead_relus(where / "one", **options)
    found = hooktrace.dead_relus(where / layout, **options)
    assert len(one.units) > 3 and int(one.layers["units"].iloc[0]) == 32
    columns = ["module", "unit", "since", "dead_steps"]
    pd.testing.assert_frame_equal(found.units[columns], one.units[columns])
    np.testing.assert_allclose(found.units["activity"], one.units["activity"], rtol=1e-12)
    layer = ["units", "dead", "since", "steps"]
    assert found.layers[layer].to_dict("records") == one.layers[layer].to_dict("records")
    if "tp" in layout:  # one rank's own: its 16
        mine = hooktrace.dead_relus(where / layout, ranks=[1], **options)
        assert int(mine.layers["units"].iloc[0]) == 16
        # a pair of peers chosen: their units side by side, not summed unit by unit
        pair = hooktrace.dead_relus(where / layout, ranks=[0, 1], **options)
        assert int(pair.layers["units"].iloc[0]) == 32
        if layout == "tp":  # the pair is every rank
            pd.testing.assert_frame_equal(pair.units, found.units)
        shown = CliRunner().invoke(cli, ["dead-relus", str(where / layout), "--ranks", "1"])
        assert shown.exit_code == 0 and "\nact             ReLU          16" in shown.output


@pytest.mark.parametrize("layout", ["fsdp2", "ddp", "tp", "fsdp_tp"])
def test_the_pictures_tables_draw_logical_tensors(runs: tuple[Path, list], layout: str) -> None:
    """plot's tables of a run of several ranks: its logical tensors, the one process's
    numbers (gradient norms and the outputs' RMS to float rounding, silent units exactly);
    ``rank=R`` draws that rank's own."""
    from hooktrace.analyze.plots import tables

    where, _ = runs
    one, other = where / "one", where / layout
    steps = "0-2" if layout == "ddp" else None  # the DDP run's rank 1 went its own way at 3
    activations = lambda run, **o: tables.activation_tables(run, **o)[0]  # noqa: E731
    for table in (tables.grad_norm_table, activations):
        expected = table(one, steps=steps)
        got = table(other, steps=steps)
        if "tp" in layout and table is activations:  # fc2's output: a partial sum
            expected = expected.drop(index="fc2")
        assert list(got.index) == list(expected.index) and got.shape == expected.shape
        np.testing.assert_allclose(got.to_numpy(), expected.to_numpy(), rtol=1e-5)
    silent = {"threshold": 0.6, "steps": steps}
    pd.testing.assert_frame_equal(
        tables.silent_unit_table(other, **silent), tables.silent_unit_table(one, **silent)
    )
    if layout != "ddp":  # a shard's gradient norm is less than the whole's
        mine = tables.grad_norm_table(other, rank=0).to_numpy()
        assert (mine < tables.grad_norm_table(one).to_numpy()).all()
