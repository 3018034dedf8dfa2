"""Records both runs hold bit for bit are counted, not compared (analyze/diff/same.py): the
answer must be the one a comparison of every record gives (``rows="all"`` compares every
record), on real recorded pairs."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from diff_runs import Net, perturb_weight, scale_grad_from, scale_on_from, swap_weights, train
from torch import nn

import hooktrace
from hooktrace.analyze.diff.same import same_rows
from hooktrace.trace.schema import RECORD_SCHEMA, STAT_COLUMNS

KEYS = ["rank", "step", "micro_step", "phase", "module", "call", "kind", "slot"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train(tmp_path_factory.mktemp("runs") / "base", n_steps=5)


@pytest.mark.parametrize(
    "other",
    [
        {"before_step": perturb_weight("fc1", 2)},
        {"before_step": scale_on_from(3)},
        {"before_step": scale_grad_from(1)},
        {"reverse_data": True},
        {"extra": True},  # another architecture: chunks that do not pair row by row
        {"steps": "2-"},  # the overlap only
        {},
    ],
    ids=["weight", "op", "grad", "data", "architecture", "overlap", "same"],
)
@pytest.mark.parametrize("chunk_rows", [1, 250_000])
def test_counting_gives_the_answer_of_comparing_every_record(
    base: Path, tmp_path: Path, other: dict[str, object], chunk_rows: int
) -> None:
    b = train(tmp_path / "b", n_steps=5, **other)  # type: ignore[arg-type]
    counted = hooktrace.diff(base, b, chunk_rows=chunk_rows)
    compared = hooktrace.diff(base, b, chunk_rows=chunk_rows, rows="all")
    _same_answer(counted, compared)


def test_full_tensors_are_compared_even_where_statistics_agree(tmp_path: Path) -> None:
    swap = swap_weights("fc1", 1)  # two weights swapped: the statistics agree
    a = train(tmp_path / "a", full_every=1)
    b = train(tmp_path / "b", full_every=1, before_step=swap)
    counted, compared = hooktrace.diff(a, b), hooktrace.diff(a, b, rows="all")
    _same_answer(counted, compared)
    first = counted.first
    assert first is not None and (first.step, first.module, first.kind) == (1, "fc1", "param")
    assert first.errors["mismatch_fraction"] > 0


def _same_answer(counted: hooktrace.DiffResult, compared: hooktrace.DiffResult) -> None:
    assert (counted.records, counted.differing) == (compared.records, compared.differing)
    assert counted.first == compared.first
    differing = compared.table[compared.table["status"] != "equal"].reset_index(drop=True)
    pd.testing.assert_frame_equal(_plain(counted.table), _plain(differing))
    pd.testing.assert_frame_equal(counted.modules, compared.modules)
    for field in ("modules_only_a", "modules_only_b", "kinds_only_a", "kinds_only_b",
                  "slots_only_a", "slots_only_b", "steps_only_a", "steps_only_b",
                  "records_only_a", "records_only_b"):  # fmt: skip
        assert getattr(counted.structure, field) == getattr(compared.structure, field), field
    pd.testing.assert_frame_equal(counted.structure.changed, compared.structure.changed)
    assert counted.notes == compared.notes


def _plain(table: pd.DataFrame) -> pd.DataFrame:
    """Categoricals as strings: the categories a subset keeps are not the answer."""
    return table.astype({c: str for c in table.select_dtypes("category").columns})


class Skips(nn.Module):
    """Returns a meta tensor beside its real output: a record with no statistics, every step."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"meta": torch.empty(3, 2, device="meta"), "plain": self.fc(x)}


def _skipping_run(path: Path) -> Path:
    torch.manual_seed(0)
    model = Skips()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with hooktrace.record(model, path):
        for _ in range(2):
            model(torch.ones(8, 4))["plain"].sum().backward()
            opt.step()
            opt.zero_grad()
    return path


def test_records_neither_run_could_summarise_match(tmp_path: Path) -> None:
    a, b = _skipping_run(tmp_path / "a"), _skipping_run(tmp_path / "b")
    skipped = hooktrace.load(a).records
    skipped = skipped[skipped["slot"] == "meta"]
    assert len(skipped) == 2 and skipped["nan_count"].isna().all()  # no counts: unknown
    for rows in ("differing", "all"):  # counted bit for bit, and compared
        result = hooktrace.diff(a, b, rows=rows)  # type: ignore[arg-type]
        assert result.match, result.table[["module", "slot", "exceeded"]]


