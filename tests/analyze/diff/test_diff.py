"""``hooktrace.diff`` on pairs of real recordings with planted differences."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from diff_runs import Net, perturb_weight, scale_grad_from, scale_on_from, swap_weights, train
from scale_runs import many_parts, module_names

import hooktrace
from hooktrace.analyze.diff.diff import DEFAULT_ATOL, DEFAULT_RTOL, NothingToCompare
from hooktrace.errors import ConfigError, TraceNotFound
from hooktrace.trace.schema import GRAD_KINDS


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def base(runs: Path) -> Path:
    return train(runs / "base")


def test_same_seed_matches(base: Path, tmp_path: Path) -> None:
    result = hooktrace.diff(base, train(tmp_path / "again"))
    assert result.match and result.first is None
    assert result.differing == 0 and result.table.empty
    assert result.records == len(hooktrace.load(base).records)
    assert (result.steps, result.first_step, result.last_step) == (4, 0, 3)
    assert not result.structure.differs and result.notes == []
    assert "match over steps 0–3" in repr(result)


@pytest.mark.parametrize("module", ["fc1", "fc2"])
def test_perturbed_weight_diverges_first_at_that_module(
    base: Path, tmp_path: Path, module: str
) -> None:
    result = hooktrace.diff(base, train(tmp_path / "b", before_step=perturb_weight(module, 2)))
    first = result.first
    assert first is not None and not result.match
    assert (first.step, first.module, first.slot) == (2, module, "weight")
    assert first.kind == "param" and first.kind not in GRAD_KINDS and first.pass_name == "forward"
    assert first.values and all(a != b for a, b in first.values.values())
    assert result.table["step"].min() == 2  # nothing differs before
    assert list(result.table.iloc[0][["step", "module", "kind"]]) == [2, module, "param"]


def test_changed_op_diverges_at_its_output(base: Path, tmp_path: Path) -> None:
    result = hooktrace.diff(base, train(tmp_path / "b", before_step=scale_on_from(2)))
    first = result.first
    assert first is not None
    assert (first.step, first.module, first.kind, first.pass_name) == (
        2,
        "scale",
        "output",
        "forward",
    )
    a, b = first.values["mean"]
    assert b == pytest.approx(a * 1.001, rel=1e-5)


def test_data_order_diverges_at_step_0_first_module(base: Path, tmp_path: Path) -> None:
    result = hooktrace.diff(base, train(tmp_path / "b", reverse_data=True))
    step0 = hooktrace.load(base).query(steps=[0])
    expected = step0[step0["kind"] != "param"].iloc[0]  # same initial parameters
    first = result.first
    assert first is not None
    assert (first.step, first.module, first.kind) == (0, expected["module"], expected["kind"])
    assert (first.module, first.kind) == ("fc1", "output")


def test_gradient_only_change_diverges_in_the_backward_pass(base: Path, tmp_path: Path) -> None:
    result = hooktrace.diff(base, train(tmp_path / "b", before_step=scale_grad_from(1)))
    first = result.first
    assert first is not None and first.pass_name == "backward"
    assert (first.step, first.module, first.kind, first.slot) == (1, "fc2", "grad_param", "weight")
    assert first.values["norm"][1] == pytest.approx(2 * first.values["norm"][0], rel=1e-6)
    at_step_1 = result.table[result.table["step"] == 1]
    assert set(at_step_1["kind"].astype(str)) <= set(GRAD_KINDS)  # the forward is unchanged


def test_different_architectures_list_structure(base: Path, tmp_path: Path) -> None:
    result = hooktrace.diff(base, train(tmp_path / "b", hidden=16, extra=True))
    s = result.structure
    assert not result.match and s.differs
    assert s.modules_only_b == ["extra"] and s.modules_only_a == []
    changed = s.changed.set_index(["module", "kind", "slot"])
    assert changed.loc[("fc1", "output", "0"), "shape_a"] == "6,8"
    assert changed.loc[("fc1", "output", "0"), "shape_b"] == "6,16"
    assert changed.loc[("fc1", "param", "weight"), "step"] == 0
    assert s.records_only_b == len(hooktrace.load(tmp_path / "b").query(modules=["extra"]))
    assert result.first is not None and result.first.status == "changed"
    assert any("modules only in run B (1): extra" in line for line in s.lines())


def test_step_ranges_compared_over_overlap(base: Path, tmp_path: Path) -> None:
    result = hooktrace.diff(base, train(tmp_path / "short", n_steps=2))
    assert result.match and (result.steps_a, result.steps_b) == ((0, 3), (0, 1))
    assert (result.first_step, result.last_step) == (0, 1)
    assert any("compared the overlap, steps 0–1" in note for note in result.notes)
    sampled = hooktrace.diff(base, train(tmp_path / "every2", every=2))
    assert sampled.match and sampled.steps == 2 and sampled.structure.steps_only_a == [1, 3]


def test_statistics_match_an_independent_computation(base: Path, tmp_path: Path) -> None:
    other = train(tmp_path / "b", before_step=scale_on_from(1))
    table = hooktrace.diff(base, other, rows="all").table
    a, b = hooktrace.load(base).records, hooktrace.load(other).records
    keys = ["rank", "step", "micro_step", "phase", "module", "call", "kind", "slot"]
    joined = a.merge(b, on=keys, suffixes=("_a", "_b")).astype({k: str for k in keys})
    expected = joined.set_index(keys)["norm_b"] - joined.set_index(keys)["norm_a"]
    got = table.astype({k: str for k in keys}).set_index(keys)["d_norm"]
    assert len(table) == len(a) == len(b)
    pd.testing.assert_series_equal(got.sort_index(), expected.sort_index(), check_names=False)
    rtol = DEFAULT_RTOL
    differs = table["status"] == "differs"
    assert (table.loc[differs, "step"] >= 1).all() and differs.sum() > 0
    assert (
        table.loc[~differs, "d_norm"].abs() <= DEFAULT_ATOL + rtol * table.loc[~differs, "norm_a"]
    ).all()


def test_full_tensors_decide_exactly(base: Path, tmp_path: Path) -> None:
    swap = swap_weights("fc1", 1)
    a = train(tmp_path / "a", full_every=1)
    b = train(tmp_path / "b", full_every=1, before_step=swap)
    first = hooktrace.diff(a, b).first
    assert first is not None and (first.step, first.module, first.kind) == (1, "fc1", "param")
    wa = hooktrace.load(a).tensor("fc1", "param", step=1, slot="weight").astype(np.float64)
    wb = hooktrace.load(b).tensor("fc1", "param", step=1, slot="weight").astype(np.float64)
    assert first.errors["mismatch_fraction"] == pytest.approx(2 / wa.size)
    assert first.errors["max_abs_error"] == pytest.approx(np.abs(wa - wb).max())
    cosine = (wa * wb).sum() / np.linalg.norm(wa) / np.linalg.norm(wb)
    assert first.errors["cosine"] == pytest.approx(cosine)
    # statistics cannot see a swap: without full tensors the first divergence is downstream
    stats_only = hooktrace.diff(train(tmp_path / "c"), train(tmp_path / "d", before_step=swap))
    assert stats_only.first is not None
    assert (stats_only.first.step, stats_only.first.module, stats_only.first.kind) == (
        1,
        "fc1",
        "output",
    )
    assert hooktrace.diff(a, b, atol=10.0).match


def test_a_full_tensor_that_cannot_be_read_is_noted(tmp_path: Path) -> None:
    a = train(tmp_path / "a", full_every=1)
    b = train(tmp_path / "b", full_every=1)
    row = hooktrace.load(b).record("fc1", "output", step=2)
    segment = b / str(row["segment"])
    with h5py.File(segment, "r") as f:
        offset = f[str(row["tensor_key"])].id.get_offset()
    data = bytearray(segment.read_bytes())
    data[offset] ^= 0x01  # one value changed, its statistics recorded before: still equal
    segment.write_bytes(bytes(data))
    result = hooktrace.diff(a, b)
    assert result.match  # compared on its statistics
    assert result.notes == [
        f"1 full tensor(s) could not be read (first: run B: {row['segment']}:{row['tensor_key']} "
        "(TraceError)): their records were compared on statistics only; `hooktrace check` says "
        "what is damaged"
    ]
    tensors = len(hooktrace.load(a).records.query("tensor_key != ''"))
    for path in (a / "tensors").rglob("seg-*.h5"):
        path.unlink()
    notes = hooktrace.diff(a, b).notes  # every tensor of A, and still the damaged one of B
    assert notes[0].startswith(f"{tensors + 1} full tensor(s) could not be read (first: run A")


def test_nan_in_both_runs_is_no_divergence(tmp_path: Path) -> None:
    def poison(step: int, model: Net) -> None:
        model.scale.factor = float("nan")
        model.scale.on = step >= 1

    a = train(tmp_path / "a", before_step=poison)
    assert hooktrace.load(a).records["nan_count"].sum() > 0
    assert hooktrace.diff(a, train(tmp_path / "b", before_step=poison)).match
    only_b = hooktrace.diff(train(tmp_path / "c"), a)
    first = only_b.first
    assert first is not None and (first.step, first.module, first.kind) == (1, "scale", "output")
    assert "nan_count" in first.values


def test_chunks_give_the_same_answer(base: Path, tmp_path: Path) -> None:
    other = train(tmp_path / "b", before_step=scale_on_from(2))
    whole = hooktrace.diff(base, other, rows="all")
    chunked = hooktrace.diff(base, other, rows="all", chunk_rows=1)
    pd.testing.assert_frame_equal(whole.table, chunked.table)
    assert whole.first == chunked.first
    pd.testing.assert_frame_equal(whole.modules, chunked.modules)
    seen: list[int] = []
    streamed = hooktrace.diff(base, other, chunk_rows=1, sink=lambda frame: seen.append(len(frame)))
    assert streamed.table.empty and sum(seen) == whole.differing and len(seen) == 4
    early = hooktrace.diff(base, other, chunk_rows=1, stop_at_first=True)
    assert early.first == whole.first and not early.complete and early.records < whole.records
    # the table is bounded: the first rows, and a note of those left out, the rest as it was
    for chunk_rows in (1, 250_000):
        bounded = hooktrace.diff(base, other, rows="all", chunk_rows=chunk_rows, max_rows=30)
        pd.testing.assert_frame_equal(
            bounded.table, whole.table.head(30), check_dtype=False, check_categorical=False
        )
        assert bounded.notes == [
            f"the table holds the first 30 of {whole.records:,} records (max_rows): pass sink= "
            "to have them all chunk by chunk, or max_rows=None (`hooktrace diff --all --format "
            "parquet -o FILE` writes them all)"
        ]
        assert (bounded.first, bounded.differing) == (whole.first, whole.differing)
        pd.testing.assert_frame_equal(bounded.modules, whole.modules)
    assert hooktrace.diff(base, other, rows="all", max_rows=None).notes == []
    differing = hooktrace.diff(base, other, max_rows=2)
    pd.testing.assert_frame_equal(
        differing.table,
        whole.table[whole.table["status"] != "equal"].head(2).reset_index(drop=True),
        check_dtype=False,
        check_categorical=False,
    )
    assert differing.notes[0].startswith(
        f"the table holds the first 2 of {whole.differing:,} differing records (max_rows)"
    )
    with pytest.raises(ConfigError, match="max_rows must be 0 or more"):
        hooktrace.diff(base, other, max_rows=-3)
    for steps in [(-(2**64), 3), [-1, 2], "0-99999999999999999999"]:
        with pytest.raises(ConfigError, match="steps count from 0 and go up to"):
            hooktrace.diff(base, other, steps=steps, kinds=["output"])


def test_filters(base: Path, tmp_path: Path) -> None:
    other = train(tmp_path / "b", before_step=perturb_weight("fc1", 1))
    grads = hooktrace.diff(base, other, kinds=["grad_output", "grad_param"])
    assert grads.first is not None and grads.first.kind == "grad_output" and grads.first.step == 1
    fc2 = hooktrace.diff(base, other, modules="^fc2$")
    assert set(fc2.table["module"].astype(str)) == {"fc2"}
    assert fc2.first is not None and (fc2.first.module, fc2.first.kind) == ("fc2", "output")
    names = hooktrace.diff(base, other, modules=iter(["fc2", "act"]))  # read once, for both runs
    assert set(names.table["module"].astype(str)) == {"fc2", "act"}
    assert names.first is not None and (names.first.module, names.first.kind) == ("act", "output")
    later = hooktrace.diff(base, other, steps="3-")
    assert (later.first_step, later.steps) == (3, 1)
    assert hooktrace.diff(base, other, steps=(0, 0)).match
    # a pair of numpy integers, as a DataFrame's min() and max() give them, is a range too
    window = hooktrace.diff(base, other, steps=(1, 3))
    as_numpy = hooktrace.diff(base, other, steps=(np.int64(1), np.int64(3)))
    assert (as_numpy.steps, as_numpy.records) == (window.steps, window.records) == (3, 54)


def test_ranks_of_one_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "ddp"
    monkeypatch.setenv("WORLD_SIZE", "2")
    for rank in (0, 1):
        monkeypatch.setenv("RANK", str(rank))
        train(run, before_step=perturb_weight("fc2", 3) if rank == 1 else None)
    result = hooktrace.diff(run, rank=0, against_rank=1)
    assert result.ranks == (0, 1) and not result.match
    first = result.first
    assert first is not None and (first.step, first.module, first.kind) == (3, "fc2", "param")
    assert hooktrace.diff(run, run, ranks=[1]).match
    assert hooktrace.diff(run, run, rank=0, against_rank=1, steps="0-2").match
    with pytest.raises(NothingToCompare, match="no rank 5"):
        hooktrace.diff(run, rank=0, against_rank=5)


def test_errors(base: Path, tmp_path: Path) -> None:
    with pytest.raises(TraceNotFound):
        hooktrace.diff(base, tmp_path / "missing")
    with pytest.raises(NothingToCompare, match="no records that match"):
        hooktrace.diff(base, base, steps="100-")
    with pytest.raises(ConfigError, match="unknown kind"):
        hooktrace.diff(base, base, kinds=["outputs"])
    with pytest.raises(ConfigError, match="rtol"):
        hooktrace.diff(base, base, rtol=-1)
    with pytest.raises(ConfigError, match="rtol and atol are numbers"):  # was a TypeError
        hooktrace.diff(base, base, rtol="x")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="rank goes with against_rank"):  # was ignored
        hooktrace.diff(base, base, rank=3)
    assert hooktrace.diff(base, base, rtol=np.float32(1e-3), atol=np.int64(0)).match  # numpy's
    with pytest.raises(ConfigError, match="bad module pattern"):
        hooktrace.diff(base, base, modules="(")
    with pytest.raises(ConfigError, match="second run"):
        hooktrace.diff(base)
    late = train(tmp_path / "late", steps="2-3")
    with pytest.raises(NothingToCompare, match="share no recorded step"):
        hooktrace.diff(train(tmp_path / "early", steps="0-1"), late)


@pytest.fixture(scope="module")
def many(runs: Path) -> tuple[Path, Path]:
    a = many_parts(runs / "many-a")
    b = many_parts(runs / "many-b", perturb_from_step=12, perturb_module=module_names(10)[4])
    return a, b


def test_a_window_and_a_stop_at_the_first_read_only_the_steps_they_need(
    many: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hooktrace.trace.stream import RecordStream

    read: list[tuple[float, float]] = []  # the step span of each row group read
    read_group = RecordStream._read

    def watched(self: RecordStream, rank: int, queue: Any) -> list[pa.Table]:
        read.append((queue[0].first, queue[0].last))
        return read_group(self, rank, queue)

    monkeypatch.setattr(RecordStream, "_read", watched)
    window = hooktrace.diff(*many, steps="14-15")
    assert (window.first_step, window.last_step, window.records) == (14, 15, 80)
    assert read and all(first <= 15 and last >= 14 for first, last in read), read
    read.clear()
    first = hooktrace.diff(*many, stop_at_first=True, chunk_rows=40)
    assert first.first is not None and first.first.step == 12
    assert first.first.module == module_names(10)[4]
    # one step a chunk: the chunk of step 12, and step 13 read meanwhile
    assert not first.complete and max(first for first, _ in read) <= 13, read


def test_the_plan_counts_what_the_records_hold(many: tuple[Path, Path]) -> None:
    full = hooktrace.diff(*many)
    records = hooktrace.load(many[0]).records
    assert full.records == len(records) and full.steps == 40
    assert full.first is not None and (full.first.step, full.first.kind) == (12, "param")
    kinds = hooktrace.diff(*many, kinds=["grad_param"], modules="blocks\\.2", steps="10-")
    expected = records[
        (records["kind"] == "grad_param")
        & records["module"].astype(str).str.contains("blocks\\.2")
        & (records["step"] >= 10)
    ]
    assert kinds.records == len(expected) and kinds.first_step == 10


@pytest.mark.parametrize("damaged", [0, 1], ids=["its first row group", "its second"])
def test_where_duckdb_cannot_decode_a_part_the_reader_counts_a_part_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: int
) -> None:
    """The plan's counts with a module filter, past a few parts, come from one DuckDB query;
    where it fails on a part, hooktrace's reader counts, leaving the part out with a
    warning, a part's steps at a time: never the whole step column of a trace at once. A
    part found damaged after some of it was counted is not counted at all: the comparison
    reads none of it."""
    import pyarrow.parquet as pq

    from hooktrace.analyze.diff import diff as diff_module
    from hooktrace.errors import TraceWarning
    from hooktrace.trace.stream import RecordStream

    run = many_parts(tmp_path / "run", steps=12)
    part = sorted((run / "records" / "rank=0").glob("part-*.parquet"))[3]
    pq.write_table(pq.read_table(part), part, row_group_size=20, write_page_checksum=True)
    metadata = pq.read_metadata(part)
    assert metadata.num_row_groups == 2
    chunk = metadata.row_group(damaged).column(metadata.schema.names.index("module"))
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(part.read_bytes())
    for i in range(start + 8, start + chunk.total_compressed_size - 2):  # garbage over it
        data[i] ^= 0x5A
    part.write_bytes(bytes(data))
    handed: list[int] = []
    through = RecordStream.through

    def watched(self: RecordStream, step: int) -> pa.Table:
        table = through(self, step)
        handed.append(table.num_rows)
        return table

    monkeypatch.setattr(RecordStream, "through", watched)
    trace = hooktrace.load(run)
    names = module_names(10)[2:5]
    with pytest.warns(TraceWarning, match="part-000003"):
        counts = diff_module._step_counts(trace, names, None, None, diff_module._StepRanges(None))
    with pytest.warns(TraceWarning, match="part-000003"):
        records = hooktrace.load(run).query(columns=["step", "module"], modules=names)
    expected = records.groupby("step").size()
    assert 3 not in counts.index and len(counts) == 11
    pd.testing.assert_series_equal(counts, expected, check_names=False)
    # a part (a step) at a time, never the trace's
    assert len(handed) >= 11 and max(handed) == expected.max() < len(records)
    assert len(trace.skipped) == 1
