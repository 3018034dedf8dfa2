"""The logical view (hooktrace.trace.logical) on records built by hand from numpy arrays: the
pooled statistics equal numpy's of the whole array, for shards, data-parallel parts and
their mixtures; replicas count once; partial sums and lone records pass as they are. The
real layouts (FSDP2, DDP under torchrun) are in tests/analyze/diff/test_layouts.py."""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from hooktrace.trace import logical, logical_arrays

_KEY = {"step": 0, "micro_step": 0, "phase": "train", "module": "fc", "call": 0, "slot": "0"}


def record(values: np.ndarray, *, rank: int, kind: str = "output", **shard: str) -> dict[str, Any]:
    """A record of ``values`` as the recorder writes it: numpy's statistics (std ddof 0)."""
    flat = values.astype(np.float64).ravel()
    finite = not np.isnan(flat).any()
    return {
        **_KEY, "rank": rank, "kind": kind, "seq": 5, "dtype": "float32",
        "shape": ",".join(map(str, values.shape)), "numel": flat.size,
        "mean": flat.mean(), "std": flat.std(), "min": flat.min() if finite else math.nan,
        "max": flat.max() if finite else math.nan, "norm": float(np.sqrt((flat**2).sum())),
        "zero_fraction": float((flat == 0).mean()), "nan_count": int(np.isnan(flat).sum()),
        "inf_count": int(np.isinf(flat).sum()), "note": "", "units": 0, "tensor_key": "",
        "logical_shape": shard.get("logical_shape", ""), "placements": shard.get("placements", ""),
        "shard_offset": shard.get("shard_offset", ""),
    }  # fmt: skip


@pytest.fixture(params=["numpy", "sql"], autouse=True)
def _engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every case twice: the numpy view the analyzer reads chunks with, and the SQL view
    (``logical_records``); both must give the same answer."""
    monkeypatch.setattr(sys.modules[__name__], "_ENGINE", request.param)


_ENGINE = "numpy"


def logical_of(table: pa.Table, layout: dict[int, int] | None = None) -> pa.Table:
    """The engine's logical records of ``table``."""
    engine = logical.query_table if _ENGINE == "sql" else logical_arrays.logical_table
    return engine(table, layout)


def view(*records: dict[str, Any], layout: dict[int, int] | None = None) -> list[dict[str, Any]]:
    table = pa.Table.from_pylist(list(records))
    assert _parts_of(table, layout, "numpy") == _parts_of(table, layout, "sql")
    return logical_of(table, layout).to_pylist()


def _parts_of(table: pa.Table, layout: dict[int, int] | None, engine: str) -> list[tuple]:
    """(rank, step, seq, the logical record's rank) of each record that the logical records
    pool (hooktrace.trace.logical.parts, logical_arrays.parts), sorted: one answer."""
    if engine == "sql":
        import duckdb

        con = duckdb.connect()
        con.register("records_", table)
        found = con.sql(logical.parts("records_", layout)).fetchall()
        return sorted((r, step, seq, lowest) for r, step, seq, lowest, _ in found)
    rows, record_of, _ = logical_arrays.parts(table, layout)
    rank, step, seq = (table.column(c).to_numpy()[rows] for c in ("rank", "step", "seq"))
    lowest = {int(g): int(r) for g, r in zip(record_of[::-1], rank[::-1], strict=True)}
    return sorted(
        (int(r), int(st), int(sq), lowest[int(g)])
        for r, st, sq, g in zip(rank, step, seq, record_of, strict=True)
    )


def assert_stats_of(row: dict[str, Any], whole: np.ndarray, *, per: float = 1.0) -> None:
    """``row`` holds numpy's statistics of ``whole`` (its values divided by ``per``)."""
    expected = record(whole / per, rank=0)
    assert row["numel"] == whole.size and row["shape"] == expected["shape"]
    for name in ("mean", "std", "min", "max", "norm", "zero_fraction"):
        assert row[name] == pytest.approx(expected[name], rel=1e-12, abs=1e-15, nan_ok=True), name
    assert (row["nan_count"], row["inf_count"]) == (expected["nan_count"], expected["inf_count"])


@pytest.fixture
def values() -> np.ndarray:
    rng = np.random.default_rng(0)
    out = rng.normal(3.0, 0.5, size=(6, 5))  # a mean far from 0: Chan's formula matters
    out[0, :3] = 0
    return out


def test_a_record_of_one_rank_passes_bit_for_bit(values: np.ndarray) -> None:
    alone = record(values, rank=0)
    alone["mean"] = 0.1 + 0.2  # not what a sum over one part would give back
    [row] = view(alone)
    assert {k: row[k] for k in alone} == alone
    assert (row["ranks"], row["dp"], row["merged"]) == (1, 1, "")