def _table(
    rows: list[dict[str, object]],
    dictionaries: list[list[str]] | None = None,
    *,
    nullable: bool = False,
) -> pa.Table:
    """Records as one part or (``dictionaries``: the module names each chunk's dictionary
    lists first) several, as pyarrow reads a run of several parts."""
    full = {
        "rank": 0, "step": 0, "micro_step": 0, "phase": "train", "module": "fc", "call": 0,
        "kind": "output", "slot": "0", "seq": 0, "dtype": "float32", "shape": "2,2", "numel": 4,
        "mean": 0.5, "std": 1.0, "min": -1.0, "max": 2.0, "norm": 2.0, "zero_fraction": 0.0,
        "nan_count": 0, "inf_count": 0, "segment": "tensors/rank=0/seg-000000.h5",
        "tensor_key": "",
    }  # fmt: skip
    frame = pd.DataFrame([{**full, **row} for row in rows])
    schema = pa.schema([RECORD_SCHEMA.field(c) if c != "rank" else pa.field("rank", pa.int32())
                        for c in frame.columns])  # fmt: skip
    if nullable:  # as a part of an older minor version reads: its missing columns are null
        schema = pa.schema([field.with_nullable(True) for field in schema])
    if dictionaries is None:
        return pa.Table.from_pandas(frame, schema=schema, preserve_index=False)
    chunks = []
    for first, rows_of_part in zip(
        dictionaries, np.array_split(np.arange(len(frame)), len(dictionaries)), strict=True
    ):
        part = frame.iloc[rows_of_part]
        table = pa.Table.from_pandas(part, schema=schema, preserve_index=False)
        module = pa.DictionaryArray.from_arrays(
            pa.array([first.index(m) for m in part["module"]], pa.int32()), pa.array(first)
        )
        chunks.append(table.set_column(table.schema.get_field_index("module"), "module", module))
    return pa.concat_tables(chunks)


def test_same_rows_reads_dictionaries_nan_and_missing_values_as_compare_does() -> None:
    rows = [{"module": m, "seq": i} for i, m in enumerate(["a", "b", "c", "a"])]
    a = _table(rows)
    b = _table(rows, dictionaries=[["c", "b", "a"], ["a", "c", "b"]])  # other codes, same names
    same = same_rows(a, b, KEYS)
    assert same is not None and same.tolist() == [True] * 4
    nan = [{**rows[0], "mean": math.nan}, {**rows[1], "mean": None}, {**rows[2], "mean": math.nan},
           {**rows[3], "nan_count": None}]  # fmt: skip
    other = [{**rows[0], "mean": math.nan}, {**rows[1], "mean": None}, {**rows[2], "mean": 0.5},
             {**rows[3], "nan_count": 0}]  # fmt: skip
    assert same_rows(_table(nan), _table(other), KEYS).tolist() == [True, True, False, False]  # type: ignore[union-attr]
    saved = [{**rows[0], "tensor_key": "t0"}, {**rows[1], "tensor_key": "t1"}, rows[2], rows[3]]
    one_side = [{**rows[0], "tensor_key": "t0"}, rows[1], rows[2], rows[3]]
    assert same_rows(_table(saved), _table(one_side), KEYS).tolist() == [False, True, True, True]  # type: ignore[union-attr]
    assert same_rows(_table(rows), _table(rows[:3]), KEYS) is None  # another length
    moved = [*rows[:3], {**rows[3], "module": "b"}]
    assert same_rows(_table(rows), _table(moved), KEYS) is None  # a key differs
    bits = [{**rows[0], "mean": 0.5 + 2**-50}, *rows[1:]]  # within any tolerance, yet not the same
    assert same_rows(_table(rows), _table(bits), KEYS).tolist() == [False, True, True, True]  # type: ignore[union-attr]
    none = _table(rows).slice(0, 0)
    assert same_rows(none, none, KEYS).tolist() == []  # type: ignore[union-attr]