@pytest.mark.parametrize("rows", [[3, 3], [4, 2], [1, 2, 3]])
def test_shards_of_a_parameter_pool_into_the_whole_tensors_statistics(
    values: np.ndarray, rows: list[int]
) -> None:
    starts = np.cumsum([0, *rows[:-1]])
    shards = [
        record(values[s : s + n], rank=r, kind="param", logical_shape="6,5",
               placements="S(0)", shard_offset=f"{s},0")
        for r, (s, n) in enumerate(zip(starts, rows, strict=True))
    ]  # fmt: skip
    [row] = view(*shards)
    assert_stats_of(row, values)
    assert (row["ranks"], row["dp"], row["merged"], row["placements"]) == (
        len(rows),
        1,
        "shards",
        "",
    )


def test_a_nan_in_one_shard_makes_the_whole_nan(values: np.ndarray) -> None:
    values[4, 1] = math.nan
    shards = [
        record(values[:3], rank=0, kind="param", logical_shape="6,5", placements="S(0)",
               shard_offset="0,0"),
        record(values[3:], rank=1, kind="param", logical_shape="6,5", placements="S(0)",
               shard_offset="3,0"),
    ]  # fmt: skip
    [row] = view(*shards)
    assert row["nan_count"] == 1
    assert all(math.isnan(row[name]) for name in ("mean", "std", "min", "max", "norm"))


def test_shards_that_do_not_add_up_say_so(values: np.ndarray) -> None:
    shards = [
        record(values[:2], rank=r, kind="param", logical_shape="6,5", placements="S(0)",
               shard_offset=f"{2 * r},0")
        for r in range(2)
    ]  # fmt: skip  # the third rank's shard is missing
    [row] = view(*shards)
    assert row["merged"] == "incomplete shards" and row["numel"] == 20


def test_hsdp_shards_replicated_across_the_replica_dimension_count_once(
    values: np.ndarray,
) -> None:
    """HSDP on a 2x2 mesh (replicate, shard): ranks 0 and 2 hold rows 0-2, 1 and 3 rows 3-5."""
    shards = [
        record(values[3 * (r % 2) : 3 * (r % 2) + 3], rank=r, kind="param", logical_shape="6,5",
               placements="R,S(0)", shard_offset=f"{3 * (r % 2)},0")
        for r in range(4)
    ]  # fmt: skip
    [row] = view(*shards)
    assert_stats_of(row, values)
    assert (row["ranks"], row["dp"], row["merged"]) == (4, 1, "shards")


def test_replicas_of_a_parameter_count_once(values: np.ndarray) -> None:
    replicas = [record(values, rank=r, kind=kind) for r in (2, 0, 1) for kind in ("param",)]
    replicas[0]["mean"] += 1e-3  # rank 2 out of step: the lowest rank's is the logical one
    [row] = view(*replicas)
    assert row["mean"] == replicas[1]["mean"] and row["numel"] == values.size
    assert (row["rank"], row["ranks"], row["merged"]) == (0, 3, "replicas")


def test_data_parallel_parts_pool_into_the_global_batch(values: np.ndarray) -> None:
    [row] = view(record(values[:2], rank=0), record(values[2:], rank=1))
    assert_stats_of(row, values)
    assert (row["shape"], row["dp"], row["merged"]) == ("6,5", 2, "batch")


def test_activation_gradients_are_divided_by_the_data_parallel_degree(values: np.ndarray) -> None:
    parts = [record(part, rank=r, kind="grad_output") for r, part in enumerate(np.split(values, 3))]
    [row] = view(*parts)
    assert_stats_of(row, values, per=3)
    assert row["zero_fraction"] == pytest.approx(3 / 30)  # a fraction is not divided


def test_parts_of_other_trailing_shapes_list_them(values: np.ndarray) -> None:
    [row] = view(record(values[:, :2], rank=0), record(values[:, 2:], rank=1))
    assert row["shape"] == "6,2+6,3" and row["numel"] == 30


def test_tensor_parallel_shards_of_data_parallel_parts(values: np.ndarray) -> None:
    """FSDP2 + TP on a 2x2 mesh: each data-parallel rank pair holds the two column shards
    of its half of the batch (a DTensor over the TP mesh)."""
    batch = np.concatenate([values, values[::-1] * 2])  # the global batch: 12 rows
    parts = []
    for dp, half in enumerate(np.split(batch, 2)):
        for tp, (start, cols) in enumerate(((0, 3), (3, 2))):
            parts.append(record(half[:, start : start + cols], rank=2 * dp + tp,
                                logical_shape="6,5", placements="S(1)", shard_offset=f"0,{start}"))  # fmt: skip
    [row] = view(*parts)
    assert_stats_of(row, batch)
    assert (row["shape"], row["dp"], row["ranks"], row["merged"]) == ("12,5", 2, 4, "shards, batch")