@pytest.mark.parametrize("marks", [0, 1 << 24])
def test_the_slots_both_runs_hold_are_named_whichever_way_they_are_kept(
    base: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, marks: int
) -> None:
    from hooktrace.analyze.diff.result import _Slots

    monkeypatch.setattr(_Slots, "MAX_MARKS", marks)  # 0: named chunk by chunk

    def drop_extra(step: int, model: Net) -> None:
        if step == 3:
            model.extra = None  # B's last steps lack a module that its first steps had

    a = train(tmp_path / "a", n_steps=5, extra=True)
    b = train(tmp_path / "b", n_steps=5, extra=True, before_step=drop_extra)
    for chunk_rows in (1, 7, 250_000):  # dictionaries that change between chunks, or not
        counted = hooktrace.diff(a, b, chunk_rows=chunk_rows)
        _same_answer(counted, hooktrace.diff(a, b, chunk_rows=chunk_rows, rows="all"))
        assert counted.structure.modules_only_a == counted.structure.modules_only_b == []
        assert counted.structure.records_only_a > 0


def test_rows_found_the_same_are_equal_to_compare_whatever_their_values() -> None:
    """A property: wherever same_rows says the same, compare (at zero tolerance) says equal,
    with every difference 0 or unknown; values drawn with nulls, NaN, -0.0, inf and ""."""
    from hooktrace.analyze.diff.compare import align, compare
    from hooktrace.trace.reader import records_frame

    pools: dict[str, list[object]] = {
        "dtype": ["float32", "float16", None],
        "shape": ["2,2", "4", "", None],
        "numel": [4, 0],
        **{s: [0.5, 0.0, -0.0, math.nan, math.inf, -math.inf, None] for s in STAT_COLUMNS},
        "nan_count": [0, 3, None],
        "inf_count": [0, None],
        "tensor_key": ["", "t0", None],
    }
    rng = np.random.default_rng(0)
    for _ in range(20):
        rows_a, rows_b = [], []
        for seq in range(60):
            row_a = {c: pool[rng.integers(len(pool))] for c, pool in pools.items()}
            # mostly the same value, else another draw
            row_b = {c: (v if rng.random() < 0.7 else pools[c][rng.integers(len(pools[c]))])
                     for c, v in row_a.items()}  # fmt: skip
            rows_a.append({"module": f"m{seq % 7}", "seq": seq, "call": seq, **row_a})
            rows_b.append({"module": f"m{seq % 7}", "seq": seq, "call": seq, **row_b})
        a, b = _table(rows_a, nullable=True), _table(rows_b, nullable=True)
        same = same_rows(a, b, KEYS)
        assert same is not None
        part = compare(
            align(records_frame(a), records_frame(b), KEYS), rtol=0.0, atol=0.0, tensors=None
        )
        found = part[same]
        assert (found["status"] == "equal").all(), found[["seq", "status", "exceeded"]]
        assert (found["rel_diff"] == 0).all()
        deltas = found[[c for c in part.columns if c.startswith("d_")]].to_numpy()
        assert np.all((deltas == 0) | np.isnan(deltas))


def test_a_column_missing_from_a_run_and_a_key_seen_twice_are_read_as_compare_reads_them() -> None:
    rows = [{"module": m, "seq": i} for i, m in enumerate(["a", "b", "a"])]
    missing = [{**row, "dtype": None, "phase": None} for row in rows]  # all null: no names
    both = same_rows(_table(missing, nullable=True), _table(missing, nullable=True), KEYS)
    assert both is not None and both.tolist() == [True] * 3
    phase_known = [{**row, "phase": "train"} for row in missing]
    assert (
        same_rows(_table(phase_known, nullable=True), _table(missing, nullable=True), KEYS) is None
    )
    dtype_only = [{**row, "dtype": None} for row in rows]
    found = same_rows(_table(rows, nullable=True), _table(dtype_only, nullable=True), KEYS)
    assert found is not None and found.tolist() == [False] * 3
    # one key twice, in another seq order in each run: pairing by position would be wrong
    twice = [{"module": "a", "seq": 0, "mean": 1.0}, {"module": "a", "seq": 1, "mean": 2.0}]
    swapped = [{"module": "a", "seq": 1, "mean": 1.0}, {"module": "a", "seq": 0, "mean": 2.0}]
    assert same_rows(_table(twice), _table(swapped), KEYS) is None