def test_an_activation_the_ranks_share_counts_once_per_data_parallel_rank(
    values: np.ndarray,
) -> None:
    """Tensor parallelism's replicated activation: identical on the two TP ranks of each
    data-parallel rank."""
    halves = np.split(values, 2)
    parts = [record(halves[rank // 2], rank=rank, kind="grad_output") for rank in range(4)]
    [row] = view(*parts)
    assert_stats_of(row, values, per=2)
    assert (row["dp"], row["ranks"], row["merged"]) == (2, 4, "batch")


@pytest.mark.parametrize("kind", ["output", "grad_output"])
def test_local_shards_of_tensor_parallel_peers_where_the_layout_is_known(
    values: np.ndarray, kind: str
) -> None:
    """Ranks 0 and 1 hold one half of the batch, 2 and 3 the other (the recording said so);
    each peer a plain tensor of its own columns (the local shard tensor parallelism hands
    on): pooled whole, the gradient divided by the data-parallel degree, 2, not by 4."""
    batch = np.concatenate([values, values[::-1] * 2])
    parts = [
        record(half[:, cols], rank=2 * dp + tp, kind=kind)
        for dp, half in enumerate(np.split(batch, 2))
        for tp, cols in enumerate((slice(0, 3), slice(3, 5)))
    ]
    [row] = view(*parts, layout={0: 0, 1: 0, 2: 1, 3: 1})
    expected = record(batch / (2 if kind == "grad_output" else 1), rank=0)
    for name in ("mean", "std", "min", "max", "norm", "zero_fraction"):
        assert row[name] == pytest.approx(expected[name], rel=1e-12), name
    assert (row["numel"], row["dp"], row["merged"]) == (60, 2, "local shards, batch")
    assert row["shape"] == "6,3+6,2"  # the lowest data-parallel rank's shards, in rank order
    # without the layout, the four parts are taken for four data-parallel ranks' batches
    [guessed] = view(*parts)
    assert (guessed["dp"], guessed["merged"]) == (4, "batch")


def test_a_loss_of_each_rank_pools_into_their_mean() -> None:
    losses = [record(np.array(v), rank=r, kind="output") for r, v in enumerate((0.5, 1.5))]
    [row] = view(*losses)
    assert (row["shape"], row["numel"], row["mean"], row["std"]) == ("", 1, 1.0, 0.0)
    assert (row["min"], row["max"], row["norm"], row["dp"]) == (1.0, 1.0, 1.0, 2)


def test_partial_sums_are_never_pooled(values: np.ndarray) -> None:
    parts = [
        record(values * (r + 1), rank=r, logical_shape="6,5", placements="P(sum)",
               shard_offset="0,0")
        for r in range(2)
    ]  # fmt: skip
    rows = view(*parts)
    assert [(r["rank"], r["merged"], r["placements"]) for r in rows] == [
        (0, "partial", "P(sum)"),
        (1, "partial", "P(sum)"),
    ]
    assert [r["mean"] for r in rows] == [p["mean"] for p in parts]


def test_a_part_not_summarised_leaves_the_whole_unsummarised(values: np.ndarray) -> None:
    skipped = record(values[:3], rank=1)
    skipped.update(dict.fromkeys(("mean", "std", "min", "max", "norm", "zero_fraction")))
    skipped["note"] = "skipped: tensor subclass Odd"
    [row] = view(record(values[3:], rank=0), skipped)
    assert row["mean"] is None and row["norm"] is None
    assert row["note"] == "skipped: tensor subclass Odd"


def test_the_view_names_the_columns_it_needs() -> None:
    with pytest.raises(ValueError, match="placements"):
        logical.select("records", [c for c in logical.NEEDED if c != "placements"])


def test_an_empty_shard_leaves_the_others_statistics_whole() -> None:
    """torch.chunk gives the last rank nothing where the rows run out (3 rows on 4 ranks):
    its record's statistics are NaN, and they are no part of the whole's."""
    values = np.array([1.0, -2.0, 0.0])
    shards = [
        record(values[r : r + 1], rank=r, kind="param", logical_shape="3", placements="S(0)",
               shard_offset=str(r))
        for r in range(3)
    ]  # fmt: skip
    empty = {**shards[0], "rank": 3, "shape": "0", "numel": 0, "shard_offset": "3",
             "nan_count": 0, "inf_count": 0, "zero_fraction": math.nan,
             **dict.fromkeys(("mean", "std", "min", "max", "norm"), math.nan)}  # fmt: skip
    [row] = view(*shards, empty)
    assert_stats_of(row, values)
    assert (row["ranks"], row["merged"]) == (4, "shards")


def test_an_activation_alike_on_some_data_parallel_ranks_only_is_no_replica() -> None:
    """Zero gradients on ranks 0 and 1, others on 2 and 3, under DDP (the layout known):
    four parts of the batch, not three."""
    rng = np.random.default_rng(1)
    halves = [np.zeros((4, 3)), np.zeros((4, 3)), rng.normal(size=(4, 3)), rng.normal(size=(4, 3))]
    parts = [record(h, rank=r, kind="grad_output") for r, h in enumerate(halves)]
    [row] = view(*parts, layout={0: 0, 1: 1, 2: 2, 3: 3})
    assert_stats_of(row, np.concatenate(halves), per=4)
    assert (row["shape"], row["dp"], row["zero_fraction"]) == ("16,3", 4, 0.5)


def test_no_records_make_no_logical_records() -> None:
    found = logical_of(pa.Table.from_pylist([record(np.ones(2), rank=0)]).slice(0, 0))
    assert found.num_rows == 0 and found.column_names[-3:] == ["ranks", "dp", "merged"]
